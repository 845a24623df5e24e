"""Watcher and replay against real etcd 3.5.16 on loopback."""
import os
import threading
import time

import pytest

from etcd_agent.chain.check import check_chain
from etcd_agent.chain.errors import ChainBroken
from etcd_agent.chain.reader import read_segment
from etcd_agent.chain.segments import PUT, Event, LeaseRecord, SegmentHeader, Txn, list_segments
from etcd_agent.chain.writer import SegmentWriter
from etcd_agent.continuous.watcher import DeltaWatcher
from etcd_agent.etcd import proto
from etcd_agent.pitr.replay import ReplayResult, Target
from etcd_agent.pitr.replayrun import replay
from etcd_agent.scratch.member import ScratchOptions, scratch_etcd, start_scratch

from .helpers import Writer, assert_replayed, dump, put, values, wait_for, wait_watcher_caught_up

pytestmark = pytest.mark.integration

FAST = {"close_seconds": 0.5, "idle_seconds": 1.0, "progress_timeout": 1.0, "heartbeat_seconds": 2.0}
# the daemon's watch read in batches ([backup.delta] batch_seconds), and the streaming one
MODES = pytest.mark.parametrize("batch", [0.0, 0.3], ids=["stream", "batched"])


def few_responses(w, revisions):
    """A batched watch gets many revisions a message (etcd's catch-up); a streaming one, one."""
    if w.opt.batch_seconds:
        assert w.responses * 5 <= revisions, (w.responses, revisions)


def full_backup(live, directory):
    # (an empty store's snapshot says revision 0 while the server says 1: keep one key)
    put(live.rpc, b"seed", b"s")
    path = os.path.join(directory, "full.db")
    status = live.snapshot_save(path)
    assert status.revision == live.rpc.header().revision
    return path, status.revision


def started(live, base, segdir, **kw):
    opts = dict(FAST)
    opts.update(kw)
    w = DeltaWatcher(live.endpoint, base, segdir, **opts)
    w.start()
    return w


def finish(w, live):
    """Let the watcher write everything up to the live revision, then stop it."""
    wait_watcher_caught_up(w, live.rpc.header().revision)
    w.stop()


def restored(path):
    return scratch_etcd(path, ScratchOptions())


@MODES
def test_replay_newest_equals_live(live, tmp_path, batch):
    r = live.rpc
    snap_lease, _ = r.lease_grant(300)
    for i in range(20):
        put(r, b"k%03d" % i, b"before")
    put(r, b"snap-lease-key", b"s", snap_lease)
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir, close_bytes=32 * 1024, batch_seconds=batch)
    Writer(r).run(4.0)
    time.sleep(3.5)  # the writer's 2 s leases run out: their deletes are in the chain too
    finish(w, live)
    final = r.header().revision
    live_kv = dump(r)
    paths = list_segments(segdir)
    assert len(paths) >= 4 and check_chain(paths, base).stop is None
    assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in paths)

    few_responses(w, final - base)
    res = replay(full, paths, Target.newest(), output=str(tmp_path / "pitr.db"))
    assert res.complete and res.lost_after is None
    assert res.reached_revision == final and res.base_revision == base
    assert res.revisions_applied == final - base
    assert res.leases.keys_reattached == 1  # the full backup's lease, moved to its remaining TTL
    assert res.keys_loaded and len(res.load_revisions) >= 1
    # where the replay's time went, kept through the result's JSON (the kept replay's side file)
    phases = dict(res.phases)
    assert {"stage", "fold", "scratch: restore", "scratch: start", "load"} <= set(phases), phases
    assert {"defragment", "defragment skipped (mostly in use)"} & set(phases), phases
    assert all(v >= 0 for v in phases.values()) and ReplayResult.from_json(res.to_json(), "kept").phases == res.phases
    with restored(res.snapshot_path) as s:
        got = dump(s.rpc)
        assert_replayed(got, live_kv, base, final, moved=(b"snap-lease-key",))
        # the load's transactions, then the lease fix-up
        assert s.rpc.header().revision == res.snapshot_revision == res.load_revisions[-1] + 1


