"""How far a chain's copies in the bucket reach, read from their names (``bucket.layout.reach``):
what ``backup list --remote`` says a point-in-time restore from the bucket gets to."""
from __future__ import annotations

from etcd_agent.bucket import layout
from etcd_agent.chain.segments import segment_name

KEY = "ab" * 32
T = 1_796_600_000_000


def seg(start: int, end: int, *, sealed: bool = False) -> str:
    return f"chains/{KEY}/" + segment_name(start, end, T + end, sealed=sealed)


def test_contiguous_segments_reach_their_last_revision() -> None:
    names = [seg(101, 150), seg(151, 151), seg(152, 400), f"chains/{KEY}/checkpoints/etcd-2026-12-07-07-00-00.tar"]
    got = layout.reach(reversed(names), 100)
    assert (got.segments, got.checkpoints, got.revision, got.gap_after) == (3, 1, 400, None)
    assert "reaches revision 400" in got.describe()


def test_a_missing_segment_stops_the_reach_before_it_and_is_named() -> None:
    got = layout.reach([seg(101, 150), seg(160, 170)], 100)
    assert (got.revision, got.gap_after) == (150, 150)
    assert "missing after revision 150" in got.describe()


def test_segments_that_do_not_start_right_after_the_backup_reach_nothing() -> None:
    got = layout.reach([seg(205, 300)], 100)
    assert (got.revision, got.gap_after) == (None, 100)
    assert "reaches no revision past the full backup" in got.describe()


def test_names_that_are_not_this_layouts_are_ignored() -> None:
    names = [seg(101, 110), f"chains/{KEY}/../x", "notes.txt", f"chains/{KEY}/checkpoints/etcd-delta-1-2-x.seg"]
    got = layout.reach(names, 100)
    assert (got.segments, got.checkpoints, got.revision) == (1, 0, 110)


def test_an_unknown_base_takes_the_first_segment_as_the_start_and_legacy_names_count() -> None:
    legacy = [f"delta-{100:016d}/" + segment_name(101, 120, T), f"delta-{100:016d}/" + segment_name(121, 130, T)]
    assert layout.reach(legacy, None).revision == 130
    assert layout.reach([], None).revision is None
