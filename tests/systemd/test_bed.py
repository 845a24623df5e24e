"""Proves the systemd tier: three nspawn hosts boot systemd, run a real 3-member etcd under
Debian's etcd.service, restart it after a crash, accept SSH with verified host keys, and run the
agent installed from the current source."""
from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Dict, List

import paramiko
import pytest

from etcd_agent import __version__
from tests.harness.nspawn import Container, NspawnBed
from tests.harness.releases import ALL
from tests.harness.rootfs import DEPS_VENV

from .conftest import METRICS, REPO

pytestmark = pytest.mark.systemd

TOKEN = "es-bed-test"


def etcd_env(c: Container, bed: NspawnBed) -> str:
    """/etc/default/etcd for a static 3-member cluster (read by Debian's etcd.service)."""
    cluster = ",".join(f"{o.name}=http://{o.ip}:2380" for o in bed.containers)
    return "\n".join([
        f"ETCD_NAME={c.name}",
        "ETCD_DATA_DIR=/var/lib/etcd/default",
        f"ETCD_LISTEN_PEER_URLS=http://{c.ip}:2380",
        f"ETCD_LISTEN_CLIENT_URLS=http://{c.ip}:2379,http://127.0.0.1:2379",
        f"ETCD_INITIAL_ADVERTISE_PEER_URLS=http://{c.ip}:2380",
        f"ETCD_ADVERTISE_CLIENT_URLS=http://{c.ip}:2379",
        f"ETCD_INITIAL_CLUSTER={cluster}",
        "ETCD_INITIAL_CLUSTER_STATE=new",
        f"ETCD_INITIAL_CLUSTER_TOKEN={TOKEN}",
    ]) + "\n"