@MODES
def test_point_in_time(live, tmp_path, batch):
    r = live.rpc
    put(r, b"a", b"0")
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir, batch_seconds=batch)
    rev_a = r.txn([proto.op_put(b"a", b"1"), proto.op_put(b"c", b"1")]).revision
    t_a = int(time.time() * 1000)
    # batched, a revision's time is when its batch arrived (up to batch_seconds + a little after
    # its commit): the target (midway) is well past that
    time.sleep(1.0 + 4 * batch)
    t_b = int(time.time() * 1000)
    r.txn([proto.op_put(b"b", b"2")])
    put(r, b"a", b"3")
    finish(w, live)
    from datetime import datetime, timezone

    mid = datetime.fromtimestamp((t_a + t_b) / 2000.0, tz=timezone.utc)
    res = replay(full, list_segments(segdir), Target.to_time(mid), output=str(tmp_path / "t.db"))
    assert res.complete and res.reached_revision == rev_a
    assert abs((res.reached_time - mid).total_seconds()) <= 0.001
    with restored(res.snapshot_path) as s:
        assert values(dump(s.rpc)) == {b"a": b"1", b"c": b"1", b"seed": b"s"}
    res = replay(full, list_segments(segdir), Target.to_revision(rev_a + 1), output=str(tmp_path / "r.db"))
    assert res.complete and res.reached_revision == rev_a + 1
    with restored(res.snapshot_path) as s:
        assert values(dump(s.rpc)) == {b"a": b"1", b"b": b"2", b"c": b"1", b"seed": b"s"}
        assert values(dump(s.rpc)) == values(dump(r, revision=rev_a + 1))


def test_lease_rule_live(live, tmp_path):
    r = live.rpc
    snap_lease, _ = r.lease_grant(90)
    put(r, b"s1", b"snap", snap_lease)
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir)
    short, _ = r.lease_grant(2)
    long_, _ = r.lease_grant(60)
    r.txn([proto.op_put(b"x1", b"x", short), proto.op_put(b"x2", b"x", short)])
    r.txn([proto.op_put(b"y1", b"y", long_), proto.op_put(b"y2", b"y", long_)])
    rev_before_expiry = r.header().revision
    assert wait_for(lambda: not r.range(b"x1").kvs, 10)
    expiry_rev = r.header().revision
    assert expiry_rev == rev_before_expiry + 1  # both keys of the lease go in one revision
    time.sleep(1.5)  # a segment close refreshes the TTLs
    finish(w, live)
    left_long = r.lease_ttl(long_).ttl
    left_snap = r.lease_ttl(snap_lease).ttl
    res = replay(full, list_segments(segdir), Target.newest(), output=str(tmp_path / "l.db"))
    assert res.complete
    fates = {f.lease_id: f for f in res.leases.fates}
    assert fates[short].alive is False and fates[long_].alive and fates[snap_lease].alive
    with restored(res.snapshot_path) as s:
        got = dump(s.rpc)
        assert b"x1" not in got and b"x2" not in got
        assert got[b"y1"][4] == long_ and got[b"y2"][4] == long_
        granted = s.rpc.lease_ttl(long_).granted_ttl
        assert abs(granted - left_long) <= 2, (granted, left_long)
        moved = got[b"s1"][4]
        assert moved != snap_lease and got[b"s1"][0] == b"snap"
        assert abs(s.rpc.lease_ttl(moved).granted_ttl - left_snap) <= 2
        assert set(s.rpc.lease_list()) == {long_, moved}  # the expired one is not carried over


