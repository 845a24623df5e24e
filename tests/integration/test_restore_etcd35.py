"""`etcd-agent restore` on an etcd 3.5 toolchain: etcd, etcdctl and etcdutl 3.5.16 (Debian trixie's,
laid out under /opt/etcd by ``packaging/install-deps.sh test``), and what the revision bump is for.

On 3.5 the snapshot tool is etcdutl, and etcdutl >= 3.5.10 restores with ``--bump-revision
--mark-compacted`` (the Kubernetes-safe path). ``test_watch_from_before_the_restore`` shows why,
side by side with 3.4.23 (etcdctl, no bump): a clientv3 watcher - what a kube-apiserver's watch
cache runs - stays up across the restore and resumes from the last revision it received. With the
bump it is told "compacted" (an apiserver relists); without it, it silently resumes on a history
that was rolled back and misses the writes made after the restore. That etcdutl 3.5.0-3.5.9 get no
such flags is plan logic (tests/unit/test_restore_plan.py).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Dict, List

import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.cli.main import main
from etcd_agent.cluster.health import wait_converged
from etcd_agent.errors import OperationFailed
from etcd_agent.etcd.versions import can_bump
from etcd_agent.hosts.local import LocalHost
from etcd_agent.node.replies import HaltReply, RestoreReply, RollbackReply
from etcd_agent.restore.host import journal as J
from etcd_agent.restore.host.node import NodeRestore
from etcd_agent.restore.orchestrator.plan import BUMP_REVISION
from tests.harness.loopback import LoopbackCluster
from tests.harness.releases import DEFAULT, LEGACY, release
from tests.harness.watcher import Watcher, server_watchers

pytestmark = pytest.mark.integration

AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
EXTRA = f'[ssh]\nagent_path = "{AGENT}"\n'
KEYS, LATER = 1_000, 100


def tool_version(path: str) -> str:
    out = subprocess.run([path, "version"], capture_output=True, text=True, timeout=30, check=True).stdout
    return out.splitlines()[0].split(":", 1)[1].strip()  # "etcdutl version: 3.5.16"


def bump_tools() -> Dict[str, str]:
    """etcd/etcdctl/etcdutl of the default release, whose etcdutl has --bump-revision (3.5.10+)."""
    rel = release(DEFAULT)
    assert rel.etcdutl is not None and can_bump(tool_version(rel.etcdutl)), rel
    return {"etcd": rel.etcd, "etcdctl": rel.etcdctl, "etcdutl": rel.etcdutl}


def make(cluster_factory: Any, tools: Dict[str, str]) -> LoopbackCluster:
    c = cluster_factory(3, extra=EXTRA, version=DEFAULT)
    assert (c.cfg.etcd.binary, c.cfg.etcd.etcdctl, c.cfg.etcd.etcdutl) == (tools["etcd"], tools["etcdctl"], tools["etcdutl"])
    c.start_static()
    with c.client() as cl:
        assert {cl.status(m.client_url).version for m in c.cfg.members} == {tool_version(tools["etcdctl"])}
    return c


def revisions(c: LoopbackCluster) -> List[int]:
    with c.client() as cl:
        return [cl.status(m.client_url).revision for m in c.cfg.members]


def get_at(c: LoopbackCluster, key: str, rev: int) -> "subprocess.CompletedProcess[str]":
    """A real etcdctl read of ``key`` at an old revision (the agent's client has no ranged-rev read)."""
    argv = [c.cfg.etcd.etcdctl, f"--endpoints={c.cfg.members[0].client_url}", "get", key, f"--rev={rev}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"})


