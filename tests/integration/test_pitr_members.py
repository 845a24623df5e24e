"""A point-in-time restore whose tail is loaded into the restored members ("members load",
``[backup.delta] point_in_time_load = "members"``): every member restores the start snapshot (the
newest checkpoint the chain vouches for, else the full backup), starts, and the orchestrator writes
the chain's folded tail into the restored cluster through etcd's API before the unfence. On
loopback, etcd 3.5.16, three members with a real `etcd-agent run` daemon each; every restore through
the CLI, every restored key space compared with the original's `Range(rev=N)` read before it.
docs/plan-fenced-load.md says what this must keep true."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from typing import Dict, List, Optional, Tuple

import pytest

from etcd_agent.backup import boundaries
from etcd_agent.errors import EtcdError
from etcd_agent.etcd import proto
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.restore.host.facts import work_dir_for
from etcd_agent.restore.orchestrator.plan import BUMP_REVISION
from tests.harness.loopback import LoopbackCluster
from tests.integration.continuous import (
    agent,
    delete,
    dump,
    full_backups,
    lease_ttl,
    put,
    rpc,
    segment_files,
    start_all,
    wait_durable,
    wait_for,
    wait_watching,
)
from tests.integration.test_daemon import Daemons, wait_healthy
from tests.integration.test_pitr_checkpoints import CHECKPOINTS, live_at, same_state, user_keys, vouched, workload
from tests.integration.test_restore import AGENT

pytestmark = pytest.mark.integration

MEMBERS = {"point_in_time_load": '"members"'}  # the default is the scratch way
NO_CHECKPOINTS = {"checkpoint_ratio": "0.0"}  # the start is the full backup: the whole chain is the tail
INTO_MEMBERS = "into the restored members"
SCRATCH_WORDING = "in a throwaway etcd"  # the scratch way's plan and dry run (the members way says "no throwaway ...")


def started(bed, delta: Dict[str, str]) -> Tuple[Daemons, LoopbackCluster, int, EtcdRpc]:  # type: ignore[no-untyped-def]
    """A three-member bed loading the tail into the restored members (``delta``: more [backup.delta]
    keys), its daemons watching: (daemons, cluster, the chain's base revision, m1's rpc)."""
    d = bed(delta={**delta, **MEMBERS})
    start_all(d)
    base = wait_watching(d.c)
    return d, d.c, base, EtcdRpc(d.c.cfg.members[0].client_url, timeout=60.0)


def ids(c: LoopbackCluster) -> Dict[str, Tuple[int, int]]:
    """member -> (cluster id, member id) as each etcd answers."""
    out = {}
    for m in c.cfg.members:
        with EtcdRpc(m.client_url, timeout=5.0) as r:
            h = r.header()
        out[m.name] = (h.cluster_id, h.member_id)
    assert len(out) == len(c.cfg.members)
    return out


def kept(c: LoopbackCluster) -> List[str]:
    """What a point-in-time restore keeps under the backup dir's .pitr: a replay's db, a tail's
    record (kept only while a restore it names can be resumed)."""
    pitr = os.path.join(c.cfg.backup.dir, ".pitr")
    return sorted(n for n in (os.listdir(pitr) if os.path.isdir(pitr) else []) if n.endswith((".db", ".tail")))


def start_revision(dry_stdout: str) -> int:
    """The revision of the snapshot a point-in-time restore starts from, as its plan names it."""
    m = re.search(r"point in time: (?:checkpoint|full backup) \S+ \(revision (\d+)", dry_stdout)
    assert m is not None, dry_stdout
    return int(m.group(1))


def tail_ops(r: EtcdRpc, old_lease: int) -> Tuple[int, int]:
    """After the start snapshot: puts, deletes, a new lease and keys on it, keys moved off and onto
    leases, keys deleted and created again (one of the snapshot's, one of the tail's), a multi-op
    transaction. (the last revision, the lease granted here)."""
    new_lease, _ = r.lease_grant(900)
    for i in range(20):
        put(r, f"/tail/plain/{i:03d}", f"t{i}".encode())
    put(r, "/tail/leased/a", b"La", new_lease)
    put(r, "/tail/leased/b", b"Lb", new_lease)
    delete(r, "/p1/k001")  # in the start snapshot: deleted, then created again
    put(r, "/p1/k001", b"again")
    put(r, "/tail/again", b"v1")  # created, deleted, created again within the tail
    delete(r, "/tail/again")
    put(r, "/tail/again", b"v2")
    put(r, "/p1/t0-0", b"moved", new_lease)  # from the snapshot's lease to the tail's
    put(r, "/p1/t40-0", b"unleased", 0)  # off its lease
    put(r, "/shared/k00", b"tail")
    delete(r, "/p1/k002")
    last = r.txn([proto.op_put(b"/tail/txn/a", b"A", old_lease), proto.op_put(b"/tail/txn/b", b"B"),
                  proto.op_delete(b"/p1/k003")]).revision
    return last, new_lease


def after_target(r: EtcdRpc, new_lease: int) -> int:
    """Writes after the target, none of which may show in the restore: puts, a delete of a key the
    tail wrote, a key of the tail overwritten, a key of the tail's lease moved off it. (A lease
    revoked soon after the target is not one: the daemon may first observe it gone, and the lease
    rule then restores its keys with 5 s to live - ``pitr.leases.fate_of``.)"""
    put(r, "/after/x", b"x")
    delete(r, "/tail/plain/000")
    put(r, "/tail/again", b"v3")
    put(r, "/tail/leased/b", b"off", 0)
    return put(r, "/after/last", b"x", new_lease)


def test_members_load_restores_the_same_state_from_a_checkpoint_and_from_the_full_backup(bed) -> None:  # type: ignore[no-untyped-def]
    _d, c, base, r = started(bed, CHECKPOINTS)
    directory = c.cfg.backup.dir
    lease, _ = r.lease_grant(900)
    n1 = workload(r, "p1", 80, lease)  # 16 KiB values: past a checkpoint's worth (1 MiB)
    wait_durable(c, n1)
    wait_for(lambda: [x for x in vouched(directory) if x[1] >= n1], 90,
             f"a checkpoint after revision {n1} that the chain vouches for")
    cp = max(x[1] for x in vouched(directory))
    target, new_lease = tail_ops(r, lease)
    last = after_target(r, new_lease)
    wait_durable(c, last)
    live = user_keys(live_at(r, target))
    assert "/tail/leased/a" in live and "/tail/again" in live and "/p1/k002" not in live, sorted(live)[:20]
    assert cp < target, (vouched(directory), target)

    dry = agent(c, "restore", "--from", "latest", "--to-revision", str(target), "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"point in time: checkpoint {max(vouched(directory), key=lambda x: x[1])[0]} (revision {cp}" in dry.stdout, (
        cp, dry.stdout)
    assert INTO_MEMBERS in dry.stdout and SCRATCH_WORDING not in dry.stdout + dry.stderr, dry.stdout + dry.stderr
    full = agent(c, "restore", "--from", "latest", "--to-revision", str(target), "--no-checkpoint", "--dry-run")
    assert full.returncode == 0 and INTO_MEMBERS in full.stdout, full.stdout + full.stderr
    assert "point in time: full backup" in full.stdout and start_revision(full.stdout) == base, (base, full.stdout)

    for how in (["--from", "latest"], ["--from", "latest", "--no-checkpoint"]):
        res = agent(c, "--json", "restore", *how, "--to-revision", str(target), "--yes")
        assert res.returncode == 0, res.stdout + res.stderr
        out = json.loads(res.stdout)
        assert out["done"] is True and not kept(c), kept(c)
        assert "load" in out["timings"] and "read: replay" not in out["timings"], (how, out["timings"])
        wait_healthy(c.cfg, 3, 60)
        r = rpc(c)
        got = dump(r)
        diff = same_state(live, user_keys(got))
        assert not diff, (how, diff[:10])
        # a lease the chain granted keeps its id; it is alive with the TTL it had left at the target
        # as the daemon observed it (~900 s), or 60 s when no observation of it was recorded
        assert got["/tail/leased/a"][1] == new_lease and got["/tail/leased/b"][1] == new_lease, (
            got["/tail/leased/a"], new_lease)
        ttl = lease_ttl(r, "/tail/leased/a")
        assert ttl is not None and 30 <= ttl <= 900, ttl
        # the restored cluster's revisions: the start snapshot's + BUMP_REVISION, then the load's above it
        start = base if "--no-checkpoint" in how else cp
        assert r.header().revision > start + BUMP_REVISION, (r.header().revision, start)
        # recorded as from the full backup, its chain and the target (as test_pitr's scratch way
        # is): not from the tail's record, a file removed once the restore is done
        [rec] = [b for b in boundaries.read(directory) if b.op == out["plan"]["op"]]
        assert rec.from_backup in full_backups(c) and rec.to_revision == target and rec.chain_id, rec
        print(f"\nFIGURE members load {' '.join(how)} --to-revision {target}: {len(live)} keys equal to the "
              f"original's Range(rev={target}); timings load {out['timings']['load']:.2f}s")


def test_dry_run_says_the_tail_goes_into_the_restored_members_and_touches_nothing(bed) -> None:  # type: ignore[no-untyped-def]
    _d, c, base, r = started(bed, NO_CHECKPOINTS)
    for i in range(30):
        put(r, f"/k/{i:03d}", b"v")
    delete(r, "/k/000")
    target = put(r, "/k/last", b"v")
    wait_durable(c, target)
    before_ids = ids(c)
    before = dump(r)
    inodes = {m.name: os.stat(c.cfg.data_dir(m.name)).st_ino for m in c.cfg.members}
    dbs = {m.name: os.stat(os.path.join(c.cfg.data_dir(m.name), "member", "snap", "db")).st_ino for m in c.cfg.members}
    backups = sorted(os.listdir(c.cfg.backup.dir))

    dry = agent(c, "restore", "--from", "latest", "--to-revision", str(target), "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    line = next((ln for ln in dry.stdout.splitlines() if INTO_MEMBERS in ln), None)
    assert line is not None, dry.stdout
    assert SCRATCH_WORDING not in dry.stdout + dry.stderr, dry.stdout + dry.stderr
    assert "dry run: nothing changed" in dry.stdout, dry.stdout
    assert start_revision(dry.stdout) == base, (base, dry.stdout)
    # nothing touched: the same members and cluster, the same data dirs and dbs, no journal, the
    # same keys, nothing new in the backup dir but what the daemons write (no replay kept)
    assert ids(c) == before_ids
    assert {m.name: os.stat(c.cfg.data_dir(m.name)).st_ino for m in c.cfg.members} == inodes
    assert {m.name: os.stat(os.path.join(c.cfg.data_dir(m.name), "member", "snap", "db")).st_ino
            for m in c.cfg.members} == dbs
    for m in c.cfg.members:
        assert not os.path.exists(os.path.join(work_dir_for(c.cfg.data_dir(m.name), m.name), "journal.json")), m.name
    assert dump(rpc(c)) == before
    now = os.listdir(c.cfg.backup.dir)
    assert set(backups) <= set(now), sorted(set(backups) - set(now))
    assert not kept(c), kept(c)
    print(f"\nFIGURE members load dry run: {line.strip()}")


def put_many(r: EtcdRpc, prefix: str, n: int, size: int, per_txn: int = 50) -> Tuple[int, Dict[str, bytes]]:
    """``n`` keys of ``size`` random bytes (hex) under ``prefix``, ``per_txn`` a transaction: (the
    last revision, key -> value)."""
    values: Dict[str, bytes] = {}
    rev = 0
    for start in range(0, n, per_txn):
        ops = []
        for i in range(start, min(n, start + per_txn)):
            k = f"{prefix}{i:05d}"
            values[k] = os.urandom(size // 2).hex().encode()
            ops.append(proto.op_put(k.encode(), values[k]))
        rev = r.txn(ops, timeout=30).revision
    return rev, values


class RevisionWatch:
    """A member's revision, read every few ms through a count-only Range; the channel is opened
    again after any error (the member stops and starts during a restore)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.r: Optional[EtcdRpc] = None
        self.seen: List[int] = []

    def revision(self) -> Optional[int]:
        try:
            if self.r is None:
                self.r = EtcdRpc(self.url, timeout=0.5)
            rev = self.r.header().revision
        except EtcdError:
            self.close()
            return None
        self.seen.append(rev)
        return rev

    def close(self) -> None:
        if self.r is not None:
            self.r.close()
            self.r = None