def _synthetic_chain(segdir, base, t0):
    h = SegmentHeader("12" * 16, 0, base, base + 1, "", t0)
    w = SegmentWriter(segdir, h)
    w.add_txn(Txn(base + 1, t0, (Event(PUT, b"k-exp", b"e", base + 1, base + 1, 1, 0x111),)))
    w.add_txn(Txn(base + 2, t0, (Event(PUT, b"k-live", b"l", base + 2, base + 2, 1, 0x222),)))
    w.add_txn(Txn(base + 3, t0 + 10, (Event(PUT, b"plain", b"p", base + 3, base + 3, 1, 0),)))
    w.add_lease(LeaseRecord(0x111, 10, 3, t0 + 10))
    w.add_lease(LeaseRecord(0x222, 300, 250, t0 + 10))
    return w.close(t0 + 20_000, confirmed=True)


def test_lease_expired_by_target_without_its_deletes(live, tmp_path):
    """The target falls after a lease's TTL ran out but before etcd's revocation reached the
    chain: its key is dropped in a fix-up revision; the live lease gets its remaining TTL."""
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    os.makedirs(segdir)
    t0 = int(time.time() * 1000) - 60_000
    _synthetic_chain(segdir, base, t0)
    res = replay(full, list_segments(segdir), Target.newest(), output=str(tmp_path / "n.db"))
    assert res.reached_revision == base + 3 and len(res.load_revisions) == 1
    assert res.fixup_revisions == (res.load_revisions[0] + 1,)
    assert res.leases.keys_dropped == 1 and res.snapshot_revision == res.fixup_revisions[0]
    with restored(res.snapshot_path) as s:
        got = dump(s.rpc)
        assert set(got) == {b"k-live", b"plain", b"seed"}
        assert s.rpc.lease_ttl(0x222).granted_ttl == 231  # 250 s at t0+10ms, target t0+20 s: 230.01, up
        assert s.rpc.lease_list() == [0x222]
    # one second after t0 both were alive
    from etcd_agent.chain.segments import ms_to_datetime

    res = replay(full, list_segments(segdir), Target.to_time(ms_to_datetime(t0 + 1000)), output=str(tmp_path / "e.db"))
    assert res.fixup_revisions == () and res.reached_revision == base + 3
    with restored(res.snapshot_path) as s:
        assert set(dump(s.rpc)) == {b"k-exp", b"k-live", b"plain", b"seed"}
        assert s.rpc.lease_ttl(0x111).granted_ttl == 5  # 2 s left, raised to the 5 s minimum


@MODES
def test_compaction_while_stopped_breaks_the_chain(live, tmp_path, batch):
    r = live.rpc
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir, batch_seconds=batch)
    for i in range(30):
        put(r, b"k%d" % i, b"v")
    finish(w, live)
    end = check_chain(list_segments(segdir), base).end_revision
    for i in range(10):
        put(r, b"later%d" % i, b"v")
    compacted = r.header().revision
    r.compact(compacted, physical=True)
    w2 = DeltaWatcher(live.endpoint, base, segdir, **dict(FAST, batch_seconds=batch))
    w2.start()
    with pytest.raises(ChainBroken) as ei:
        w2.join(30)
    assert ei.value.at_revision == end + 1 and ei.value.compact_revision == compacted
    assert f"chain broken at rev {end + 1}" in ei.value.message
    assert w2.status().state == "broken"
    # a new chain from a compacted full backup revision breaks at once, too
    w3 = DeltaWatcher(live.endpoint, base, str(tmp_path / "seg3"), **FAST)
    w3.start()
    with pytest.raises(ChainBroken) as ei:
        w3.join(30)
    assert ei.value.at_revision == base + 1


def test_compaction_between_two_batches_breaks_the_chain(live, tmp_path):
    """The batched watch's own risk: history compacted past the next batch's start revision
    while no watch is open. The next batch is canceled by etcd and the chain breaks there, at the
    first revision not captured; nothing after it is ever written as if it followed."""
    r = live.rpc
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir, batch_seconds=3.0, close_seconds=5.0, idle_seconds=10.0,
                heartbeat_seconds=10.0, progress_timeout=3.0)
    put(r, b"first", b"v")
    wait_watcher_caught_up(w, r.header().revision)  # a batch has run and delivered it
    captured = w.captured_revision
    for i in range(10):
        put(r, b"between%d" % i, b"v")
    compacted = r.header().revision
    r.compact(compacted, physical=True)  # before the next batch (3 s after the last one)
    with pytest.raises(ChainBroken) as ei:
        w.join(30)
    assert w.captured_revision == captured, "revisions were written after the compaction broke the chain"
    assert ei.value.at_revision == captured + 1 and ei.value.compact_revision == compacted
    chk = check_chain(list_segments(segdir), base)
    assert chk.stop is None and chk.end_revision == captured  # the chain ends where it broke, whole


