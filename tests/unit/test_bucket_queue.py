"""The copy queue's pure parts: the layout's names, what is pending and in which order, the
remote retention it follows, the back-off, and the status it reports (no bucket, no disk)."""
from __future__ import annotations

import json
from typing import Dict, List

import pytest

from etcd_agent.bucket import layout, queue
from etcd_agent.bucket.copier import BucketCollector, CopyStatus, metric_values
from etcd_agent.waiting import Backoff

K1 = "a" * 64
K2 = "b" * 64
F1 = "etcd-2026-12-01-10-00-00.tar"
F2 = "etcd-2026-12-02-10-00-00.tar"
CP = "etcd-2026-12-02-11-00-00.tar"


def seg(start: int, end: int) -> str:
    return f"etcd-delta-{start:016d}-{end:016d}-20261202T100000.000Z.seg"


def full(name: str, key: str, size: int = 100) -> queue.LocalFile:
    return queue.LocalFile(layout.FULL, f"/b/{name}", size, 1000.0, key)


def segment(start: int, key: str, size: int = 10) -> queue.LocalFile:
    return queue.LocalFile(layout.SEGMENT, f"/b/{seg(start, start + 4)}", size, 2000.0 + start, key, start)


def checkpoint(key: str) -> queue.LocalFile:
    return queue.LocalFile(layout.CHECKPOINT, f"/b/{CP}", 100, 3000.0, key, 1)


def test_layout_names_and_legacy_places() -> None:
    assert layout.full_name(K1, F1) == f"chains/{K1}/{F1}"
    assert layout.checkpoint_name(K1, CP) == f"chains/{K1}/checkpoints/{CP}"
    assert layout.place(f"chains/{K1}/{F1}") == layout.Placed(layout.FULL, F1, K1)
    assert layout.place(f"chains/{K1}/{seg(3, 7)}") == layout.Placed(layout.SEGMENT, seg(3, 7), K1)
    assert layout.place(f"chains/{K1}/checkpoints/{CP}") == layout.Placed(layout.CHECKPOINT, CP, K1)
    legacy = layout.place(f"delta-{12:016d}/{seg(13, 20)}")
    assert legacy is not None and legacy.legacy and legacy.legacy_revision == 12
    top = layout.place(F1)
    assert top is not None and top.legacy and top.kind == layout.FULL
    for other in (f"chains/{K1}/x.txt", f"chains/{K1[:10]}/{F1}", f"chains/{K1}/checkpoints/{seg(1, 2)}",
                  f"chains/{K1}/../{F1}", "notes/readme", f"chains/{K1}/sub/{F1}"):
        assert layout.place(other) is None, other
    with pytest.raises(ValueError):
        layout.chain_dir("../etc")


def test_an_empty_bucket_gets_each_full_backup_before_its_checkpoints_and_segments_newest_chain_first() -> None:
    files = [segment(9, K2), segment(5, K2), checkpoint(K2), full(F2, K2), segment(2, K1), full(F1, K1)]
    p = queue.plan(files, {}, set(), {F1, F2})
    assert [f.name for f in p.pending] == [
        layout.full_name(K2, F2), layout.checkpoint_name(K2, CP), layout.segment_name(K2, seg(5, 9)),
        layout.segment_name(K2, seg(9, 13)), layout.full_name(K1, F1), layout.segment_name(K1, seg(2, 6)),
    ]
    assert p.pending_bytes == 100 + 100 + 10 + 10 + 100 + 10
    assert p.oldest_since() == 1000.0


def test_what_the_bucket_holds_with_the_same_bytes_is_not_pending_and_a_different_copy_is() -> None:
    files = [full(F1, K1), segment(2, K1), segment(7, K1)]
    listing = {
        layout.full_name(K1, F1): queue.Listed(100),
        layout.segment_name(K1, seg(2, 6)): queue.Listed(10),
        layout.segment_name(K1, seg(7, 11)): queue.Listed(11),  # another size: copied again
    }
    assert [f.file for f in queue.needs_check(files, listing)] == [F1, seg(2, 6)]
    same = {layout.full_name(K1, F1)}  # the segment's sha256 metadata differs
    p = queue.plan(files, listing, same, {F1})
    assert [f.file for f in p.pending] == [seg(2, 6), seg(7, 11)]


