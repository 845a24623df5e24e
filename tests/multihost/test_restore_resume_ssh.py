"""A restore's orchestrator killed after a member's journaled step, then the same command again
(or ``restore rollback --yes``): a fault matrix over real SSH, three namespace hosts.

Hosts ev1..ev3 (10.213.16.11-13) with sshd, each with its own agent.toml
(``tests/harness/restorebed.py``); the operator's commands run on ev1. Each case starts
``restore --from X --yes``, waits in the members' journals for its kill point, SIGKILLs the
orchestrator and every ``etcd-agent node`` process on every host (the node servers and
receivers), then runs the command again. Whatever the kill point, afterwards every member answers
with one cluster ID: the restored one on every member, with the backup's data (or, after a
rollback, the old one on every member, with the old data) - never a member alone.

The split-prone point is the last phase: ev1 and ev2 journaled ``finish`` (they serve the restored
cluster and are done) while ev3 is still at ``unfence``. It is reached by stopping (SIGSTOP) ev3's
node server as soon as ev3 journals ``unfence``, so its ``finish`` cannot run, then waiting for
ev1's and ev2's journals to say done.

The cases build on each other in order (one cluster, one backup, a new restore per case).
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

from etcd_agent.etcd.client import EtcdClient
from etcd_agent.etcd.snapvalues import cluster_id_from, member_id_from
from tests.harness.netns import NsHost, _netns_pids
from tests.harness.restorebed import RestoreBed, every_member, put_many, restore_bed, retry_busy, wait_healthy

pytestmark = pytest.mark.multihost

PREFIX, SUBNET = "ev", "10.213.16"
KEYS = 500
POLL = 0.002  # the journals are polled this often: a kill point is a few ms wide at best
SPLIT = "split"  # ev1 and ev2 finished, ev3 still at unfence


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestoreBed]:
    """One bed for the whole matrix (a new restore per case), with the backup every case restores."""
    with restore_bed(tmp_path_factory, PREFIX, SUBNET) as b:
        put_many(b.cfg(), "/k/", KEYS)
        yield b


@pytest.fixture(scope="module")
def backup(bed: RestoreBed) -> str:
    return str(bed.backup()["path"])


# ---------------------------------------------------------------- the hosts' processes


def agent_nodes(h: NsHost, kind: str = "") -> List[int]:
    """The pids of ``etcd-agent ... node <kind>`` processes in host ``h``'s namespace."""
    want = b"\0node\0" + kind.encode()
    out = []
    for pid in _netns_pids(h.netns):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if want in b"\0" + fh.read():
                    out.append(pid)
        except OSError:
            continue
    return out