def _three_segment_chain(live, tmp_path):
    r = live.rpc
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir, close_seconds=100, close_bytes=8 * 1024)
    # enough history for 3 segments of 8 KiB whatever the machine's speed (a loaded CI run once
    # wrote only 2 in the 2 s alone)
    Writer(r, seed=3).run(2.0, min_ops=800)
    finish(w, live)
    paths = list_segments(segdir)
    infos = check_chain(paths, base).segments
    assert len(infos) >= 3 and all(not i.empty for i in infos[:3])
    return full, base, paths, infos


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_broken_middle_segment_stops_at_the_last_good_point(live, tmp_path, damage):
    full, base, paths, infos = _three_segment_chain(live, tmp_path)
    middle = infos[1].path
    if damage == "corrupt":
        with open(middle, "r+b") as fh:
            fh.seek(os.path.getsize(middle) // 2)
            fh.write(b"\xff\x00\xff")
    else:
        os.unlink(middle)
    res = replay(full, list_segments(os.path.dirname(middle)), Target.newest(), output=str(tmp_path / "b.db"))
    good_end = infos[0].end_revision
    assert not res.complete
    assert res.reached_revision == good_end
    assert res.reached_time is not None and int(res.reached_time.timestamp() * 1000) == infos[0].footer.end_time_ms
    assert res.lost_after.kind == ("corrupt" if damage == "corrupt" else "gap")
    assert res.lost_after.at_revision == good_end + 1
    assert str(good_end) in res.stopped_because
    with restored(res.snapshot_path) as s:
        assert values(dump(s.rpc)) == values(dump(live.rpc, revision=good_end))  # history of the live member


def test_a_segment_changed_while_the_chain_folds_stops_the_replay_and_leaves_nothing_behind(live, tmp_path):
    """The throwaway member starts while the chain is folded: when the fold fails (a segment
    changed since the chain was checked), that member is stopped and its dir removed all the same."""
    import psutil

    from etcd_agent.chain.errors import ReplayError

    full, base, paths, infos = _three_segment_chain(live, tmp_path)
    check = check_chain(paths, base)
    last = infos[-1].path
    with open(last, "r+b") as fh:  # after the check: as if changed during the replay
        fh.seek(os.path.getsize(last) // 2)
        fh.write(b"\xff\x00\xff")
    parent = tmp_path / "work"
    parent.mkdir()
    with pytest.raises(ReplayError, match="changed during the replay"):
        replay(full, paths, Target.newest(), output=str(tmp_path / "out.db"), check=check,
               options=ScratchOptions(parent_dir=str(parent)))
    assert not os.path.exists(tmp_path / "out.db")
    assert os.listdir(parent) == []  # the replay's work dir and the member's, both removed
    mine = [p for p in psutil.Process().children(recursive=True) if str(parent) in " ".join(p.cmdline())]
    assert not mine, [p.cmdline() for p in mine]


@MODES
def test_resume_and_outage(live, tmp_path, batch):
    r = live.rpc
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir, batch_seconds=batch)
    Writer(r, seed=1).run(1.0)
    finish(w, live)
    Writer(r, seed=2).run(0.5)  # while no watcher runs
    w = started(live, base, segdir, batch_seconds=batch)
    Writer(r, seed=4).run(1.0)
    live.restart(down_seconds=1.5)  # the member goes away and comes back
    Writer(r, seed=5).run(1.0)
    time.sleep(3.0)  # short leases run out before the chain ends
    finish(w, live)
    assert w.reconnects >= 1
    chk = check_chain(list_segments(segdir), base)
    assert chk.stop is None and len({i.header.chain_id for i in chk.segments}) == 1
    assert [i.header.seq for i in chk.segments] == list(range(len(chk.segments)))
    assert any(i.footer.catchup_until for i in chk.segments)  # the resumed part was caught up
    res = replay(full, list_segments(segdir), Target.newest(), output=str(tmp_path / "o.db"))
    assert res.complete and res.reached_revision == r.header().revision
    with restored(res.snapshot_path) as s:
        assert values(dump(s.rpc)) == values(dump(r))


def test_member_down_too_long_breaks_the_chain(live, tmp_path):
    full, base = full_backup(live, str(tmp_path))
    w = started(live, base, str(tmp_path / "seg"), max_outage=2.0, rpc_timeout=1.0)
    put(live.rpc, b"a", b"1")
    time.sleep(1.0)
    live.stop_process()
    with pytest.raises(ChainBroken, match="could not be watched") as ei:
        w.join(30)
    assert ei.value.at_revision == base + 2


@MODES
def test_a_member_restored_under_the_watch_breaks_the_chain(live, tmp_path, batch):
    """The member's data replaced by its full backup with the same token (a restore by hand: the
    same cluster id, the revision back at the backup's) while the watcher runs, faster than a
    batch interval. No coverage check is due (60 s), so only the watch itself can see it: the
    chain breaks at the first revision not captured, and what the restored member is written
    afterwards is never appended to it. (A batched watch sees it in the header of its next
    watch's creation; a streaming one in the reconnect after its stream breaks.)"""
    import shutil

    r = live.rpc
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir, batch_seconds=3.0 * bool(batch), close_seconds=60.0, idle_seconds=60.0,
                heartbeat_seconds=60.0, progress_timeout=3.0)
    for i in range(50):
        put(r, b"old%03d" % i, b"v")
    wait_watcher_caught_up(w, r.header().revision)  # batched: the next batch is ~3 s away
    captured = w.captured_revision
    live.stop_process(keep_client=True)
    shutil.rmtree(live.data_dir)
    live.restore(full)  # same name, peer URL and token: the same cluster id, at revision `base`
    live._start_etcd()
    with pytest.raises(ChainBroken, match="behind the chain") as ei:
        w.join(30)
    for i in range(80):  # past the chain's end: what a watch from captured + 1 would deliver
        put(r, b"new%03d" % i, b"v")
    assert ei.value.at_revision == captured + 1 and w.captured_revision == captured
    chk = check_chain(list_segments(segdir), base)
    assert chk.stop is None and chk.end_revision == captured
    written = {e.key for info in chk.segments for t in read_segment(info.path).txns for e in t.events}
    assert written == {b"old%03d" % i for i in range(50)}


