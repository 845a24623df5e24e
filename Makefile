# The two commands of the README: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY39   ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.9*/bin/python3) $(shell command -v python3.9))
PYTEST_ARGS ?=

.PHONY: demo test test-py39 venv deps-demo deps-test clean rpm

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,typecheck]'
	touch $@

venv: $(VENV)/.installed

deps-demo:
	packaging/install-deps.sh demo

deps-test:
	packaging/install-deps.sh test

# A local 3-member cluster on 127.0.0.1 (ports 2379/22379/32379) until Ctrl-C, on the test suite's
# default release (packaging/etcd-test-releases), which deps-demo lays out under /opt/etcd: a 3.5
# with etcdutl beside it, which the rehearsal's point-in-time restore replays with.
DEMO_RELEASE ?= $(shell awk '$$3 == "default" {print $$1}' packaging/etcd-test-releases)
DEMO_ETCD ?= /opt/etcd/$(DEMO_RELEASE)
demo: deps-demo venv
	$(VENV)/bin/etcd-agent demo --etcd $(DEMO_ETCD)/etcd --etcdctl $(DEMO_ETCD)/etcdctl

# Every tier: the type check, lint and the rooms' import contracts (import-linter), then unit, component (orchestration against scripted
# hosts), integration (real etcd), multihost (namespaces
# + sshd), systemd (nspawn), then the unit tier on Python 3.9. Each runs even when an earlier one
# failed; the summary names every one that failed and the target fails if any did. pytest's exit
# code 5 means it collected nothing: a broken tier, reported as such.
# The loopback tier runs on two pytest-xdist workers (INTEGRATION_WORKERS=0 runs it in one
# process): its tests mostly wait on etcd, and each picks ports from its worker's own range. A
# file stays on one worker (--dist loadfile: module-scoped clusters and ordered tests); the demo's
# fixed ports are a flock (tests/integration/conftest.py), whose collection order deals the long
# files first (--no-loadscope-reorder keeps it). The namespace tier runs on two workers as well
# (MULTIHOST_WORKERS=0: one process): its tests wait on timeouts, elections and shaped links;
# files that share a bed's prefix go to one worker together (tests/harness/xdistbeds.py), and the
# controller holds the machine-wide bed lock. The nspawn tier can (SYSTEMD_WORKERS=2); it stays
# serial until its run on two workers has been seen green on a quiet machine. Each tier
# prints its 15 slowest tests (--durations): where
# the suite's half hour goes. The package is byte-compiled first, as the RPM ships it:
# with PYTHONDONTWRITEBYTECODE (set on these machines) every agent process a test starts would
# otherwise compile each module it imports.
TIERS ?= unit component integration multihost systemd
INTEGRATION_WORKERS ?= 2
XDIST_integration = $(if $(filter-out 0,$(INTEGRATION_WORKERS)),-n $(INTEGRATION_WORKERS) --dist loadfile --no-loadscope-reorder)
MULTIHOST_WORKERS ?= 2
XDIST_multihost = $(if $(filter-out 0,$(MULTIHOST_WORKERS)),-n $(MULTIHOST_WORKERS) --dist loadfile --no-loadscope-reorder)
SYSTEMD_WORKERS ?= 0
XDIST_systemd = $(if $(filter-out 0,$(SYSTEMD_WORKERS)),-n $(SYSTEMD_WORKERS) --dist loadfile --no-loadscope-reorder)
test: deps-test venv
	@failed=""; \
	echo "== mypy --strict"; $(VENV)/bin/mypy || failed="$$failed mypy"; \
	echo "== ruff"; $(VENV)/bin/ruff check etcd_agent tests bench || failed="$$failed ruff"; \
	echo "== lint-imports"; $(VENV)/bin/lint-imports --no-cache || failed="$$failed lint-imports"; \
	$(VENV)/bin/python -m compileall -q -j 0 etcd_agent >/dev/null || failed="$$failed compileall"; \
	for t in $(TIERS); do \
	  case $$t in integration) x="$(XDIST_integration)";; multihost) x="$(XDIST_multihost)";; systemd) x="$(XDIST_systemd)";; *) x="";; esac; \
	  echo "== tests/$$t"; $(VENV)/bin/python -m pytest tests/$$t $$x --durations=15 $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: tests/$$t collected no tests - the tier is broken, not passing" >&2; fi; \
	  [ $$rc -eq 0 ] || failed="$$failed $$t"; \
	done; \
	$(MAKE) --no-print-directory test-py39 || failed="$$failed py39"; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed" >&2; exit 1; fi; \
	echo "make test: every tier passed"

# The unit tier again on Python 3.9 (EL9's python3). CI machines have pyenv's 3.9: without one
# this fails rather than silently skipping the interpreter the RPM targets.
test-py39:
	@if [ -z "$(PY39)" ]; then echo "make test-py39: no Python 3.9 found (pyenv install 3.9, or PY39=...)" >&2; exit 1; fi; \
	[ -x .venv39/bin/python ] || $(PY39) -m venv .venv39; \
	.venv39/bin/pip install -q -e '.[test]' && \
	.venv39/bin/python -m pytest -q tests/unit; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-py39: no tests collected" >&2; exit 1; fi; exit $$rc

# The RPM (self-contained venv under /opt/etcd-agent) into dist/; RPM_RELEASE=N bumps the release.
# Build on a builder of the target release (EL9 -> Python 3.9): see packaging/build-rpm.sh.
rpm:
	packaging/build-rpm.sh

clean:
	rm -rf $(VENV) .venv39 build dist *.egg-info
