"""`etcd-agent upgrade` on real systemd: three nspawn hosts eu1..eu3 (10.213.8.11-13) running
``etcd-agent.service`` (the daemon, 1 s cycles) and etcd.service rendered by the agent on
Debian's etcd 3.4.23 at the product's default ``/usr/bin/etcd`` (the legacy column as an operator
starts it). Releases sit side by side as the README documents, from the containers' releases
layer (tests/harness/rootfs.py): Debian's linked as ``/opt/etcd/3.4.23/``, 3.5.16 and 3.5.30
in ``/opt/etcd/<v>/``; the test adds a broken "3.5.2" (reports its version, exits at once when
started).

The operator's command runs inside eu1 (nsenter: a root shell on master 1); the members of eu2
and eu3 are stepped by ``etcd-agent upgrade-member`` over SSH to their real sshd (host keys
from the bed's known_hosts), eu1's own member in-process. Leadership is put on eu1 first, so
the followers stepped first are the remote ones and the leader (stepped last) the local one.

The tests build on each other in file order (one cluster): refused jump, forced failure rolled
back, the multi-hop plan (--dry-run), the real upgrade 3.4.23 -> 3.5.16 -> 3.5.30 in one command
with writes flowing, then reboot-equivalents keeping the pin.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from typing import Dict, Iterator, List, Sequence

import pytest

from etcd_agent.config import Config
from etcd_agent.errors import EtcdError
from etcd_agent.etcd.client import EtcdClient
from tests.harness import agentbed
from tests.harness.agentbed import main_pid
from tests.harness.nspawn import Container, NspawnBed
from tests.harness.releases import DEFAULT, LEGACY, NEWER
from tests.harness.rootfs import DEPS_VENV

from .conftest import METRICS, REPO

pytestmark = pytest.mark.systemd

PREFIX, SUBNET = "eu", "10.213.8"
UNIT_FILE = "/etc/systemd/system/etcd.service"
AGENT_UNIT = os.path.join(REPO, "systemd", "etcd-agent.service")
FAKE_ETCD = """#!/bin/sh
# a broken "new release": reports a version, exits at once when started as a server
if [ "$1" = "--version" ]; then echo "etcd Version: 3.5.2"; echo "Git SHA: fake"; exit 0; fi
echo "fake etcd: refusing to start" >&2
exit 1
"""
# what the daemon logs when it starts a stopped etcd or renders the unit (see daemon/loop.py)
DAEMON_RESTART = "-> restart:"
DAEMON_RENDER = f"wrote {UNIT_FILE}"


def agent_toml(hosts: Sequence[Container]) -> str:
    return agentbed.agent_toml("eu", hosts, version=None, extra=(
        '\n[ssh]\nuser = "root"\nidentity_file = "/etc/etcd-agent/id_ed25519"\n'
        'known_hosts = "/etc/etcd-agent/known_hosts"\nconnect_timeout = 3.0\ncommand_timeout = 300.0\n'))


def client_config(hosts: Sequence[Container]) -> Config:
    """The test side's view (from the root namespace): the members only."""
    return agentbed.parsed('[cluster]\nname = "eu"\ntoken = "eu-cluster-1"\n' + agentbed.members_toml(hosts))


def record(key: str, value: str) -> None:
    METRICS[f"upgrade (systemd tier): {key}"] = value
    print(f"\n[figure] {key}: {value}")


def journal(c: Container, unit: str, since: float = 0.0, lines: int = 400) -> str:
    """The unit's messages logged at or after ``since`` (epoch seconds, the kernel clock the
    containers share): --since alone has whole-second granularity."""
    argv = ["journalctl", "--no-pager", "-o", "short-unix", "-n", str(lines), "-u", unit]
    if since:
        argv += ["--since", f"@{int(since)}"]
    out = []
    for line in c.exec(argv).stdout.splitlines():
        stamp, _, msg = line.partition(" ")
        try:
            if float(stamp) >= since:
                out.append(msg.split(": ", 1)[-1])  # drop "host ident[pid]:"
        except ValueError:
            continue  # "-- No entries --" and the like
    return "\n".join(out)


def exec_start(c: Container) -> str:
    return c.systemctl("show", "-p", "ExecStart", "--value", "etcd").stdout


def agent(c: Container, *args: str, timeout: float = 600.0) -> "subprocess.CompletedProcess[str]":
    return c.exec(["etcd-agent", *args], timeout=timeout)


def versions(cfg: Config) -> Dict[str, str]:
    with EtcdClient.from_config(cfg, timeout=3.0) as cl:
        return {m.name: cl.status(m.client_url).version for m in cfg.members}


def leader(cfg: Config) -> str:
    with EtcdClient.from_config(cfg, timeout=3.0) as cl:
        return next(m.name for m in cfg.members if cl.status(m.client_url).is_leader)