def test_another_cluster_breaks_the_chain(live, tmp_path):
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir)
    put(live.rpc, b"a", b"1")
    finish(w, live)
    other = start_scratch(full, ScratchOptions())  # the same data, restored: a new cluster id
    try:
        w2 = DeltaWatcher(other.endpoint, base, segdir, **FAST)
        w2.start()
        with pytest.raises(ChainBroken, match="cluster"):
            w2.join(30)
    finally:
        other.stop()


def test_catch_up_batches_many_revisions(live, tmp_path):
    """History written before the watcher starts comes as one big batched response (etcd 3.5
    sends a new watch's first batch whole even with fragment=true); it is cut into whole
    revisions, one TXN record each."""
    r = live.rpc
    full, base = full_backup(live, str(tmp_path))
    blob = os.urandom(120 * 1024)
    for i in range(25):
        r.txn([proto.op_put(b"big%02d-%d" % (i, j), blob[j:] + b"%d" % i) for j in range(8)])
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir, close_bytes=3 * 1024 * 1024)
    finish(w, live)
    assert w.responses < 10  # 25 revisions arrived in a few responses
    txns = [t for p in list_segments(segdir) for t in read_segment(p).txns]
    assert [len(t.events) for t in txns] == [8] * 25 and all(t.catchup for t in txns)
    res = replay(full, list_segments(segdir), Target.newest(), output=str(tmp_path / "c.db"))
    assert res.complete and res.revisions_applied == 25
    with restored(res.snapshot_path) as s:
        assert_replayed(dump(s.rpc), dump(r), base, r.header().revision)