def etcdctl(bed: NspawnBed, *args: str, timeout: float = 15) -> subprocess.CompletedProcess:
    """etcdctl from the root namespace against the namespace IPs."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ETCDCTL_API": "3"}
    return subprocess.run(["etcdctl", "--endpoints", bed.endpoints(), "--dial-timeout=2s",
                           "--command-timeout=5s", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def healthy_endpoints(bed: NspawnBed) -> Dict[str, bool]:
    res = etcdctl(bed, "endpoint", "health", "-w", "json")
    try:
        docs = json.loads(res.stdout or "[]")
    except ValueError:
        return {}
    return {d["endpoint"]: bool(d.get("health")) for d in docs}


def wait_all_healthy(bed: NspawnBed, timeout: float = 60) -> float:
    """Seconds until every member reports healthy; fails with etcdctl's words otherwise."""
    t0 = time.monotonic()
    while True:
        health = healthy_endpoints(bed)
        if len(health) == len(bed) and all(health.values()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            last = etcdctl(bed, "endpoint", "health")
            pytest.fail(f"not all healthy after {timeout} s: {health}\n{last.stdout}{last.stderr}")
        time.sleep(0.3)


def wait_active(c: Container, unit: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while c.systemctl("is-active", unit).stdout.strip() != "active":
        if time.monotonic() > deadline:
            status = c.systemctl("status", "--no-pager", "-n", "20", unit)
            pytest.fail(f"{c.name}: {unit} not active after {timeout} s:\n{status.stdout}")
        time.sleep(0.2)


def main_pid(c: Container, unit: str) -> int:
    out = c.systemctl("show", "-p", "MainPID", "--value", unit).stdout.strip()
    return int(out or 0)


def test_containers_boot_systemd(bed: NspawnBed) -> None:
    for c in bed.containers:
        assert c.systemctl("is-system-running").stdout.strip() in ("running", "degraded")
        assert c.exec(["hostname"]).stdout.strip() == c.name
        pid1 = c.exec(["cat", "/proc/1/comm"]).stdout.strip()
        assert pid1 == "systemd"
        addrs = c.exec(["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
        assert f"{c.ip}/24" in addrs
        # the base tree disables etcd: the agent starts it, not the boot
        assert c.systemctl("is-enabled", "etcd").stdout.strip() == "disabled"
        assert c.systemctl("is-active", "etcd").stdout.strip() == "inactive"
        # each container has its own cgroup: the isolation the shared-cgroup trap needs
        assert c.leader in c.pids()
    machine_ids = {c.exec(["cat", "/etc/machine-id"]).stdout.strip() for c in bed.containers}
    assert len(machine_ids) == len(bed)


def test_containers_carry_the_test_releases(bed: NspawnBed) -> None:
    """/opt/etcd/<v> from the releases layer, each binary reporting its version inside; writes
    land in the container's own upper dir, never in the shared layer."""
    assert bed.releases_layer is not None
    for c in bed.containers:
        for v in ALL:
            out = c.exec([f"/opt/etcd/{v}/etcd", "--version"]).stdout
            assert f"etcd Version: {v}" in out, f"{c.name}: {out}"
            out = c.exec(["env", "ETCDCTL_API=3", f"/opt/etcd/{v}/etcdctl", "version"]).stdout
            assert f"etcdctl version: {v}" in out, f"{c.name}: {out}"
            if not v.startswith("3.4."):
                out = c.exec([f"/opt/etcd/{v}/etcdutl", "version"]).stdout
                assert f"etcdutl version: {v}" in out, f"{c.name}: {out}"
    c = bed[0]
    c.exec(["mkdir", "-p", "/opt/etcd/9.9.9"], check=True)
    assert not os.path.exists(os.path.join(bed.releases_layer, "opt/etcd/9.9.9"))
    assert c.exec(["rmdir", "/opt/etcd/9.9.9"]).returncode == 0
    METRICS["etcd releases in the containers"] = ", ".join(ALL) + f" (layer {bed.releases_layer})"


def test_ssh_with_verified_host_keys(bed: NspawnBed) -> None:
    for c in bed.containers:
        wait_active(c, "ssh")
        client = paramiko.SSHClient()
        client.load_host_keys(bed.known_hosts)
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(c.ip, username="root", key_filename=bed.client_key,
                           look_for_keys=False, allow_agent=False, timeout=10)
            _in, out, _err = client.exec_command("hostname", timeout=10)
            assert out.read().decode().strip() == c.name
        finally:
            client.close()


def test_static_etcd_cluster_under_systemd(bed: NspawnBed) -> None:
    for c in bed.containers:
        c.write_file("/etc/default/etcd", etcd_env(c, bed))
    t0 = time.monotonic()
    # Type=notify: a member is "started" only once the cluster has quorum, so do not block
    for c in bed.containers:
        c.systemctl("start", "--no-block", "etcd", check=True)
    for c in bed.containers:
        wait_active(c, "etcd", timeout=60)
    wait_all_healthy(bed)
    METRICS["etcd healthy"] = f"{time.monotonic() - t0:.1f} s after `systemctl start`"
    members = etcdctl(bed, "member", "list", "-w", "json")
    assert members.returncode == 0, members.stderr
    names = sorted(m["name"] for m in json.loads(members.stdout)["members"])
    assert names == [c.name for c in bed.containers]
    # a write through one member is read back through another
    assert etcdctl(bed, "put", "/bed/probe", "ok").returncode == 0
    got = bed[2].exec(["etcdctl", "--endpoints", f"http://{bed[2].ip}:2379", "get",
                       "--print-value-only", "/bed/probe"])
    assert got.stdout.strip() == "ok", got.stderr


def test_systemd_restarts_killed_etcd(bed: NspawnBed) -> None:
    c = bed[1]
    before = main_pid(c, "etcd")
    assert before > 0
    t0 = time.monotonic()
    c.systemctl("kill", "-s", "KILL", "etcd", check=True)
    deadline = time.monotonic() + 30
    while True:
        after = main_pid(c, "etcd")
        if after not in (0, before) and c.systemctl("is-active", "etcd").stdout.strip() == "active":
            break
        assert time.monotonic() < deadline, "etcd was not restarted by systemd"
        time.sleep(0.2)
    wait_all_healthy(bed)
    METRICS["etcd restart after SIGKILL"] = f"healthy again in {time.monotonic() - t0:.1f} s"
    restarts = c.systemctl("show", "-p", "NRestarts", "--value", "etcd").stdout.strip()
    assert int(restarts) >= 1


def test_install_agent_from_source(bed: NspawnBed) -> None:
    t0 = time.monotonic()
    bed.install_agent(REPO)
    METRICS["install agent"] = f"{(time.monotonic() - t0) / len(bed):.1f} s per container"
    for c in bed.containers:
        res = c.exec(["/usr/bin/python3", "-c", "print(1)"])
        assert res.returncode == 0
        res = c.exec([DEPS_VENV + "/bin/python", "-c",
                      "import etcd_agent, etcd3; print(etcd_agent.__version__)"], check=True)
        assert res.stdout.strip() == __version__
        # the console script exists and runs the venv's python
        target = c.exec(["readlink", "-f", "/usr/bin/etcd-agent"]).stdout.strip()
        assert target == DEPS_VENV + "/bin/etcd-agent"
        head = c.exec(["head", "-1", target]).stdout.strip()
        assert head.startswith("#!" + DEPS_VENV + "/bin/python")


def test_memory_footprint(bed: NspawnBed) -> None:
    pss: List[int] = [c.pss_bytes() for c in bed.containers]
    assert all(p > 0 for p in pss)
    METRICS["RAM (PSS) with etcd running"] = (
        ", ".join(f"{c.name} {p / 1e6:.0f} MB" for c, p in zip(bed.containers, pss))
        + f"; total {sum(pss) / 1e6:.0f} MB")
