"""Faults of `etcd-agent restore` on real systemd: three nspawn hosts rf1..rf3 (10.213.9.11-13)
set up like tests/systemd/test_restore_systemd.py (``etcd-agent.service`` running, etcd.service
rendered by the agent, a ``kube-apiserver.service`` stand-in fenced by the restore). The
operator's command runs inside rf1 and drives rf2/rf3 over SSH.

- a hostile tarball (``../`` member, absolute member, symlinked snapshot) is refused (exit 3)
  before anything is extracted, and nothing anywhere changes;
- a host dies mid-restore (power cut: every process of rf3 SIGKILLed, its NIC dark) once its data
  is set aside: the restore fails, rf1/rf2 are rolled back and serve the old data; rf3 reboots,
  its daemon keeps its hands off, ``restore rollback --yes`` brings the whole cluster back;
- the orchestrator is SIGKILLed mid-restore: ``status`` says RESTORE IN PROGRESS, the daemons
  wait, the same command resumes to a healthy cluster on the backup.

The tests build on each other in file order (one cluster).
"""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import tarfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import psutil
import pytest

from etcd_agent.backup.archive import SNAPSHOT, open_tar
from etcd_agent.config import Config
from etcd_agent.etcd.client import EtcdClient
from tests.harness import agentbed
from tests.harness.agentbed import main_pid
from tests.harness.nspawn import INNER_ENV, Container, NspawnBed

from .conftest import METRICS, REPO
from .test_restore_systemd import (
    AGENT_UNIT,
    APISERVER,
    DATA_DIR,
    STAND_IN,
    agent,
    counts,
    put_many,
    revisions,
    wait_healthy,
)

pytestmark = pytest.mark.systemd

PREFIX, SUBNET = "rf", "10.213.9"
KEYS, LATER = 2000, 50
# per node call: bounds how long the orchestrator waits on a host that went dark mid-call
COMMAND_TIMEOUT = 15.0
BACKUP_DIR = "/var/lib/etcd_backup"
PARENT = os.path.dirname(DATA_DIR)
ASIDE = os.path.basename(DATA_DIR) + ".pre-restore-"
HANDS_OFF = "is in progress on this host; hands off"
# the daemon acting on etcd or on membership: what "fighting the restore" would look like
FIGHT = re.compile(r"-> (restart|start_static|start_seed|join|replace|render|promote):")
CANARY = "/var/tmp/rf-canary"


def agent_toml(hosts: Sequence[Container]) -> str:
    return agentbed.agent_toml(PREFIX, hosts, extra=(
        '\n[kubernetes]\nfence = "unit"\napiserver_unit = "kube-apiserver.service"\n\n'
        '[ssh]\nuser = "root"\nidentity_file = "/etc/etcd-agent/id_ed25519"\n'
        f'known_hosts = "/etc/etcd-agent/known_hosts"\nconnect_timeout = 3.0\ncommand_timeout = {COMMAND_TIMEOUT}\n'))


def client_config(hosts: Sequence[Container]) -> Config:
    return agentbed.parsed(f'[cluster]\nname = "{PREFIX}"\ntoken = "{PREFIX}-cluster-1"\n' + agentbed.members_toml(hosts))


def record(key: str, value: str) -> None:
    METRICS[f"restore faults (systemd tier): {key}"] = value
    print(f"\n[figure] {key}: {value}")


def outside(c: Container, path: str) -> str:
    """``path`` of the container as seen from the root namespace (through its overlay)."""
    return os.path.join(c.root, path.lstrip("/"))


def aside_dirs(c: Container) -> Set[str]:
    try:
        return {n for n in os.listdir(outside(c, PARENT)) if n.startswith(ASIDE)}
    except FileNotFoundError:
        return set()


def node_journal(c: Container) -> Dict:
    path = outside(c, f"{PARENT}/.etcd-agent-restore-{c.name}/journal.json")
    try:
        with open(path) as fh:
            return json.load(fh)
    except (FileNotFoundError, ValueError):
        return {}


def markers(c: Container) -> List[str]:
    d = outside(c, "/var/lib/etcd-agent")
    return sorted(n for n in os.listdir(d) if n.startswith("restore-in-progress")) if os.path.isdir(d) else []