def signal_all(pids: List[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_everything(bed: RestoreBed, proc: "subprocess.Popen[bytes]") -> None:
    """The orchestrator (its process group: the CLI and its local node server) and every node
    process on every host, as a lost terminal and a reboot of the orchestrating master would."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)
    for h in bed.net.hosts:
        signal_all(agent_nodes(h), signal.SIGKILL)


# ---------------------------------------------------------------- kill points


def steps_of(bed: RestoreBed, member: str, op: Optional[str]) -> Tuple[Set[str], str]:
    j = bed.journal(member)
    if op is not None and j.get("op") != op:
        return set(), ""
    return set(j.get("steps", {})), str(j.get("state", ""))


def wait_for(bed: RestoreBed, proc: "subprocess.Popen[bytes]", what: str, cond: "object") -> None:
    deadline = time.monotonic() + 180
    while not cond():  # type: ignore[operator]
        assert proc.poll() is None, f"restore ended (exit {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within 180 s"
        time.sleep(POLL)


def start_and_kill(bed: RestoreBed, backup: str, point: Tuple[str, str]) -> str:
    """``restore --from backup --yes`` on ev1, killed at ``point`` (member, step journaled; or
    SPLIT); the op it began."""
    before = {m.name: bed.journal(m.name).get("op") for m in bed.cfg().members}
    proc = bed.popen_agent(bed.h(1), "restore", "--from", backup, "--yes", stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, start_new_session=True)
    stopped = threading.Event()
    serve: List[int] = []

    def progress() -> None:
        """The CLI's progress lines; ev3's node server stopped the moment the CLI has read its
        unfence reply (its finish, sent next, is then never read)."""
        assert proc.stderr is not None
        for raw in proc.stderr:
            if serve and not stopped.is_set() and b"ev3 (" in raw and b": unfence ok" in raw:
                signal_all(serve, signal.SIGSTOP)
                stopped.set()

    reader = threading.Thread(target=progress, daemon=True)
    reader.start()
    try:
        wait_for(bed, proc, "a new journal on ev3", lambda: bed.journal("ev3").get("op") not in (None, before["ev3"]))
        op = str(bed.journal("ev3")["op"])
        if point[0] == SPLIT:
            serve += agent_nodes(bed.h(3), "serve")
            assert serve, "no node server on ev3"
            wait_for(bed, proc, "ev3's node server stopped after its unfence", stopped.is_set)
            wait_for(bed, proc, "ev1 and ev2 done",
                     lambda: all(steps_of(bed, n, op)[1] == "done" for n in ("ev1", "ev2")))
            assert "finish" not in steps_of(bed, "ev3", op)[0], "ev3 finished before its node server was stopped"
        else:
            member, step = point
            wait_for(bed, proc, f"{member} at {step}", lambda: step in steps_of(bed, member, op)[0])
    finally:
        kill_everything(bed, proc)
        reader.join(10)
    return op


# ---------------------------------------------------------------- what the members serve


def restored_cluster_id(bed: RestoreBed, op: str) -> int:
    """The cluster ID a restore makes: from its members' peer URLs and its token (``journal``)."""
    j = bed.journal("ev1")
    assert j.get("op") == op, j
    urls = [pair.split("=", 1)[1] for pair in str(j["initial_cluster"]).split(",")]
    return cluster_id_from([member_id_from([u], str(j["token"])) for u in urls])


def cluster_ids(bed: RestoreBed) -> Dict[str, int]:
    cfg = bed.cfg()
    with EtcdClient.from_config(cfg, timeout=5.0) as cl:
        return {m.name: cl.status(m.client_url).cluster_id for m in cfg.members}


def old_state(bed: RestoreBed, tag: str) -> int:
    """Keys only the old data has (``/before-<tag>/``); the cluster ID before this case's restore."""
    put_many(bed.cfg(), f"/before-{tag}/", 20)
    ids = cluster_ids(bed)
    assert len(set(ids.values())) == 1, ids
    return next(iter(ids.values()))


def assert_restored(bed: RestoreBed, op: str, tag: str) -> None:
    cfg = bed.cfg()
    wait_healthy(cfg, 60)
    ids = cluster_ids(bed)
    want = restored_cluster_id(bed, op)
    assert ids == {m.name: want for m in cfg.members}, f"cluster IDs {ids}, the restored one {want:x}"
    served = every_member(cfg, "/k/", f"/before-{tag}/")
    assert all(v == [KEYS, 0] for v in served.values()), served
    states = {m.name: (bed.journal(m.name).get("op"), bed.journal(m.name).get("state")) for m in cfg.members}
    assert set(states.values()) == {(op, "done")}, states


def assert_old(bed: RestoreBed, op: str, tag: str, old_id: int) -> None:
    cfg = bed.cfg()
    wait_healthy(cfg, 60)
    ids = cluster_ids(bed)
    assert ids == {m.name: old_id for m in cfg.members}, f"cluster IDs {ids}, the old one {old_id:x}"
    served = every_member(cfg, f"/before-{tag}/")
    assert all(v == [20] for v in served.values()), served
    states = {m.name: (bed.journal(m.name).get("op"), bed.journal(m.name).get("state")) for m in cfg.members}
    assert set(states.values()) == {(op, "rolled-back")}, states


# ---------------------------------------------------------------- the matrix

RERUN = [("ev3", "fence"), ("ev2", "install"), ("ev3", "start"), ("ev2", "unfence"), (SPLIT, "")]


@pytest.mark.parametrize("point", RERUN, ids=lambda p: f"{p[0]}-{p[1]}" if p[1] else p[0])
def test_killed_then_same_command_again(bed: RestoreBed, backup: str, point: Tuple[str, str]) -> None:
    tag = f"{point[0]}-{point[1]}" if point[1] else point[0]
    old_state(bed, tag)
    op = start_and_kill(bed, backup, point)
    killed = {m.name: sorted(steps_of(bed, m.name, op)[0]) for m in bed.cfg().members}
    t = time.monotonic()
    res, busy, _w = retry_busy(lambda: bed.agent(bed.h(1), "restore", "--from", backup, "--yes"))
    assert res.returncode == 0, f"journaled at the kill: {killed}\n{res.stdout}{res.stderr}"
    assert_restored(bed, op, tag)
    said = next((line.split("restore: ", 1)[-1] for line in res.stderr.splitlines() if "resuming restore" in line), "")
    print(f"\n[figure] killed at {tag} (journaled: {killed}); the same command again: exit 0 in "
          f"{time.monotonic() - t:.1f}s ({busy} busy), one cluster ID, every member on the backup; it said: {said}")


def test_rollback_after_split_refused_then_finished(bed: RestoreBed, backup: str) -> None:
    """Two members done, one not: rolling back the third alone would leave two clusters. The
    rollback refuses, saying so and what to run; the same restore again finishes it."""
    tag = "rollback-split"
    old_state(bed, tag)
    op = start_and_kill(bed, backup, (SPLIT, ""))
    res, _busy, _w = retry_busy(lambda: bed.agent(bed.h(1), "restore", "rollback", "--yes"))
    assert res.returncode == 3, res.stdout + res.stderr
    assert "no unfinished restore is journaled" not in res.stdout + res.stderr
    assert "ev1" in res.stderr and "finished" in res.stderr and "restore --from" in res.stderr, res.stderr
    assert bed.journal("ev3").get("state") == "running"  # nothing rolled back
    dry = bed.agent(bed.h(1), "restore", "rollback", "--dry-run")
    assert dry.returncode == 3 and "finished" in dry.stderr, dry.stdout + dry.stderr
    res, _busy, _w = retry_busy(lambda: bed.agent(bed.h(1), "restore", "--from", backup, "--yes"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert_restored(bed, op, tag)


def test_rollback_after_start_rolls_every_member_back(bed: RestoreBed, backup: str) -> None:
    """Every member started on the restored data, none finished: the rollback takes them all back
    to the old data (one cluster: the old one)."""
    tag = "rollback-start"
    old_id = old_state(bed, tag)
    op = start_and_kill(bed, backup, ("ev3", "start"))
    res, _busy, _w = retry_busy(lambda: bed.agent(bed.h(1), "restore", "rollback", "--yes"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert_old(bed, op, tag, old_id)
