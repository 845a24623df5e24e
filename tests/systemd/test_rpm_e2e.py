"""The product as operators use it, on real systemd: `rpm -ivh` the built package into three
nspawn hosts (Debian trees, hence --nodeps), drop one config naming the three, `systemctl enable
--now etcd-agent` -> the cluster forms; the backup unit takes a verified tarball; `rpm -Uvh` to a
newer release keeps the config, restarts the agent and the cluster stays healthy; `rpm -e` stops
and disables the agent and leaves the backups, the data and the config (.rpmsave).

The tests build on each other in file order (one bed, one cluster), like an operator's steps.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import pytest

from etcd_agent.config import Config
from etcd_agent.etcd.client import EtcdClient
from tests.harness import agentbed
from tests.harness.agentbed import journal, main_pid, run_backup_unit, wait_healthy
from tests.harness.nspawn import Container, NspawnBed
from tests.harness.rpmbuild import BuiltRpm

from .conftest import METRICS

pytestmark = pytest.mark.systemd

PREFIX, SUBNET = "ep", "10.213.7"
UNITS = ("etcd-agent.service", "etcd-agent-backup.service", "etcd-agent-backup.timer")
AGENT_TOML = "/etc/etcd-agent/agent.toml"
BACKUP_DIR = "/var/lib/etcd_backup"
DATA_DIR = "/var/lib/etcd/default.etcd"
# not /tmp: a tmpfs inside the container hides what the host writes below it
INNER_RPM_DIR = "/var/tmp/etcd-agent-rpm"


def agent_toml(hosts: Sequence[Container]) -> str:
    """The operator's config: static bootstrap of the three, etcd under systemd."""
    return "# written by the operator (test_rpm_e2e)\n" + agentbed.agent_toml("ep", hosts)


def config_of(hosts: Sequence[Container]) -> Config:
    return agentbed.parsed(agent_toml(hosts))


def record(key: str, seconds: float) -> None:
    METRICS[f"rpm e2e: {key}"] = f"{seconds:.1f} s"
    print(f"\n[figure] {key}: {seconds:.1f} s")