def disaster(c: LoopbackCluster, capsys: Any) -> Dict[str, Any]:
    """Keys, backup, later keys, dry run, data dirs deleted, restore --yes: what the test asserts on."""
    with c.client() as cl:
        for i in range(KEYS):
            cl.put(f"/k/{i:06d}", b"v" * 32)
    b = take_backup(c.cfg, member="m1")
    with c.client() as cl:
        for i in range(LATER):
            cl.put(f"/later/{i:06d}", b"w")
    before = revisions(c)
    capsys.readouterr()
    assert main(["-c", c.config_path, "restore", "--from", b.path, "--dry-run"]) == 0
    plan_text = capsys.readouterr().out
    argv_line = next(ln.strip() for ln in plan_text.splitlines() if ln.strip().startswith("$ ") and "--name=m1" in ln)
    c.stop()
    for m in c.cfg.members:
        shutil.rmtree(c.cfg.data_dir(m.name))
    assert main(["-c", c.config_path, "restore", "--from", b.path, "--yes"]) == 0, capsys.readouterr().err
    with c.client() as cl:
        counts = [cl.count_prefix("/k/"), cl.count_prefix("/later/")]
        health = [cl.healthy(m.client_url) for m in c.cfg.members]
    return {"backup": b, "before": before, "after": revisions(c), "plan": plan_text, "argv": argv_line,
            "counts": counts, "health": health}


