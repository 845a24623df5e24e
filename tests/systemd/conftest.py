"""Fixtures of the systemd tier: nspawn containers booting real systemd (root only).

The base tree is built once and cached (tests/harness/rootfs.py); each test module gets a fresh
3-container bed that is torn down afterwards, also when a test fails. With SYSTEMD_WORKERS=2 the
tier runs on two xdist workers (Makefile; tests/harness/xdistbeds.py): every file's bed has its
own prefix and subnet.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable, Dict, Iterator, List

import pytest

from tests.harness import bedlock, rootfs, xdistbeds
from tests.harness.nspawn import NspawnBed
from tests.harness.rpmbuild import BuiltRpm, build_rpm

# Timings and sizes the tests measure, printed at the end of the run (also under -q). Under xdist
# a worker's new ones ride on its test reports to the controller, which prints them.
METRICS: Dict[str, str] = {}
METRICS_PROPERTY = "systemd-tier-metrics"
_reported: Dict[str, str] = {}
# The two RPM files are one unit of work: one build of each release (rpm_build is per session).
RPM_UNIT = "rpm"
RPM_FILES = ("test_rpm.py", "test_rpm_e2e.py")
# the longest units (--durations), dealt first
LONG = (RPM_UNIT, "test_restore_systemd.py", "test_daemon_systemd.py", "test_restore_faults_systemd.py",
        "test_upgrade_systemd.py")


def unit_of(file: str) -> str:
    return RPM_UNIT if file in RPM_FILES else file


def pytest_configure(config: pytest.Config) -> None:
    xdistbeds.register(config, __file__, unit_of, LONG)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    if hasattr(item.config, "workerinput"):
        new = {k: v for k, v in METRICS.items() if _reported.get(k) != v}
        if new:
            outcome.get_result().user_properties.append((METRICS_PROPERTY, new))  # type: ignore[attr-defined]
            _reported.update(new)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == METRICS_PROPERTY and isinstance(value, dict):
            METRICS.update(value)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session", autouse=True)
def testbed_lock(pytestconfig: pytest.Config) -> Iterator[None]:
    """Fixed container names, prefixes and subnets: one heavy bed per machine (tests/harness/bedlock.py)."""
    yield from bedlock.hold_for_session(pytestconfig)


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("systemd tier needs root (overlay mounts, cgroups, systemd-nspawn)")
    missing: List[str] = [t for t in ("systemd-nspawn", "debootstrap", "nsenter", "etcdctl")
                          if shutil.which(t) is None]
    if missing:
        # CI runs as root with these installed: a missing tool is a broken machine, not a skip
        pytest.fail(f"systemd tier: missing {', '.join(missing)} "
                    "(apt-get install -y systemd-container debootstrap etcd-client)")


@pytest.fixture(scope="session")
def base_tree() -> str:
    """The cached bookworm tree; built here when missing or outdated."""
    _require_root()
    t0 = time.monotonic()
    info = rootfs.ensure_base()
    if info.built:
        METRICS["base tree"] = (f"built in {time.monotonic() - t0:.1f} s, "
                                f"{info.size_bytes / 1e6:.0f} MB")
    else:
        METRICS["base tree"] = f"cached (recipe {info.recipe}), {info.size_bytes / 1e6:.0f} MB"
    return info.path


@pytest.fixture(scope="module")
def bed(base_tree: str) -> Iterator[NspawnBed]:
    """Three containers es1..es3 at 10.213.2.11-13, booted to running; stopped after the module."""
    b = NspawnBed(3, prefix="es", subnet="10.213.2", base=base_tree)
    try:
        b.up()
        boots = ", ".join(f"{c.name} {c.boot_seconds:.1f} s" for c in b.containers)
        METRICS["bed up"] = (f"{b.timings['up']:.1f} s (netns {b.timings['netns_up']:.1f} s, "
                             f"clones+keys {b.timings['prepare']:.1f} s, boot {boots})")
        yield b
    finally:
        b.down()
        if "down" in b.timings:
            METRICS["bed teardown"] = f"{b.timings['down']:.1f} s"


@pytest.fixture(scope="session")
def rpm_build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], BuiltRpm]:
    """build(release) -> the RPM of this checkout, built once per release and session."""
    if shutil.which("rpmbuild") is None:
        pytest.fail("rpmbuild missing (apt-get install -y rpm): the RPM tests cannot run")
    dist = str(tmp_path_factory.mktemp("rpm-dist"))
    built: Dict[str, BuiltRpm] = {}

    def build(release: str = "1") -> BuiltRpm:
        if release not in built:
            rpm = built[release] = build_rpm(release, dist)
            METRICS[f"rpm build (release {release})"] = (
                f"{rpm.seconds:.1f} s, {rpm.size_bytes / 1e6:.1f} MB, Python {rpm.python}")
        return built[release]

    return build


def pytest_terminal_summary(terminalreporter: "pytest.TerminalReporter") -> None:
    if METRICS:
        terminalreporter.write_sep("-", "systemd tier measurements")
        for key, value in METRICS.items():
            terminalreporter.write_line(f"{key}: {value}")