def test_fragments_of_a_slow_watch_are_reassembled(live, tmp_path):
    """With fragment=True, a watch that fell behind gets multi-revision batches cut into
    ~2 MB fragments (1.5 MiB --max-request-bytes + 512 KiB), which may split a revision; the
    watcher reassembles them, so each revision still lands whole."""
    r = live.rpc
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    stalled = []
    written = threading.Event()

    def stall(info):
        if not stalled:
            stalled.append(info)
            # the reader's queue (1) fills, gRPC flow control holds etcd back, etcd's per-watcher
            # channel (128 responses) overflows: the watcher becomes a "victim", then catches up
            # in batched (and fragmented) responses. Held until all 300 revisions are written.
            written.wait(120)

    w = started(live, base, segdir, fragment=True, queue_size=1, on_segment=stall, close_bytes=1)
    put(r, b"first", b"1")
    assert wait_for(lambda: stalled, 10)
    blob = os.urandom(60 * 1024)
    try:
        for i in range(300):
            r.txn([proto.op_put(b"big%03d-%d" % (i, j), blob[j * 7:] + b"%d" % i) for j in range(4)])
    finally:
        written.set()
    finish(w, live)
    assert w.fragments >= 1
    txns = [t for p in list_segments(segdir) for t in read_segment(p).txns]
    assert [len(t.events) for t in txns[-300:]] == [4] * 300
    res = replay(full, list_segments(segdir), Target.newest(), output=str(tmp_path / "f.db"))
    assert res.complete
    with restored(res.snapshot_path) as s:
        assert_replayed(dump(s.rpc), dump(r), base, r.header().revision)


def test_huge_revision_unfragmented(tmp_path):
    """One revision of 118000 keys (2.0 MB of request, a 2.7 MB watch response: above etcd's
    fragment threshold). Unfragmented (the default) it arrives at once and is one TXN record."""
    from .conftest import HAVE_ETCD

    if not HAVE_ETCD:
        pytest.fail("etcd 3.5.16 not installed (packaging/install-deps.sh test)")
    live = start_scratch(None, ScratchOptions(max_request_bytes=2 * 1024 * 1024, max_txn_ops=200000), name="live")
    try:
        r = live.rpc
        full, base = full_backup(live, str(tmp_path))
        segdir = str(tmp_path / "seg")
        w = started(live, base, segdir)
        rev = r.txn([proto.op_put(b"f%07d" % i, b"x") for i in range(118000)], timeout=60).revision
        put(r, b"after", b"1")
        finish(w, live)
        txns = {t.revision: t for p in list_segments(segdir) for t in read_segment(p).txns}
        assert len(txns[rev].events) == 118000
        res = replay(full, list_segments(segdir), Target.newest(), output=str(tmp_path / "h.db"))
        assert res.complete
        with restored(res.snapshot_path) as s:
            assert_replayed(dump(s.rpc), dump(r), base, r.header().revision)
    finally:
        live.stop()


def test_replay_from_a_backup_archive(live, tmp_path):
    """The full backup may be a backup tarball (here the runbook's: etcdctl snapshot save + tar):
    the one bounded reader stages its snapshot in the replay's private dir; the result
    round-trips through JSON."""
    import subprocess

    from etcd_agent.pitr.replay import ReplayResult

    r = live.rpc
    put(r, b"seed", b"s")
    base = r.header().revision
    snap_dir = tmp_path / "runbook"
    snap_dir.mkdir()
    subprocess.run([live.options.binaries.etcdctl, f"--endpoints={live.endpoint}", "snapshot", "save",
                    str(snap_dir / "etcd_snapshot.db")], check=True, capture_output=True)
    tarball = str(tmp_path / "etcd-2026-01-01.tar")
    subprocess.run(["tar", "cf", tarball, "-C", str(snap_dir), "etcd_snapshot.db"], check=True)

    class written:  # what the test below reads of it
        path = tarball

    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir)
    r.txn([proto.op_put(b"x", b"1"), proto.op_delete(b"seed")])  # the newest revision is a delete too
    finish(w, live)
    res = replay(written.path, list_segments(segdir), Target.newest(), output=str(tmp_path / "a.db"))
    assert res.complete and res.reached_revision == base + 1 and res.snapshot_revision == res.load_revisions[-1]
    assert ReplayResult.from_json(res.to_json(), "kept") == res
    with restored(res.snapshot_path) as s:
        assert values(dump(s.rpc)) == {b"x": b"1"}