def test_a_restore_killed_mid_load_resumes_with_the_same_command(bed) -> None:  # type: ignore[no-untyped-def]
    _d, c, base, r = started(bed, NO_CHECKPOINTS)  # no checkpoints: the restore starts from the full backup
    lease, _ = r.lease_grant(900)
    put(r, "/small/leased", b"L", lease)
    t = time.monotonic()
    _rev, _values = put_many(r, "/tail/k", 20_000, 2048)  # 40 MB after the full backup: the load takes a moment
    wrote = time.monotonic() - t
    delete(r, "/tail/k00007")
    put(r, "/small/again", b"1")
    delete(r, "/small/again")
    target = put(r, "/small/again", b"2")
    put(r, "/after/x", b"x")
    delete(r, "/tail/k00008")
    last = delete(r, "/tail/k00009")
    wait_durable(c, last, timeout=180)
    live = user_keys(live_at(r, target))
    assert len([k for k in live if k.startswith("/tail/")]) == 19_999, len(live)

    cmd = ["restore", "--from", "latest", "--to-revision", str(target), "--yes"]
    dry = agent(c, *cmd[:-1], "--dry-run")
    assert dry.returncode == 0 and INTO_MEMBERS in dry.stdout, dry.stdout + dry.stderr
    start = base + BUMP_REVISION  # the restored members' first revision; the load's come after it
    said = open(os.path.join(c.dir, "restore-killed.stderr"), "w+b")
    proc = subprocess.Popen([AGENT, "-c", c.config_path, *cmd], stdout=subprocess.DEVNULL, stderr=said,
                            start_new_session=True)
    watch = RevisionWatch(c.cfg.members[0].client_url)
    t = time.monotonic()
    try:
        def loading() -> Optional[int]:
            if proc.poll() is not None:
                said.seek(0)
                raise AssertionError(f"the restore ended (rc {proc.returncode}) before its load was seen: "
                                     + said.read().decode(errors="replace")[-3000:])
            rev = watch.revision()
            return rev if rev is not None and rev > start else None

        killed_at = wait_for(loading, 300, f"m1 past the restored start revision {start}", interval=0.003)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        watch.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        said.seek(0)
        first = said.read().decode(errors="replace")
        said.close()
    took = time.monotonic() - t
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, first[-3000:])
    assert killed_at > start, (killed_at, start)
    # mid-load: the restored cluster serves, above its start revision, without all of the tail
    with EtcdRpc(c.cfg.members[0].client_url, timeout=10.0) as m1:
        partial = m1.range(b"/tail/", b"/tail0", count_only=True).count
    assert partial < 19_999, f"the load had finished before the kill ({partial} keys): make the tail bigger"

    t = time.monotonic()
    res = agent(c, *cmd, timeout=600)
    resumed = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    resuming = next((ln for ln in res.stderr.splitlines() if "resuming restore" in ln), None)
    assert resuming is not None, res.stderr
    assert not kept(c), kept(c)  # done: nothing left to resume
    wait_healthy(c.cfg, 3, 60)
    with EtcdRpc(c.cfg.members[0].client_url, timeout=60.0) as r2:
        got = dump(r2)
        diff = same_state(live, user_keys(got))
        assert not diff, diff[:10]
        assert got["/small/leased"][1] == lease, (got["/small/leased"], lease)  # the chain's lease, its id kept
        assert r2.header().revision > start, (r2.header().revision, start)
    print(f"\nFIGURE members load kill: 20,000 keys of 2 KiB written in {wrote:.1f}s; restore --to-revision "
          f"{target} SIGKILLed {took:.1f}s in, m1 at revision {killed_at} (start {start}), {partial} of the "
          f"tail's 19,999 keys loaded; the same command resumed it in {resumed:.1f}s: {len(live)} keys equal "
          f"to Range(rev={target}); it said: {resuming.split('restore: ', 1)[-1][:300]}")