def wait_healthy(cfg: Config, timeout: float) -> float:
    t0 = time.monotonic()
    bad: List[str] = []
    with EtcdClient.from_config(cfg, timeout=2.0) as cl:
        while time.monotonic() - t0 < timeout:
            bad = [m.name for m in cfg.members if not cl.healthy(m.client_url, timeout=2.0)[0]]
            if not bad:
                return time.monotonic() - t0
            time.sleep(0.2)
    raise AssertionError(f"not healthy after {timeout:.0f}s: {bad}")


def make_leader(cfg: Config, name: str) -> None:
    """Put leadership on ``name`` (so the remote members are the followers stepped first)."""
    with EtcdClient.from_config(cfg, timeout=3.0) as cl:
        st = {m.name: cl.status(m.client_url) for m in cfg.members}
        cur = next(n for n, s in st.items() if s.is_leader)
        if cur != name:
            cl.move_leader(cfg.member(cur).client_url, st[name].member_id)
    deadline = time.monotonic() + 20
    while leader(cfg) != name:
        assert time.monotonic() < deadline, f"leadership did not move to {name}"
        time.sleep(0.2)


VIA, TARGET = DEFAULT, NEWER  # the multi-hop upgrade: 3.4.23 -> 3.5.16 -> 3.5.30 in one command


def install_releases(c: Container) -> None:
    """The broken 3.5.2 beside the real releases the container carries."""
    for v in (LEGACY, VIA, TARGET):
        res = c.exec([f"/opt/etcd/{v}/etcd", "--version"])
        assert f"etcd Version: {v}" in res.stdout, f"{c.name}: /opt/etcd/{v}/etcd: {res.stdout}{res.stderr}"
    c.write_file("/opt/etcd/3.5.2/etcd", FAKE_ETCD, mode=0o755)


@pytest.fixture(scope="module")
def eu(base_tree: str) -> Iterator[NspawnBed]:
    bed = NspawnBed(3, prefix=PREFIX, subnet=SUBNET, base=base_tree)
    try:
        bed.up()
        t0 = time.monotonic()
        agentbed.install_agents(bed, REPO, AGENT_UNIT, agent_toml(bed.containers), prepare=install_releases)
        cfg = client_config(bed.containers)
        wait_healthy(cfg, 120)
        with EtcdClient.from_config(cfg) as cl:
            cl.put("/seed", b"1")  # a cluster with data for the backup taken before the upgrade
        record("bed", f"3 hosts up in {bed.timings['up']:.1f} s; agent and releases installed, daemons "
                      f"bootstrapped a static 3.4.23 cluster in {time.monotonic() - t0:.1f} s")
        yield bed
    finally:
        bed.down()


