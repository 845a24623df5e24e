# The two commands of the README: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY39   ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.9*/bin/python3) $(shell command -v python3.9))
PYTEST_ARGS ?=

.PHONY: demo test test-py39 venv deps-demo deps-test clean rpm

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

deps-demo:
	packaging/install-deps.sh demo

deps-test:
	packaging/install-deps.sh test

# A local 3-member cluster on 127.0.0.1 (ports 2379/22379/32379) until Ctrl-C.
demo: deps-demo venv
	$(VENV)/bin/etcd-agent demo

# Every tier: unit, integration (real etcd), multihost (namespaces + sshd), systemd (nspawn).
# pytest's exit code 5 means it collected nothing: a broken suite, reported as such.
test: deps-test venv
	@$(VENV)/bin/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests - the suite is broken, not passing" >&2; exit 1; fi; \
	exit $$rc
	@$(MAKE) --no-print-directory test-py39

# The unit tier again on Python 3.9 (EL9's python3), when a 3.9 is on this machine.
test-py39:
	@if [ -z "$(PY39)" ]; then echo "make test-py39: no Python 3.9 found; skipped" >&2; exit 0; fi; \
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