def test_a_load_that_fails_rolls_every_member_back(bed) -> None:  # type: ignore[no-untyped-def]
    d, c, _base, r = started(bed, NO_CHECKPOINTS)
    for i in range(20):
        put(r, f"/k/{i:03d}", b"v")
    put(r, "/big", os.urandom(350 * 1024).hex().encode())  # ~700 KiB: more than the restored members take
    target = put(r, "/k/last", b"v")
    wait_durable(c, target)
    # every member's etcd takes requests of 512 KiB at most from now on (the restore keeps the
    # tuning lines of etcd.conf): the daemons stopped, the line appended, the members started again
    d.stop()
    for lm in c.members:
        lm.backend.stop(timeout=10)
        with open(c.cfg.conf_file(lm.member.name), "a") as fh:
            fh.write("ETCD_MAX_REQUEST_BYTES=524288\n")
    for lm in c.members:
        lm.backend.start()
    for lm in c.members:
        lm.wait_healthy(30)
    wait_healthy(c.cfg, 3, 60)
    r = rpc(c)
    with pytest.raises(EtcdError) as ei:
        put(r, "/too-big", os.urandom(300 * 1024).hex().encode())
    assert "too large" in ei.value.message, ei.value.message
    before = dump(r)
    before_ids = ids(c)
    backups = set(full_backups(c)) | set(segment_files(c))
    assert "/big" in before and "/too-big" not in before

    res = agent(c, "restore", "--from", "latest", "--to-revision", str(target), "--yes")
    assert res.returncode != 0, res.stdout + res.stderr
    assert "loading the point-in-time tail" in res.stderr, res.stderr
    assert "every member was rolled back to its data from before" in res.stderr, res.stderr
    wait_healthy(c.cfg, 3, 60)
    assert ids(c) == before_ids
    after = dump(rpc(c))
    assert after.keys() == before.keys() and after == before, sorted(after.keys() ^ before.keys())
    assert backups <= set(full_backups(c)) | set(segment_files(c)), "a backup went"
    assert not kept(c), f"rolled back, nothing to resume, yet .pitr keeps {kept(c)}"
    said = next(ln for ln in res.stderr.splitlines() if "loading the point-in-time tail" in ln)
    print(f"\nFIGURE members load failure: {said.strip()[:300]}; every member back on its data "
          f"({len(before)} keys, the same member ids); left in .pitr: {kept(c)}")