def test_refused_jump_prints_the_path(eu: NspawnBed) -> None:
    res = agent(eu[0], "upgrade", "--to", "3.6.0", "--yes")
    assert res.returncode == 3, res.stdout + res.stderr
    assert "3.4.23 -> 3.5.26 -> 3.6.0" in res.stderr, res.stderr
    line = next(ln for ln in res.stderr.splitlines() if "3.5.26" in ln)
    record("refused jump", f"exit {res.returncode}: {line.strip()}")
    # the dry run checks the release on every host, the remote ones over SSH
    res = agent(eu[0], "--json", "upgrade", "--to", TARGET, "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    checks = json.loads(res.stdout)["plan"]["checks"]
    assert sorted(c.split(":")[0] for c in checks) == ["eu1", "eu2", "eu3"], checks
    assert set(versions(client_config(eu.containers)).values()) == {"3.4.23"}


def test_forced_failure_rolled_back(eu: NspawnBed) -> None:
    cfg = client_config(eu.containers)
    make_leader(cfg, "eu1")
    since = time.time()
    t0 = time.monotonic()
    res = agent(eu[0], "--json", "upgrade", "--to", "3.5.2", "--yes", "--timeout", "60")
    took = time.monotonic() - t0
    assert res.returncode == 1, res.stdout + res.stderr
    err = json.loads(res.stdout)
    first = [line.removeprefix("upgrade: ").split(":")[0] for line in res.stderr.splitlines() if "rolled back (" in line]
    assert first and first[0] in ("eu2", "eu3"), res.stderr  # a remote follower, over SSH
    name = first[0]
    assert "rolled back" in err["message"] and name in err["message"], err
    wait_healthy(cfg, 30)
    assert set(versions(cfg).values()) == {"3.4.23"}
    for c in eu.containers:
        assert "/usr/bin/etcd" in exec_start(c) and "/opt/etcd/3.5.2" not in exec_start(c), c.name
        assert c.exec(["test", "-e", f"/var/lib/etcd-agent/{c.name}.binary.json"]).returncode != 0
        assert c.exec(["ls", "/var/lib/etcd-agent"]).stdout.count("upgrade-in-progress") == 0
        log = journal(c, "etcd-agent", since)
        assert DAEMON_RESTART not in log, f"{c.name}: the daemon fought the upgrade:\n{log}"
    state = json.loads(eu[0].exec(["cat", "/var/lib/etcd-agent/upgrade.json"]).stdout)
    assert state["state"] == "failed"
    step = next(s for s in state["steps"] if s["name"] == name)
    assert step["outcome"] == "rolled back"
    record("forced failure", f"{name} on the broken 3.5.2 rolled back to 3.4.23 in {step['seconds']:.1f} s "
                             f"(stop, start, crash seen, old unit back, healthy); exit 1 after {took:.1f} s "
                             "in all; cluster healthy on 3.4.23")


HOLD = """
import subprocess, sys, time
from etcd_agent.config import load, with_local
from etcd_agent.state.markers import clear_upgrading, mark_upgrading
cfg = with_local(load("/etc/etcd-agent/agent.toml"), sys.argv[1])
mark_upgrading(cfg, sys.argv[1], sys.argv[2], "/usr/bin/etcd")
try:
    subprocess.run(["systemctl", "stop", "etcd"], check=True)
    time.sleep(4.0)  # four daemon cycles
    print(subprocess.run(["systemctl", "is-active", "etcd"], capture_output=True, text=True).stdout.strip())
finally:
    clear_upgrading(cfg, sys.argv[1])
"""


def test_daemon_keeps_hands_off_a_member_being_stepped(eu: NspawnBed) -> None:
    """Deterministic: the steps above are shorter than a daemon cycle, so hold a marker longer."""
    cfg = client_config(eu.containers)
    c = eu[2]
    since = time.time()
    res = c.exec([f"{DEPS_VENV}/bin/python", "-c", HOLD, c.name, TARGET], timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "inactive", "the daemon started the etcd an upgrade step had stopped"
    log = journal(c, "etcd-agent", since)
    assert f"an upgrade is stepping this member to etcd {TARGET}" in log, log
    t0 = time.monotonic()  # the marker gone, the daemon heals again
    wait_healthy(cfg, 30)
    record("daemon pause", f"etcd stopped under an upgrade marker stayed stopped for 4 s; restarted by the "
                           f"daemon {time.monotonic() - t0:.1f} s after the marker was removed")


def test_multi_hop_dry_run_shows_every_hop(eu: NspawnBed) -> None:
    cfg = client_config(eu.containers)
    make_leader(cfg, "eu1")
    res = agent(eu[0], "upgrade", "--to", TARGET, "--via", VIA, "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    text = res.stdout
    assert f"upgrade to etcd {TARGET}: {LEGACY} -> {VIA} -> {TARGET}" in text, text
    assert f"hop 1: {LEGACY} -> {VIA}: a verified backup first" in text and f"hop 2: {VIA} -> {TARGET}" in text, text
    for hop in (1, 2):  # followers first, the leader last, in each hop
        order = [ln.split()[1].rstrip(":") for ln in text.splitlines() if ln.strip().startswith(f"{hop}.")]
        assert len(order) == 3 and order[-1] == "eu1", text
    # the release of every hop checked on every host (eu2, eu3 over SSH)
    for v in (VIA, TARGET):
        assert sum(1 for ln in text.splitlines() if "check:" in ln and f"/opt/etcd/{v}/etcd reports {v}" in ln) == 3, text
    assert "(dry run: nothing changed)" in text
    assert set(versions(cfg).values()) == {LEGACY}
    record("multi-hop --dry-run", "\n" + text.strip())


def test_multi_hop_upgrade_with_writes(eu: NspawnBed) -> None:
    """One command, two hops, a verified backup before each, followers first and the leader last in
    each; a writer keeps writing throughout and every acknowledged write must be there after."""
    cfg = client_config(eu.containers)
    make_leader(cfg, "eu1")
    acked: List[str] = []
    refused: List[str] = []
    stop = threading.Event()

    def writer() -> None:
        with EtcdClient.from_config(cfg, timeout=3.0) as cl:
            i = 0
            while not stop.is_set():
                key = f"/upgrade-writes/{i:07d}"
                try:
                    cl.put(key, str(i).encode())
                    acked.append(key)
                except EtcdError:
                    refused.append(key)
                i += 1
                time.sleep(0.01)

    since = time.time()
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        res = agent(eu[0], "--json", "upgrade", "--to", TARGET, "--via", VIA, "--yes", "--timeout", "120")
        took = time.monotonic() - t0
        time.sleep(1.0)
    finally:
        stop.set()
        t.join(15)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    hops = report["plan"]["hops"]
    assert [(h["from"], h["to"]) for h in hops] == [(LEGACY, VIA), (VIA, TARGET)], hops
    assert len(report["backups"]) == 2 and len(set(report["backups"])) == 2, report["backups"]
    for h in hops:
        assert [s["outcome"] for s in h["steps"]] == ["upgraded"] * 3, h
        assert h["steps"][-1]["name"] == "eu1", h  # the leader (local) last in each hop
    assert set(versions(cfg).values()) == {TARGET}
    for c in eu.containers:
        assert f"path=/opt/etcd/{TARGET}/etcd" in exec_start(c), f"{c.name}: {exec_start(c)}"
        pin = json.loads(c.exec(["cat", f"/var/lib/etcd-agent/{c.name}.binary.json"]).stdout)
        assert pin["version"] == TARGET and pin["previous"] == f"/opt/etcd/{VIA}/etcd", pin
        log = journal(c, "etcd-agent", since)
        assert DAEMON_RESTART not in log and DAEMON_RENDER not in log, f"{c.name}: the daemon fought:\n{log}"
    # each hop's backup verifies from its own bytes (signed manifest, etcd's trailer, whose it is),
    # and the second was taken later than the first, with the writes of hop 1 in it
    revs = []
    for b in report["backups"]:
        ver = agent(eu[0], "--json", "backup", "verify", b)
        assert ver.returncode == 0, ver.stdout + ver.stderr
        doc = json.loads(ver.stdout)
        assert doc["ok"] and doc["signature"] == "valid" and doc["identity"]["same_cluster"], doc
        revs.append(int(doc["revision"]))
    assert revs[0] < revs[1], revs
    with EtcdClient.from_config(cfg, timeout=5.0) as cl:
        missing = [k for k in acked if cl.get(k) is None]
        total = cl.count_prefix("/upgrade-writes/")
    assert acked and not missing, f"{len(missing)} acknowledged writes lost, e.g. {missing[:3]}"
    for h in hops:
        per = ", ".join(f"{s['name']} {s['seconds']:.1f} s" for s in h["steps"])
        record(f"hop {h['from']} -> {h['to']}", f"{h['seconds']:.1f} s: backup {os.path.basename(h['backup'])}, then {per}")
    record(f"upgrade {LEGACY} -> {VIA} -> {TARGET}", f"one command, {took:.1f} s in all")
    record("writes during the upgrade", f"{len(acked)} acknowledged, {len(refused)} refused while a member "
                                        f"restarted, {total} keys present, 0 acknowledged lost")


def test_daemon_rerender_keeps_the_new_binary(eu: NspawnBed) -> None:
    """The daemon that ran through the upgrade re-renders a lost etcd.conf and the unit: the new release."""
    cfg = client_config(eu.containers)
    c = eu[1]
    c.exec(["rm", "-f", "/etc/etcd/etcd.conf"], check=True)
    deadline = time.monotonic() + 30
    while c.exec(["test", "-s", "/etc/etcd/etcd.conf"]).returncode != 0:
        assert time.monotonic() < deadline, journal(c, "etcd-agent", lines=40)
        time.sleep(0.2)
    assert f"path=/opt/etcd/{TARGET}/etcd" in exec_start(c), exec_start(c)
    c.systemctl("restart", "etcd", check=True, timeout=120)
    wait_healthy(cfg, 60)
    assert versions(cfg)[c.name] == TARGET


def test_reboot_equivalent_keeps_the_pin(eu: NspawnBed) -> None:
    cfg = client_config(eu.containers)
    t0 = time.monotonic()
    for c in eu.containers:  # one at a time: the cluster keeps quorum
        old = main_pid(c, "etcd")
        # the daemon must not replace the operator's restart job while etcd is stopping
        res = c.systemctl("restart", "etcd", timeout=120)
        assert res.returncode == 0, res.stderr + journal(c, "etcd-agent", lines=20)
        assert main_pid(c, "etcd") not in (0, old)
        wait_healthy(cfg, 60)
        c.systemctl("restart", "etcd-agent", check=True, timeout=120)
    wait_healthy(cfg, 60)
    time.sleep(3.0)  # a few daemon cycles with the pin read afresh
    assert set(versions(cfg).values()) == {TARGET}
    for c in eu.containers:
        assert f"path=/opt/etcd/{TARGET}/etcd" in exec_start(c), f"{c.name}: {exec_start(c)}"
    record("reboot-equivalent", f"etcd and etcd-agent restarted on each host in {time.monotonic() - t0:.1f} s; "
                                f"every member still on {TARGET}")


def test_agent_journals_clean(eu: NspawnBed) -> None:
    for c in eu.containers:
        text = c.exec(["journalctl", "--no-pager", "-o", "cat", "-u", "etcd-agent"]).stdout
        assert "Traceback" not in text and "cycle failed" not in text, f"{c.name}:\n{text[-3000:]}"