def test_restore_bumped_and_compacted(cluster_factory, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tools = bump_tools()
    c = make(cluster_factory, tools)
    r = disaster(c, capsys)
    b = r["backup"]

    assert r["argv"].startswith(f"$ {tools['etcdutl']} snapshot restore ")
    assert r["argv"].endswith(f"--bump-revision={BUMP_REVISION} --mark-compacted --skip-hash-check"), r["argv"]
    assert "NOT bumped" not in r["plan"] and "revision bumped by" in r["plan"]
    assert r["counts"] == [KEYS, 0]
    assert all(ok for ok, _ in r["health"]), r["health"]
    after = r["after"]
    assert len(set(after)) == 1 and after[0] >= b.revision + BUMP_REVISION and after[0] > max(r["before"])
    # every revision up to the bumped one is compacted: an apiserver's watch from before the restore
    # gets "compacted" and relists instead of resuming on history that never happened
    old = get_at(c, "/k/000000", b.revision)
    assert old.returncode != 0 and "compacted" in old.stderr, (old.stdout, old.stderr)
    with capsys.disabled():
        print(f"\nFIGURE restore-etcd-bump: dry-run {r['argv']}")
        print(f"FIGURE restore-etcd-bump: backup revision {b.revision}, before restore {r['before']}, after {after}; "
              f"read at --rev={b.revision}: {old.stderr.strip().splitlines()[-1:]}")

    # `backup verify` and the backup's own check run `etcdutl snapshot status` (3.5 deprecates the etcdctl one)
    seen: List[List[str]] = []
    real_run = LocalHost.run

    def spy(self: LocalHost, argv: Any, **kw: Any) -> Any:  # records, then runs the real command
        seen.append(list(argv))
        return real_run(self, argv, **kw)

    monkeypatch.setattr(LocalHost, "run", spy)
    nb = take_backup(c.cfg, member="m2", full_verify=True)  # of the restored cluster (a new cluster id)
    capsys.readouterr()
    assert main(["-c", c.config_path, "backup", "verify", nb.path]) == 0, capsys.readouterr().out
    assert "snapshot status ok" in capsys.readouterr().out
    status_calls = [a for a in seen if a[1:3] == ["snapshot", "status"]]
    assert len(status_calls) >= 2 and all(a[0] == tools["etcdutl"] for a in status_calls), seen


def put_range(c: LoopbackCluster, prefix: str, n: int) -> None:
    with c.client() as cl:
        for i in range(n):
            cl.put(f"{prefix}{i:06d}", b"x")


@pytest.mark.parametrize("version", [DEFAULT, LEGACY])
def test_watch_from_before_the_restore(cluster_factory, capsys, version) -> None:  # type: ignore[no-untyped-def]
    """A watcher of the whole keyspace started before the restore, reconnecting by itself after it."""
    c = cluster_factory(3, extra=EXTRA, version=version)
    c.start_static()
    bumps = version == DEFAULT
    put_range(c, "/k/", KEYS)
    b = take_backup(c.cfg, member="m1")
    w = Watcher(c.cfg.etcd.etcdctl, c.cfg.client_urls, "/", b.revision + 1)
    try:
        put_range(c, "/later/", LATER)  # after the backup: the restore rolls these back
        seen_max = max(revisions(c))
        w.wait(f"revision {seen_max}", lambda w: seen_max in w.revisions(), 30)
        before = len(w.revisions())
        capsys.readouterr()
        assert main(["-c", c.config_path, "restore", "--from", b.path, "--dry-run"]) == 0
        note = next(ln.strip() for ln in capsys.readouterr().out.splitlines() if "revision" in ln and "bump" in ln.lower())
        # in place, on the running cluster, the watcher connected throughout
        assert main(["-c", c.config_path, "restore", "--from", b.path, "--yes"]) == 0, capsys.readouterr().err
        restored = max(revisions(c))
        # the watcher reconnects on its own (backoff): cancelled at once, or served again
        w.wait("a reconnect", lambda w: w.seen.canceled or server_watchers(c.cfg.client_urls) > 0, 60)
        put_range(c, "/after/", LATER + 10)  # enough to carry a rolled-back store past seen_max
        final = max(revisions(c))
        if bumps:
            w.wait("the compacted cancel", lambda w: w.seen.canceled, 60)
        else:
            # every write after the restore that it will get, up to the last one: then what it missed is all it misses
            w.wait(f"the event of revision {final}", lambda w: final in w.revisions(), 60)
    finally:
        seen = w.stop()
    got = [r for _k, r in seen.events[before:]]
    after_writes = list(range(restored + 1, final + 1))
    missed = [r for r in after_writes if r not in got]
    if bumps:
        assert "revision bumped by" in note, note
        assert restored > seen_max and restored > b.revision + BUMP_REVISION, (restored, seen_max)
        assert seen.canceled and "compacted" in seen.stderr, seen.stderr
        assert not got, got  # nothing at all, certainly nothing older than what it had
        # what a reflector does next: relist (a read at the current revision) and watch from there
        relisted = max(revisions(c))
        w2 = Watcher(c.cfg.etcd.etcdctl, c.cfg.client_urls, "/", relisted + 1)
        try:
            put_range(c, "/relisted/", 10)
            w2.wait("10 events after the relist", lambda w: len(w.revisions()) >= 10, 30)
        finally:
            re_seen = w2.stop()
        re_revs = [r for _k, r in re_seen.events]
        assert relisted > seen_max and len(re_revs) == 10 and min(re_revs) > seen_max, (relisted, re_revs)
        verdict = (f"CANCELED: {seen.stderr.strip().splitlines()[0]}"
                   + (f" (compact revision {seen.compact_revision})" if seen.compact_revision else "")
                   + f", 0 events; relisted at {relisted} and watched on: {len(re_revs)} events, revisions "
                     f"{min(re_revs)}..{max(re_revs)}, all above {seen_max}")
    else:
        assert note.startswith("revision NOT bumped: restoring with etcdctl (etcd 3.4)"), note
        assert restored < seen_max < final, (restored, seen_max, final)  # the store went back in time
        assert not seen.canceled, seen.stderr
        # it resumed after the last revision it had and got the rest; the first writes after the
        # restore reused revisions it had already seen (for keys now gone): never told
        assert got and min(got) == seen_max + 1 and missed == list(range(restored + 1, seen_max + 1)), (got, missed)
        verdict = (f"no error; got {len(got)} events (revisions {min(got)}..{max(got)}), silently missed "
                   f"{len(missed)} of the {len(after_writes)} changes made after the restore "
                   f"(revisions {missed[0]}..{missed[-1]}, which it had seen before for other keys)")
    with capsys.disabled():
        print(f"\nFIGURE watch-across-restore etcd {version}: plan: {note}")
        print(f"FIGURE watch-across-restore etcd {version}: backup revision {b.revision}; watcher from "
              f"{b.revision + 1} saw up to {seen_max} before the restore; restored revision {restored} "
              f"({'above' if restored > seen_max else 'BELOW'} what it saw); {len(after_writes)} writes after "
              f"(revisions {restored + 1}..{final})")
        print(f"FIGURE watch-across-restore etcd {version}: watcher reconnected from {seen_max + 1}: {verdict}")


@pytest.mark.parametrize("version", [DEFAULT, LEGACY])
def test_the_followers_close_their_data_then_the_leader_stops(cluster_factory, capsys, version) -> None:  # type: ignore[no-untyped-def]
    """On a running cluster, the followers are halted until their db lock is gone (seen in the
    real kernel's /proc/locks, held by a real etcd), not until they exit; the leader is stopped
    then, and every member is waited for to exit before its data dir moves: all healthy after."""
    c = cluster_factory(3, extra=EXTRA, version=version)
    c.start_static()
    put_range(c, "/k/", KEYS)
    b = take_backup(c.cfg, member="m1")
    with c.client() as cl:
        leader = next(m.name for m in c.cfg.members if cl.status(m.client_url).is_leader)
    capsys.readouterr()
    assert main(["-c", c.config_path, "--json", "restore", "--from", b.path, "--yes"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    halts = {m.group(1): m.group(2) for m in re.finditer(r"restore: (\S+) \([^)]*\): halt ok - (.*)", err)}
    assert sorted(halts) == sorted(m.name for m in c.cfg.members if m.name != leader), err
    assert all(how.startswith("db closed after ") for how in halts.values()), halts
    assert sum(1 for ln in err.splitlines() if ": stop ok" in ln) == 3, err
    with c.client() as cl:
        assert all(cl.healthy(m.client_url)[0] for m in c.cfg.members)
        assert cl.count_prefix("/k/") == KEYS
    timings = json.loads(out)["timings"]
    with capsys.disabled():
        print(f"\nFIGURE restore-stop-order ({version}): leader {leader}; "
              + "; ".join(f"{m}: {how}" for m, how in sorted(halts.items()))
              + f"; halt phase {timings['stop']:.2f}s, then the leader's stop and everyone's prepare "
                f"{timings['prepare']:.2f}s; downtime {json.loads(out)['downtime']:.2f}s")


def begun(c: LoopbackCluster, member: str, op: str) -> NodeRestore:
    """A member's side of restore ``op`` after its ``begin`` (the journal open, nothing touched)."""
    node = NodeRestore(c.cfg, member, op)
    node.begin(token="t", initial_cluster="", sha256=None, size=0, backup="b.tar", bump=None, fence_owner=False,
               new_cluster=False)
    return node


def test_a_follower_rolled_back_while_it_is_still_exiting_runs_again(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    """The window ``halt`` opens: the follower's db is closed, its process still lives (etcd 3.5
    closing its peer server). A rollback right then waits for its exit and starts it again on
    its untouched data - it is not taken for a member that never stopped."""
    c = cluster_factory(3, extra=EXTRA, version=DEFAULT)
    c.start_static()
    put_range(c, "/k/", 100)
    with c.client() as cl:
        follower = next(m.name for m in c.cfg.members if not cl.status(m.client_url).is_leader)
    node = begun(c, follower, "op-halted")
    halted = node.halt()
    assert isinstance(halted, HaltReply) and halted.how == "db closed", halted
    lingering = node.backend.is_active()  # usually True: the process exits up to 1 s later
    rb = node.rollback()
    assert isinstance(rb, RollbackReply) and rb.running, rb
    assert "etcd stopped" in rb.did and "etcd started again" in rb.did, rb
    revs = wait_converged(c.cfg, 60)
    with c.client() as cl:
        assert cl.count_prefix("/k/") == 100
    with capsys.disabled():
        print(f"\nFIGURE halt-rollback: {follower} {halted.note()}; its process still alive at the rollback: "
              f"{lingering}; rollback: {'; '.join(rb.did)}; all {len(revs)} healthy at {set(revs.values())}")


def test_a_resumed_restore_never_halts_the_etcd_its_own_start_began(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    """A restore cut off after a member's ``stop`` (it was the leader then, so it had no halt)
    and ``start``: the resumed run finds a new leader and halts everyone else - this member's
    etcd, running now, is the one its own ``start`` began. ``halt`` leaves it running (found
    by CI: the resumed restore halted a restored member, whose ``start`` was "already done")."""
    c = cluster_factory(3, extra=EXTRA, version=DEFAULT)
    c.start_static()
    put_range(c, "/k/", 100)
    with c.client() as cl:
        leader = next(m.name for m in c.cfg.members if cl.status(m.client_url).is_leader)
    node = begun(c, leader, "op-resumed")
    node.stop()
    node.backend.start()  # what the cut-off run's `start` step left running
    wait_converged(c.cfg, 60)
    pid = node.backend.pid()  # type: ignore[attr-defined]
    assert pid is not None
    halted = node.halt()
    assert isinstance(halted, HaltReply) and halted.how == "stopped earlier in this restore", halted
    assert node.backend.pid() == pid  # type: ignore[attr-defined]  # the same process, never signalled
    revs = wait_converged(c.cfg, 60)
    with capsys.disabled():
        print(f"\nFIGURE resumed-halt: {leader} halt {halted.note()}; pid {pid} still running; "
              f"all {len(revs)} healthy at {set(revs.values())}")


def test_a_resumed_start_starts_again_a_restored_member_whose_etcd_went(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    """A member started on its data in a restore that was then cut off, and its etcd went since
    (its host rebooted): the resumed run's ``start`` starts it again instead of answering
    "already done" and leaving the whole restore to time out and roll back."""
    c = cluster_factory(3, extra=EXTRA, version=DEFAULT)
    c.start_static()
    put_range(c, "/k/", 100)
    member = c.cfg.members[1].name
    node = begun(c, member, "op-gone")
    node.stop()
    first = node.start()
    assert first.skipped is None and node.backend.is_active(), first
    wait_converged(c.cfg, 60)
    node.backend.stop(30.0)  # what a reboot of its host leaves
    assert not node.backend.is_active()
    again = node.start()
    assert again.skipped == "done before; etcd was not running: started again", again
    assert node.backend.is_active()
    revs = wait_converged(c.cfg, 60)
    with c.client() as cl:
        assert cl.count_prefix("/k/") == 100
    third = node.start()  # running now: nothing to do
    assert third.skipped == "already done", third
    with capsys.disabled():
        print(f"\nFIGURE resumed-start: {member} {again.note()}; all {len(revs)} healthy at {set(revs.values())}")


def test_the_staged_snapshot_goes_once_restored_and_a_lost_restore_is_named(cluster_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A member's snapshot is staged unsynced (its pages mostly never reach the disk) and removed
    as soon as etcdutl has restored it, while etcd still serves. A resumed run that then finds the
    restored dir gone names the way out instead of restoring from a snapshot that is no more."""
    c = cluster_factory(3, extra=EXTRA, version=DEFAULT)
    c.start_static()
    put_range(c, "/k/", 100)
    snap = str(tmp_path / "snap.db")
    subprocess.run([c.cfg.etcd.etcdctl, f"--endpoints={c.cfg.members[0].client_url}", "snapshot", "save", snap],
                   env=dict(os.environ, ETCDCTL_API="3"), capture_output=True, timeout=60, check=True)
    member = c.cfg.members[1].name
    node = NodeRestore(c.cfg, member, "op-staged")
    node.begin(token="t", initial_cluster=f"{member}={c.cfg.members[1].peer_url}", sha256=None,
               size=os.path.getsize(snap), backup="b.tar", bump=None, fence_owner=False, new_cluster=False)
    got = node.receive(None, copy_from=(snap, 0))
    assert got.sha256 is not None and sorted(os.listdir(node.work_dir)) == ["etcd_snapshot.db", "journal.json",
                                                                           "received.json"]
    restored = node.restore()
    tmp = f"{node.data_dir}.restoring"
    assert os.path.isdir(os.path.join(tmp, "member", "snap")), restored
    assert os.listdir(node.work_dir) == ["journal.json"], "the snapshot stays once restored"
    assert node.backend.is_active(), "the restore beside the data stopped etcd"
    assert node.restore().skipped == "already done"
    j = node.journal()
    assert j is not None
    done = j.steps.pop("restore")  # a run cut off after etcdutl, before its step was journaled...
    assert isinstance(done, RestoreReply)
    j.pending["restore"] = J.Pending(output=tmp, argv=done.argv)
    J.save(node.journal_path, j)
    shutil.rmtree(tmp)  # ... and its output gone since
    with pytest.raises(OperationFailed) as err:
        node.restore()
    assert "is gone" in str(err.value) and "restore rollback --yes" in str(err.value), err.value
    rb = node.rollback()
    assert isinstance(rb, RollbackReply) and rb.running, rb
    with c.client() as cl:
        assert cl.count_prefix("/k/") == 100