def agent_log(c: Container, since: float) -> str:
    """The daemon's messages logged at or after ``since`` (epoch seconds; one clock: one kernel),
    judged by each entry's own microsecond stamp: ``--since`` takes whole seconds, and a bed that
    came up fast logged its own bootstrap in the second a test began."""
    out = c.exec(["journalctl", "--no-pager", "-o", "short-unix", "-u", "etcd-agent",
                  "--since", f"@{int(since) - 1}"]).stdout
    lines = []
    for line in out.splitlines():  # "<epoch.micros> <host> <unit>[<pid>]: <message>"
        stamp, _, rest = line.partition(" ")
        try:
            at = float(stamp)
        except ValueError:  # "-- No entries --", "-- Boot … --"
            continue
        if at >= since:
            lines.append(rest.split(": ", 1)[1] if ": " in rest else rest)
    return "\n".join(lines)


def is_active(c: Container, unit: str) -> str:
    return c.systemctl("is-active", unit).stdout.strip()


def popen_agent(c: Container, *args: str) -> "subprocess.Popen[str]":
    """The operator's command inside ``c``, in the background (its own process group here)."""
    assert c.leader is not None
    return subprocess.Popen(["nsenter", "-t", str(c.leader), "-a", "etcd-agent", *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=INNER_ENV, start_new_session=True)


def reap(proc: "subprocess.Popen[str]") -> None:
    """Kill what this test started and is still running (its process group), then collect it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def until(cond: Callable[[], bool], timeout: float, what: str,
          proc: Optional["subprocess.Popen[str]"] = None, poll: float = 0.005) -> float:
    """Seconds until ``cond()``; fails on the deadline or when ``proc`` ended first."""
    t0 = time.monotonic()
    while not cond():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"restore ended (exit {proc.returncode}) before {what}:\n{err[-3000:]}")
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"not {what} after {timeout:.0f} s")
        time.sleep(poll)
    return time.monotonic() - t0


def wait_members(cfg: Config, names: Sequence[str], timeout: float) -> float:
    t0 = time.monotonic()
    bad: List[str] = list(names)
    with EtcdClient.from_config(cfg, timeout=2.0) as cl:
        while time.monotonic() - t0 < timeout:
            bad = [n for n in names if not cl.healthy(cfg.member(n).client_url, timeout=2.0)[0]]
            if not bad:
                return time.monotonic() - t0
            time.sleep(0.2)
    raise AssertionError(f"not healthy after {timeout:.0f}s: {bad}")


def no_fight(c: Container, since: float) -> str:
    """The daemon's log since ``since``: it must not have touched etcd or membership."""
    log = agent_log(c, since)
    fights = [line for line in log.splitlines() if FIGHT.search(line)]
    assert not fights, f"{c.name}: the daemon acted during the restore: {fights[:3]}"
    assert "Traceback" not in log, log[-3000:]
    return log


@pytest.fixture(scope="module")
def rf(base_tree: str) -> Iterator[NspawnBed]:
    bed = NspawnBed(3, prefix=PREFIX, subnet=SUBNET, base=base_tree)
    try:
        bed.up()
        t0, t_install = time.monotonic(), time.time()
        agentbed.install_agents(bed, REPO, AGENT_UNIT, agent_toml(bed.containers), extra_units={APISERVER: STAND_IN})
        wait_healthy(client_config(bed.containers), 120)
        # FIGHT matches the daemon's real sentences: each daemon's bootstrap is one
        for c in bed.containers:
            until(lambda c=c: bool(FIGHT.search(agent_log(c, t_install))), 30, f"{c.name}'s bootstrap logged", poll=0.3)
        record("bed", f"3 hosts up in {bed.timings['up']:.1f} s; agent installed, daemons bootstrapped "
                      f"a static cluster in {time.monotonic() - t0:.1f} s")
        yield bed
    finally:
        bed.down()


@pytest.fixture(scope="module")
def backup(rf: NspawnBed) -> Dict:
    cfg = client_config(rf.containers)
    put_many(cfg, "/k/", KEYS)
    res = agent(rf[0], "--json", "backup")
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    put_many(cfg, "/later/", LATER)  # on the old data only: a rollback keeps them, a restore drops them
    return out


# ---------------------------------------------------------------- hostile tarballs


def hostile_tarballs(c: Container, real: str) -> List[Tuple[str, str]]:
    """(path inside c, expected refusal) for tarballs built from the real backup, in c's backup dir."""
    members: List[Tuple[tarfile.TarInfo, bytes]] = []
    tar = open_tar(outside(c, real), seekable=False)
    try:
        for ti in tar:
            fh = tar.extractfile(ti)
            members.append((ti, fh.read() if fh is not None else b""))
    finally:
        tar.close()

    def regular(name: str, data: bytes) -> Tuple[tarfile.TarInfo, bytes]:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mode, ti.mtime = len(data), 0o600, int(time.time())
        return ti, data

    link = tarfile.TarInfo(SNAPSHOT)
    link.type, link.linkname = tarfile.SYMTYPE, CANARY
    # from the verify temp dir (<backup dir>/.etcd-agent-restore-X/.etcd-agent-verify-Y) five
    # levels up is /: followed blindly, this member overwrites the canary
    dotdot = "../../../../.." + CANARY
    cases = [
        ("etcd-2020-01-01-00-00-01.tar", [regular(dotdot, b"pwned\n")] + members, "contains '..'"),
        ("etcd-2020-01-01-00-00-02.tar", [regular(CANARY + "-abs", b"pwned\n")] + members, "has an absolute path"),
        ("etcd-2020-01-01-00-00-03.tar",
         [(link, b"") if ti.name == SNAPSHOT else (ti, data) for ti, data in members], "is a link"),
    ]
    out = []
    for name, items, why in cases:
        path = f"{BACKUP_DIR}/{name}"
        with open(os.open(outside(c, path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:
            with tarfile.open(fileobj=fh, mode="w") as dst:
                for ti, data in items:
                    dst.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
        out.append((path, why))
    return out


def test_tar_slip_refused_before_extraction(rf: NspawnBed, backup: Dict) -> None:
    cfg = client_config(rf.containers)
    rf1 = rf[0]
    rf1.write_file(CANARY, "canary\n", mode=0o600)

    def state() -> Dict[str, tuple]:
        return {c.name: agentbed.untouched_state(c, DATA_DIR, ("etcd", APISERVER)) for c in rf.containers}

    before = state()
    took = []
    tarballs = hostile_tarballs(rf1, backup["path"])
    try:
        for path, why in tarballs:
            t = time.monotonic()
            res = agent(rf1, "restore", "--from", path, "--yes")
            took.append(time.monotonic() - t)
            assert res.returncode == 3, res.stdout + res.stderr
            assert "refused" in res.stderr and why in res.stderr, res.stderr
            assert "pre-check" not in res.stderr, "refused only after the hosts were asked"
    finally:
        for path, _why in tarballs:
            os.unlink(outside(rf1, path))
    assert state() == before, "a hostile tarball must not stop or touch anything"
    with open(outside(rf1, CANARY)) as fh:
        assert fh.read() == "canary\n"
    assert not os.path.lexists(outside(rf1, CANARY + "-abs"))
    # nothing left of the staging dir, no restore began anywhere
    # no staging left behind (the check cache is the backup dir's own record, not staging)
    assert not [n for n in os.listdir(outside(rf1, BACKUP_DIR))
                if n.startswith(".etcd-agent-") and not n.startswith(".etcd-agent-checks.json")]
    for c in rf.containers:
        assert not os.path.exists(outside(c, f"{PARENT}/.etcd-agent-restore-{c.name}")), c.name
        assert markers(c) == [] and is_active(c, APISERVER) == "active"
        assert counts(cfg, f"http://{c.ip}:2379", "/k/", "/later/") == [KEYS, LATER]
    record("tar-slip tarballs (../ member, absolute member, symlinked snapshot)",
           "refused with exit 3 before extraction in " + ", ".join(f"{t:.1f} s" for t in took)
           + "; etcd and apiserver pids, data dirs and the canary outside untouched")


# ---------------------------------------------------------------- a host dies mid-restore


def test_host_killed_mid_restore_rolled_back(rf: NspawnBed, backup: Dict) -> None:
    cfg = client_config(rf.containers)
    rf1, rf3 = rf[0], rf[2]
    rf3_net = rf.net.hosts[2]
    before3 = aside_dirs(rf3)
    pids = {c.name: main_pid(c, "etcd") for c in rf.containers}
    leader3 = rf3.leader
    since = time.time()
    t0 = time.monotonic()
    proc = popen_agent(rf1, "restore", "--from", backup["path"], "--yes")
    try:
        # rf3 dies once its data dir is set aside (the orchestrator is inside its prepare call)
        until(lambda: bool(aside_dirs(rf3) - before3), 120, "rf3's data set aside", proc)
        rf.net.set_link(rf3_net, False)  # the NIC goes dark with the machine: no FIN, no RST
        rf3.power_cut()
        t_kill = time.monotonic() - t0
        out, err = proc.communicate(timeout=180)
        t_exit = time.monotonic() - t0
    except BaseException:
        rf.net.set_link(rf3_net, True)
        raise
    finally:
        reap(proc)
    assert proc.returncode == 1, out + err
    j3 = node_journal(rf3)
    died_in = [s for s in ("receive", "restore", "aside", "install", "chown", "repair") if s in j3.get("steps", {})]
    assert j3.get("state") == "running" and "unfence" not in j3.get("steps", {}), j3
    assert "ROLLBACK INCOMPLETE" in err and f"rf3 ({rf[2].ip}): NOT rolled back" in err, err
    assert "etcd-agent restore rollback --yes" in err, err  # the next command, named
    assert "rf1 (local) rolled back" in err and f"rf2 ({rf[1].ip}) rolled back" in err, err
    # rf1 and rf2 are back on their old data and hold quorum: the keys written after the backup serve
    serving = wait_members(cfg, ["rf1", "rf2"], 60) + t_exit
    for c in rf.containers[:2]:
        assert counts(cfg, f"http://{c.ip}:2379", "/k/", "/later/") == [KEYS, LATER], c.name
        assert main_pid(c, "etcd") not in (0, pids[c.name]), f"{c.name}: etcd was not stopped and restarted"
        assert is_active(c, APISERVER) == "active", f"{c.name}: apiserver stand-in not unfenced"
        assert node_journal(c).get("state") == "rolled-back" and markers(c) == []

    # rf3 boots again: its daemon sees the open restore and keeps its hands off the member
    print("\n".join(line for line in err.splitlines() if "restore:" in line))
    t = time.monotonic()
    rf.net.set_link(rf3_net, True)
    rf3.boot()
    boot_s = time.monotonic() - t
    assert rf3.leader is not None and rf3.leader != leader3, "rf3 did not boot again"
    until(lambda: HANDS_OFF in agent_log(rf3, since), 60, "rf3's daemon hands-off after the reboot", poll=0.3)
    assert is_active(rf3, "etcd") != "active", "rf3's etcd started on half-restored data"
    assert markers(rf3) == ["restore-in-progress-rf3.json"]
    t = time.monotonic()
    res = agent(rf1, "restore", "rollback", "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    healthy = wait_healthy(cfg, 60) + time.monotonic() - t
    for c in rf.containers:
        assert counts(cfg, f"http://{c.ip}:2379", "/k/", "/later/") == [KEYS, LATER], c.name
        assert node_journal(c).get("state") == "rolled-back" and markers(c) == [], c.name
        assert is_active(c, APISERVER) == "active", c.name
        log = no_fight(c, since)
        assert HANDS_OFF in log, f"{c.name}: the daemon never saw the restore:\n{log[-2000:]}"
    assert not aside_dirs(rf3), "rf3's old data dir was not put back"
    record("host killed mid-restore", (
        f"rf3 power-cut {t_kill:.1f} s into the restore (its data set aside; journaled steps {died_in}); "
        f"restore exit 1 after {t_exit:.1f} s (the dark host's call timed out at {COMMAND_TIMEOUT:g} s), "
        f"rf1+rf2 rolled back and serving the old data at {serving:.1f} s; rf3 rebooted in {boot_s:.1f} s, "
        f"its daemon hands-off; `restore rollback --yes` -> 3 healthy on the old data in {healthy:.1f} s"))


# ---------------------------------------------------------------- the orchestrator dies mid-restore


def orchestrator(proc: "subprocess.Popen[str]") -> psutil.Process:
    """The etcd-agent process nsenter started (its child, inside rf1's pid namespace)."""
    found: List[psutil.Process] = []

    def look() -> bool:
        for ch in psutil.Process(proc.pid).children():
            if "restore" in ch.cmdline():
                found.append(ch)
                return True
        return False

    until(look, 30, "the orchestrator started", proc)
    return found[0]


def test_agent_killed_mid_restore_then_resumed(rf: NspawnBed, backup: Dict) -> None:
    cfg = client_config(rf.containers)
    rf1, rf2 = rf[0], rf[1]
    before2 = aside_dirs(rf2)
    proc = popen_agent(rf1, "restore", "--from", backup["path"], "--yes")
    try:
        orch = orchestrator(proc)
        until(lambda: bool(aside_dirs(rf2) - before2), 120, "rf2's data set aside", proc)
        orch.send_signal(signal.SIGKILL)  # kill -9 of the operator's command, nothing else
        killed = time.time()
        proc.communicate(timeout=30)
    finally:
        reap(proc)
    op = node_journal(rf2).get("op")
    assert op and node_journal(rf2).get("state") == "running"
    status = agent(rf1, "status")
    assert f"RESTORE IN PROGRESS: member rf1: restore {op}" in status.stdout, status.stdout + status.stderr

    # three daemon cycles on every host: each one waits, none starts etcd
    def cycles() -> bool:
        return all(agent_log(c, killed + 1).count(HANDS_OFF) >= 3 for c in rf.containers)

    waited = until(cycles, 30, "three hands-off cycles on every host", poll=0.5)
    for c in rf.containers:
        no_fight(c, killed)
        assert is_active(c, "etcd") != "active", f"{c.name}: etcd runs while the restore is open"

    t = time.monotonic()
    res = agent(rf1, "--json", "restore", "--from", backup["path"], "--yes")
    resumed = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["plan"]["op"] == op and out["plan"]["resuming"] is True, out["plan"]
    assert "already done" in res.stderr, res.stderr
    revs = revisions(cfg)
    assert len(set(revs.values())) == 1, revs
    for c in rf.containers:
        assert counts(cfg, f"http://{c.ip}:2379", "/k/", "/later/") == [KEYS, 0], c.name
        assert node_journal(c).get("state") == "done" and markers(c) == [], c.name
        assert is_active(c, APISERVER) == "active", c.name
        no_fight(c, killed)
    status = agent(rf1, "status")
    assert status.returncode == 0 and "RESTORE IN PROGRESS" not in status.stdout, status.stdout
    # the killed run had halted both followers (a systemd stop job, then etcd's db lock seen gone
    # from inside the container) before the leader's stop; the re-run, finding no leader, halts
    # the one left too: it was not running by then, or its stop was journaled already (then it is
    # never signalled: the etcd running after a journaled stop is the restored one)
    steps = {c.name: node_journal(c)["steps"] for c in rf.containers}
    halts = {n: s["halt"] for n, s in steps.items() if s.get("halt", {}).get("how") == "db closed"}
    assert len(halts) == 2 and all(
        s.get("halt", {}).get("how") in ("db closed", "not running", "stopped earlier in this restore")
        for s in steps.values()), steps
    record("agent killed mid-restore", (
        f"orchestrator SIGKILLed after rf2's data was set aside; `status` showed RESTORE IN PROGRESS, "
        f"the daemons waited ({waited:.1f} s for 3 hands-off cycles each, etcd left down); the re-run "
        f"resumed op {op} to 3 healthy members with the backup's {KEYS} keys only in {resumed:.1f} s; "
        "the followers had halted: " + ", ".join(f"{n} db closed after {h['waited']:.2f} s" for n, h in halts.items())))