def test_a_bare_snapshot_keeps_etcds_own_hash_check(live, tmp_path):
    """A backup read through the backup reader has every byte hashed and etcd's trailer checked on
    the way, so its scratch restore skips etcdutl's second read; a bare db was read by nobody:
    etcdutl still checks it, and a byte flipped in its data is refused before anything starts.
    Where the flipped byte lands depends on the db's page layout: in a page the agent's own bbolt
    reader walks for the revision, that reader refuses it first; else etcdutl's hash check does."""
    from etcd_agent.chain.errors import ReplayError, ScratchError

    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir)
    put(live.rpc, b"after", b"1")
    finish(w, live)
    with open(full, "r+b") as fh:
        fh.seek(os.path.getsize(full) // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x01]))
    out = tmp_path / "pitr.db"
    with pytest.raises((ScratchError, ReplayError), match="restoring .* failed|cannot read the revision of the full backup"):
        replay(full, list_segments(segdir), Target.newest(), output=str(out))
    assert not out.exists()


@MODES
def test_replay_to_three_revisions_equals_the_live_history(live, tmp_path, batch):
    """A writer's puts, deletes, multi-key transactions and leased keys (a long lease, and short
    ones that expire mid-run) on etcd 3.5.16; the whole keyspace read at three revisions N while
    it runs; the replay to each N holds exactly that keyspace: every key and value, every lease
    id, and keys of a lease expired by N's time dropped by the lease rule, nothing else."""
    r = live.rpc
    for i in range(40):
        put(r, b"k%03d" % i, b"before")  # some of these the writer overwrites or deletes
    full, base = full_backup(live, str(tmp_path))
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir, batch_seconds=batch)
    writer = Writer(r, seed=11)
    seen = {}
    for _ in range(3):
        writer.run(1.5, min_ops=writer.ops + 300)
        n = r.header().revision
        seen[n] = dump(r, revision=n)  # what `etcdctl get "" --prefix --rev=N` prints, and more
    writer.run(1.0)
    time.sleep(3.0)  # the last short leases run out: the chain goes on past the last N
    finish(w, live)
    few_responses(w, r.header().revision - base)
    paths = list_segments(segdir)
    for n, want in seen.items():
        res = replay(full, paths, Target.to_revision(n), output=str(tmp_path / f"to-{n}.db"))
        assert res.complete and res.reached_revision == n and res.revisions_applied == n - base
        expired = {f.lease_id for f in res.leases.fates if not f.alive}
        gone = {k for k, v in want.items() if v[4] in expired}
        assert res.leases.keys_dropped == len(gone)
        kept = {k: v for k, v in want.items() if k not in gone}
        with restored(res.snapshot_path) as s:
            got = dump(s.rpc)
            assert_replayed(got, kept, base, n)
            assert {v[4] for v in got.values() if v[4]} <= set(s.rpc.lease_list())
            for lid in {v[4] for v in got.values() if v[4]}:
                assert 5 <= s.rpc.lease_ttl(lid).granted_ttl <= 120
        print(f"\nFIGURE replay to revision {n}: {len(kept)} keys equal to live ({len(gone)} of expired leases "
              f"dropped), {res.events_applied} events folded into {res.keys_loaded} key changes")
    assert writer.ops >= 900