def test_segments_of_a_full_backup_only_in_the_bucket_still_go_and_orphans_never() -> None:
    files = [segment(2, K1), segment(5, K2), segment(8, "")]
    listing = {layout.full_name(K1, F1): queue.Listed(100)}  # pruned here, kept there
    p = queue.plan(files, listing, {layout.full_name(K1, F1)}, set())
    assert [f.file for f in p.pending] == [seg(2, 6)]  # K2's full backup is nowhere: restores nothing
    assert p.unplaced == ("/b/" + seg(8, 12),)


def test_a_full_backup_the_remote_retention_would_delete_is_not_copied_nor_its_chain() -> None:
    files = [full(F1, K1), segment(2, K1), full(F2, K2), segment(9, K2)]
    keep = queue.plan_fulls([F1, F2], [], keep_last=1, keep_hourly=0, keep_daily=0)
    assert keep == {F2}
    p = queue.plan(files, {}, set(), keep)
    assert [f.file for f in p.pending] == [F2, seg(9, 13)]
    # the same rule over what is there: a newer copy in the bucket pushes an older local one out
    assert queue.plan_fulls([F1], [F2], keep_last=1, keep_hourly=0, keep_daily=0) == {F2}


def test_a_full_backup_without_a_known_digest_is_reported_not_copied() -> None:
    p = queue.plan([full(F1, "")], {}, set(), {F1})
    assert p.pending == () and p.unplaced == (f"/b/{F1}",) and "digest" in p.why_unplaced[0]


def test_backoff_doubles_to_its_maximum_and_starts_over() -> None:
    b = Backoff(1.0, 8.0)
    assert b.step == 0.0
    assert [b.failed() for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    b.succeeded()
    assert b.step == 0.0 and b.failed() == 1.0


def test_copy_status_round_trips_describes_itself_and_feeds_the_metrics() -> None:
    st = CopyStatus(enabled=True, at=1000.0, pending=3, pending_bytes=300, oldest_pending_since=940.0,
                    failing_since=900.0, last_error="cannot list s3://b/p/: 403: InvalidAccessKeyId",
                    failures_total=4)
    again = CopyStatus.from_json(json.loads(json.dumps(st.to_json())), "test")
    assert again == st
    line = st.describe(1010.0)
    assert "3 object(s) pending" in line and "FAILING since" in line and "InvalidAccessKeyId" in line
    assert "the daemon retries" in line and "10s ago" in line
    v = metric_values(st)
    assert v["pending_objects"] == 3 and v["failing_since_timestamp_seconds"] == 900.0
    fams = {m.name: m for m in BucketCollector(lambda: st).collect()}
    info = fams["etcd_agent_bucket_last_error_info"]
    assert info.samples[0].labels == {"error": st.last_error}
    ok = CopyStatus(enabled=True, at=1000.0, last_copy=990.0)
    assert "nothing pending" in ok.describe(1000.0) and "FAILING" not in ok.describe(1000.0)
    names: List[str] = [m.name for m in BucketCollector(lambda: ok).collect()]
    assert "etcd_agent_bucket_last_error_info" not in names


def test_a_hostile_status_file_is_refused_by_its_types() -> None:
    from etcd_agent.errors import ProtocolError

    bad: Dict[str, object] = {"enabled": True, "pending": "many"}
    with pytest.raises(ProtocolError):
        CopyStatus.from_json(bad, "status")


def test_the_off_host_rpo_in_revisions_counts_the_pending_segments_only() -> None:
    plan = queue.Plan((full(F1, K1), segment(11, K1), segment(16, K1), checkpoint(K1)))
    assert plan.pending_revisions == 10  # two segments of five revisions each; fulls and checkpoints hold none
    st = CopyStatus(enabled=True, at=5000.0, pending=4, pending_revisions=plan.pending_revisions,
                    oldest_pending_since=1000.0)
    assert metric_values(st)["lag_revisions"] == 10.0
    assert "off-host RPO: 10 revision(s) not in the bucket" in st.describe(5000.0)
    assert queue.revisions_of([]) == 0