def wait_active(c: Container, unit: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while c.systemctl("is-active", unit).stdout.strip() != "active":
        if time.monotonic() > deadline:
            pytest.fail(f"{c.name}: {unit} not active after {timeout:.0f} s:\n{journal(c, unit)}")
        time.sleep(0.2)


def rpm_cmd(c: Container, *args: str, timeout: float = 300.0) -> "subprocess.CompletedProcess[str]":
    """rpm inside the container: its scriptlets talk to the container's own systemd."""
    return c.exec(["rpm", *args], timeout=timeout, check=True)


def copy_in(c: Container, rpm: BuiltRpm) -> str:
    dest_dir = os.path.join(c.root, INNER_RPM_DIR.lstrip("/"))
    os.makedirs(dest_dir, exist_ok=True)
    shutil.copy(rpm.path, dest_dir)
    return f"{INNER_RPM_DIR}/{os.path.basename(rpm.path)}"


def file_sha(c: Container, path: str) -> str:
    out = c.exec(["sha256sum", path], check=True).stdout
    return out.split()[0]


def each(bed: NspawnBed, fn: Callable[[Container], object]) -> List[object]:
    with ThreadPoolExecutor(max_workers=len(bed)) as pool:
        return list(pool.map(fn, bed.containers))


@pytest.fixture(scope="module")
def rpms(rpm_build: Callable[[str], BuiltRpm]) -> Tuple[BuiltRpm, BuiltRpm]:
    """Release 1 (installed) and release 2 (the upgrade), built from this checkout."""
    return rpm_build("1"), rpm_build("2")


@pytest.fixture(scope="module")
def ep(base_tree: str, rpms: Tuple[BuiltRpm, BuiltRpm]) -> Iterator[NspawnBed]:
    """Three hosts ep1..ep3 at 10.213.7.11-13, booted, nothing of the agent installed."""
    bed = NspawnBed(3, prefix=PREFIX, subnet=SUBNET, base=base_tree)
    # the agent first: stopping etcd under a running agent makes it start etcd again
    bed.stop_first = ("etcd-agent.service", "etcd*.service")
    try:
        bed.up()
        METRICS["rpm e2e: bed up"] = f"{bed.timings['up']:.1f} s"
        yield bed
    finally:
        bed.down()


@pytest.fixture(scope="module")
def cfg(ep: NspawnBed) -> Config:
    return config_of(ep.containers)


def test_rpm_install(ep: NspawnBed, rpms: Tuple[BuiltRpm, BuiltRpm]) -> None:
    v1 = rpms[0]
    t0 = time.monotonic()

    def install(c: Container) -> None:
        rpm_cmd(c, "-ivh", "--nodeps", copy_in(c, v1))

    each(ep, install)
    record("rpm -ivh (3 hosts in parallel)", time.monotonic() - t0)
    for c in ep.containers:
        assert rpm_cmd(c, "-q", "etcd-agent").stdout.strip() == \
            f"etcd-agent-0.1.0-{v1.release}.{os.uname().machine}"
        # the console script runs from the relocated venv on the host's python3
        out = c.exec(["etcd-agent", "--version"], check=True).stdout
        assert out.strip().startswith("etcd-agent ")
        res = c.exec(["etcd-agent", "config", "validate", AGENT_TOML])
        assert res.returncode == 0, res.stdout + res.stderr
        assert c.exec(["getent", "passwd", "etcd"]).returncode == 0
        assert c.exec(["stat", "-c", "%a %U", BACKUP_DIR], check=True).stdout.split() == \
            ["700", "root"]
        assert c.exec(["test", "-f", "/etc/cron.d/etcd-agent"]).returncode == 0
        # nothing runs before the operator has written the config
        assert c.systemctl("is-active", "etcd-agent").stdout.strip() == "inactive"
        # the installed units, their real ExecStart included: strict verify, empty stderr
        res = c.exec(["systemd-analyze", "verify", *(f"/usr/lib/systemd/system/{u}"
                                                     for u in UNITS)])
        assert res.returncode == 0 and res.stderr == "", res.stderr


def test_enable_now_forms_the_cluster(ep: NspawnBed, cfg: Config) -> None:
    text = agent_toml(ep.containers)
    for c in ep.containers:
        c.write_file(AGENT_TOML, text, mode=0o644)
    t0 = time.monotonic()
    each(ep, lambda c: c.systemctl("enable", "--now", "etcd-agent", check=True))
    try:
        seconds = wait_healthy(cfg, 3, timeout=120)
    except AssertionError:
        for c in ep.containers:
            print(f"--- {c.name}\n{journal(c, 'etcd-agent')}\n{journal(c, 'etcd')}")
        raise
    record("enable --now -> 3 members healthy", time.monotonic() - t0)
    assert seconds >= 0
    for c in ep.containers:
        assert c.systemctl("is-enabled", "etcd-agent").stdout.strip() == "enabled"
        wait_active(c, "etcd")
        # the agent rendered etcd.conf and the unit; the package shipped neither
        assert c.exec(["test", "-s", "/etc/etcd/etcd.conf"]).returncode == 0
        owner = c.exec(["rpm", "-qf", "/etc/systemd/system/etcd.service"])
        assert owner.returncode != 0, owner.stdout
    with EtcdClient.from_config(cfg, timeout=2.0) as client:
        assert sorted(m.name for m in client.members()) == ["ep1", "ep2", "ep3"]
        client.put("/rpm-e2e/probe", b"v1")


def test_backup_unit_writes_a_verified_tarball(ep: NspawnBed) -> None:
    c = ep[0]
    t0 = time.monotonic()
    path = run_backup_unit(c, BACKUP_DIR)  # beside it, at most the daemon's own (its chain's base)
    record("systemctl start etcd-agent-backup.service", time.monotonic() - t0)
    assert c.exec(["stat", "-c", "%a", path], check=True).stdout.strip() == "600"
    res = c.exec(["etcd-agent", "backup", "verify", path], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_rpm_upgrade_keeps_config_and_restarts_agent(ep: NspawnBed, cfg: Config,
                                                     rpms: Tuple[BuiltRpm, BuiltRpm]) -> None:
    v2 = rpms[1]
    with EtcdClient.from_config(cfg, timeout=2.0) as client:
        ids_before = {m.name: m.id for m in client.members()}
    before: Dict[str, Tuple[int, str]] = {
        c.name: (main_pid(c, "etcd-agent"), file_sha(c, AGENT_TOML)) for c in ep.containers}
    assert all(pid > 0 for pid, _ in before.values())
    t0 = time.monotonic()
    for c in ep.containers:  # one host after another, as a rolling upgrade would
        rpm_cmd(c, "-Uvh", "--nodeps", copy_in(c, v2))
    record("rpm -Uvh (3 hosts, one by one)", time.monotonic() - t0)
    for c in ep.containers:
        assert rpm_cmd(c, "-q", "etcd-agent").stdout.strip().startswith(
            f"etcd-agent-0.1.0-{v2.release}.")
        pid_before, sha_before = before[c.name]
        # %config(noreplace): the operator's file stays, and no .rpmnew for an unchanged default
        assert file_sha(c, AGENT_TOML) == sha_before
        assert c.exec(["test", "-e", AGENT_TOML + ".rpmnew"]).returncode != 0
        # %postun try-restart: a new agent process, running
        wait_active(c, "etcd-agent")
        assert main_pid(c, "etcd-agent") not in (0, pid_before)
        assert c.systemctl("is-enabled", "etcd-agent").stdout.strip() == "enabled"
    record("upgrade -> healthy", wait_healthy(cfg, 3, timeout=60))
    with EtcdClient.from_config(cfg, timeout=2.0) as client:
        assert {m.name: m.id for m in client.members()} == ids_before
        assert client.get("/rpm-e2e/probe") == b"v1"


def test_rpm_erase_leaves_backups_data_and_config(ep: NspawnBed, cfg: Config) -> None:
    t0 = time.monotonic()
    for c in ep.containers:
        rpm_cmd(c, "-e", "etcd-agent")
    record("rpm -e (3 hosts)", time.monotonic() - t0)
    for c in ep.containers:
        assert c.exec(["rpm", "-q", "etcd-agent"]).returncode != 0
        # %systemd_preun: stopped and disabled; the unit files went with the package
        assert c.systemctl("is-active", "etcd-agent").stdout.strip() in ("inactive", "unknown")
        assert c.exec(["test", "-e", "/etc/systemd/system/multi-user.target.wants/"
                                     "etcd-agent.service"]).returncode != 0
        for gone in ("/usr/bin/etcd-agent", "/opt/etcd-agent",
                     "/usr/lib/systemd/system/etcd-agent.service", "/etc/cron.d/etcd-agent"):
            assert c.exec(["test", "-e", gone]).returncode != 0, gone
        # the operator's edited config is kept as .rpmsave; the etcd data stays
        assert c.exec(["grep", "-q", "written by the operator",
                       AGENT_TOML + ".rpmsave"]).returncode == 0
        assert c.exec(["test", "-d", f"{DATA_DIR}/member"]).returncode == 0
    # the backups stay, in their 0700 dir (rpm removes the dir it owns only when it is empty,
    # as on ep2/ep3, which took no backup)
    c = ep[0]
    assert c.exec(["stat", "-c", "%a", BACKUP_DIR], check=True).stdout.strip() == "700"
    backups = c.exec(["ls", BACKUP_DIR], check=True).stdout.split()
    assert any(n.startswith("etcd-") and ".tar" in n for n in backups), backups
    # etcd is its own unit: removing the agent never takes the cluster down
    wait_healthy(cfg, 3, timeout=30)
