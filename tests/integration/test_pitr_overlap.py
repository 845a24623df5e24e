"""A point-in-time restore opens and pre-checks the hosts while its replay runs (issue 35 item
10), and killed (-9) in that overlap leaves the live cluster untouched and the next run clean.
Real daemons writing the chain, a real replay, real processes: the replay's throwaway etcd is
frozen (SIGSTOP) as soon as it runs, so the replay cannot end before the test has seen the hosts'
locks taken - which a restore that opened the hosts only after its replay never does."""
from __future__ import annotations

import json
import os
import signal
from typing import Dict, List, Tuple

import psutil
import pytest

from etcd_agent.restore.host.facts import work_dir_for
from etcd_agent.state.locks import holder_of
from tests.harness.loopback import LoopbackCluster
from tests.harness.procs import agent_run
from tests.integration.continuous import agent, dump, put, rpc, start_all, wait_durable, wait_for, wait_watching
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_delta_faults import _live
from tests.integration.test_pitr_leftovers import _scratch_etcds
from tests.integration.test_restore import AGENT
from tests.integration.test_upgrade import who_serves

pytestmark = pytest.mark.integration


def _written(bed, keys: int, value: bytes) -> Tuple[LoopbackCluster, Dict[str, Tuple[bytes, int]]]:  # type: ignore[no-untyped-def]
    """A bed whose daemons have written ``keys`` puts into their chain; the cluster and its data."""
    d = bed()
    c = d.c
    start_all(d)
    wait_watching(c)
    r = rpc(c)
    for i in range(keys):
        put(r, f"/k/{i:03d}", value)
    wait_durable(c, put(r, "/k/top", b"v"))
    return c, dump(r, "/k/")


def test_killed_while_the_hosts_are_prechecked_during_the_replay_touches_nothing(bed) -> None:  # type: ignore[no-untyped-def]
    c, before = _written(bed, 200, b"v" * 100)
    backup_dir = c.cfg.backup.dir
    tops = [backup_dir, c.cfg.daemon.state_dir]
    cmd = [AGENT, "-c", c.config_path, "restore", "--from", "latest", "--to", "newest", "--yes"]
    # what the hosts show, not what a journal says: which etcd serves each member (pid, binary,
    # start time), the members and cluster id they answer with, what their data dirs hold
    live, serving = _live(c), who_serves(c)

    def restore_holds_the_lock() -> bool:
        h = holder_of(backup_dir)
        return h is not None and (h.operation or "").startswith("restore")

    frozen: List[psutil.Process] = []
    with agent_run(cmd) as proc:
        def replay_member() -> List[psutil.Process]:
            assert proc.poll() is None, "the restore ended before its replay could be frozen"
            # the name as listed (p.info): asked again, a process that ended meanwhile (the replay's
            # etcdutl, done restoring) raises NoSuchProcess (CI 46)
            return [p for p in _scratch_etcds(tops) if p.info["name"] == "etcd"]

        frozen = wait_for(replay_member, 180, "the replay's throwaway etcd running", interval=0.01)
        for p in frozen:  # the replay cannot go on, let alone end, until the test has seen the hosts
            p.send_signal(signal.SIGSTOP)
        wait_for(restore_holds_the_lock, 60, "the hosts' sessions opened (their locks taken) while the replay runs",
                 interval=0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # the throwaway etcd dies with its run (the parent-death signal kills a stopped process too)
    _, alive = psutil.wait_procs(frozen, timeout=15)
    assert not alive, f"throwaway etcd(s) {[p.pid for p in alive]} outlived the restore killed with -9"
    # each host's session ends with its run: every lock is free again
    wait_for(lambda: holder_of(backup_dir) is None or not restore_holds_the_lock(), 30,
             "the killed restore's host locks released")
    # the live cluster untouched: every member serves the same data, no member journaled a restore
    wait_healthy(c.cfg, 3, 60)
    assert dump(rpc(c), "/k/") == before
    assert who_serves(c) == serving, "another etcd serves a member after a restore killed before it touched any"
    assert _live(c) == live
    for m in c.cfg.members:
        journal = os.path.join(work_dir_for(c.cfg.data_dir(m.name), m.name), "journal.json")
        assert not os.path.exists(journal), f"{m.name} journaled a restore that never began: {journal}"
    # and the next run of the same restore is clean: it sweeps what the killed one left and restores
    res = agent(c, *cmd[3:])
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(c.cfg, 3, 60)
    assert dump(rpc(c), "/k/").keys() == before.keys()
    assert not _scratch_etcds(tops)
    assert json.loads(agent(c, "--json", "status").stdout)["leftovers"] == []
    assert not [n for n in os.listdir(os.path.join(backup_dir, ".pitr")) if not n.startswith(".")]


def test_a_busy_host_refuses_the_replay_and_leaves_nothing(bed) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent.state.locks import Holder, OperationLock, SessionOwner, lock_path_for

    c, before = _written(bed, 50, b"v")
    tops = [c.cfg.backup.dir, c.cfg.daemon.state_dir]
    other = OperationLock(lock_path_for(c.cfg.backup.dir), "restore --from x",
                          holder=Holder(owner=SessionOwner("restore --from x", "master9", 77, "t")), wait=0.0)
    with other:
        res = agent(c, "restore", "--from", "latest", "--to", "newest", "--yes")
    assert res.returncode == 4, res.stdout + res.stderr
    assert "master9" in res.stderr, res.stderr
    assert not _scratch_etcds(tops), "the refused restore's throwaway etcd is still running"
    pitr = os.path.join(c.cfg.backup.dir, ".pitr")
    left = [n for n in os.listdir(pitr) if not n.startswith(".")] if os.path.isdir(pitr) else []
    assert not left, f"the refused restore left its replay behind: {left}"
    assert dump(rpc(c), "/k/") == before
