"""Pure checks that rpm.spec, the lock file and the macros fallback agree with the tree (no build:
tests/systemd/test_rpm.py inspects the built package)."""
from __future__ import annotations

import os
import re
import subprocess
from typing import Dict, List

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from etcd_agent import __version__

try:
    import tomllib  # type: ignore[import-not-found]
except ModuleNotFoundError:  # Python 3.9 / 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = os.path.join(REPO, "rpm.spec")
LOCK = os.path.join(REPO, "packaging", "requirements.lock")
TARGET_PYTHONS = ("3.9", "3.11")  # EL9's python3, and bookworm's (the test hosts)


def spec_text() -> str:
    with open(SPEC, encoding="utf-8") as f:
        return f.read()


def spec_global(name: str) -> str:
    m = re.search(r"^%\{!\?" + name + r": %global " + name + r" (.+)\}$", spec_text(), re.M) or \
        re.search(r"^%global " + name + r" (.+)$", spec_text(), re.M)
    assert m, name
    return m.group(1).strip()


def lock_pins(python_version: str) -> Dict[str, str]:
    """name -> pinned version of the lock lines that apply to python_version."""
    env = {"python_version": python_version, "python_full_version": python_version + ".0"}
    pins: Dict[str, str] = {}
    with open(LOCK, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            (spec,) = list(req.specifier)
            assert spec.operator == "==", line
            name = canonicalize_name(req.name)
            assert name not in pins, f"{name} pinned twice for {python_version}"
            pins[name] = spec.version
    return pins


def test_spec_default_version_is_the_package_version() -> None:
    assert spec_global("agent_version") == __version__


def test_spec_ships_every_unit_of_the_tree_but_etcd_service() -> None:
    units = spec_global("units").split()
    in_tree = sorted(u for u in os.listdir(os.path.join(REPO, "systemd")) if u != "etcd.service")
    assert sorted(units) == in_tree
    files_section = spec_text().split("\n%files", 1)[1]
    for unit in units:
        assert f"%{{_unitdir}}/{unit}" in files_section


def test_spec_install_reads_existing_files() -> None:
    install = spec_text().split("\n%install", 1)[1].split("\n%pre", 1)[0]
    for rel in re.findall(r"\b((?:conf|packaging)/[\w.-]+)", install):
        assert os.path.isfile(os.path.join(REPO, rel)), rel


def test_spec_declares_configs_and_backup_dir() -> None:
    files = spec_text().split("\n%files", 1)[1]
    # it may hold the S3 keys: never world-readable (installed so, and recorded so in the package)
    assert "%config(noreplace) %attr(0640,root,root) %{_sysconfdir}/etcd-agent/agent.toml" in files
    install = spec_text().split("\n%install", 1)[1].split("\n%pre", 1)[0]
    (line,) = [ln for ln in install.splitlines() if "conf/agent.toml" in ln]
    assert line.split()[:4] == ["install", "-D", "-m", "0640"], line
    assert "%config(noreplace) %{_sysconfdir}/cron.d/etcd-agent" in files
    assert "%dir %attr(0700,root,root) %{_sharedstatedir}/etcd_backup" in files
    # rendered by the agent, never shipped
    assert "etcd.conf" not in files and "/etcd.service" not in files


def test_the_drill_dir_is_packaged_0711_and_writable_by_the_daemon() -> None:
    """[drill] dir's default: the etcd user must traverse it, and under ProtectSystem=strict the
    daemon can only write where the unit says."""
    from etcd_agent.config import DrillSection

    assert DrillSection.dir == "/var/lib/etcd-agent-drill"
    files = spec_text().split("\n%files", 1)[1]
    assert "%dir %attr(0711,root,root) %{_sharedstatedir}/etcd-agent-drill" in files
    assert "install -d -m 0711 %{buildroot}%{_sharedstatedir}/etcd-agent-drill" in spec_text()
    with open(os.path.join(REPO, "systemd", "etcd-agent.service")) as fh:
        rw = [ln for ln in fh.read().splitlines() if ln.startswith("ReadWritePaths=")]
    assert any("-/var/lib/etcd-agent-drill" in ln.split() for ln in rw), rw


@pytest.mark.parametrize("python_version", TARGET_PYTHONS)
def test_lock_pins_every_dependency_within_pyproject_ranges(python_version: str) -> None:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps: List[str] = tomllib.load(f)["project"]["dependencies"]
    pins = lock_pins(python_version)
    env = {"python_version": python_version, "python_full_version": python_version + ".0"}
    for dep in deps:
        req = Requirement(dep)
        if req.marker is not None and not Marker(str(req.marker)).evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{name} not locked for Python {python_version}"
        assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name])


def test_fallback_macros_define_what_the_spec_uses() -> None:
    with open(os.path.join(REPO, "packaging", "macros.systemd-fallback"), encoding="utf-8") as f:
        defined = set(re.findall(r"^%(\w+)", f.read(), re.M))
    used = {"_unitdir", "_sharedstatedir", "systemd_requires", "systemd_post", "systemd_preun",
            "systemd_postun_with_restart"}
    assert used <= defined
    spec = spec_text()
    for name in used - {"_unitdir", "_sharedstatedir"}:
        assert re.search(r"%\{?\??" + name + r"\b", spec), name


def test_build_script_is_valid_bash() -> None:
    script = os.path.join(REPO, "packaging", "build-rpm.sh")
    assert os.access(script, os.X_OK)
    res = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
