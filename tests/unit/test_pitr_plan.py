"""Where a replay stops (pure: synthetic segments on disk, no etcd)."""
import os
from datetime import datetime, timezone

import pytest

from etcd_agent.chain.check import check_chain
from etcd_agent.chain.errors import ReplayError
from etcd_agent.chain.segments import list_segments, ms_to_datetime
from etcd_agent.pitr.replay import Target, plan_replay

from .test_chain_segments import T0, write_chain


def chain(tmp_path):
    # revisions 101..104 at T0+10..40 (ends T0+140), an idle segment (to T0+240), then
    # 105..107 at T0+250..270 (ends T0+370)
    write_chain(str(tmp_path), 100, [4, 0, 3])
    return check_chain(list_segments(str(tmp_path)), 100)


def test_parse_targets():
    assert Target.parse("newest") == Target.newest()
    assert Target.parse("1234") == Target.to_revision(1234)
    t = Target.parse("2026-12-01T09:15:00Z")
    assert t.kind == "time" and ms_to_datetime(t.time_ms) == datetime(2026, 12, 1, 9, 15, tzinfo=timezone.utc)
    with pytest.raises(ReplayError, match="time zone"):
        Target.parse("2026-12-01T09:15:00")
    with pytest.raises(ReplayError):
        Target.parse("yesterday")
    assert Target.from_json(t.to_json(), "target") == t


def test_newest_and_revision(tmp_path):
    chk = chain(tmp_path)
    p = plan_replay(chk, Target.newest())
    assert (p.stop_revision, p.stop_time_ms, p.complete) == (107, T0 + 370, True)
    p = plan_replay(chk, Target.to_revision(103))
    assert (p.stop_revision, p.stop_time_ms, len(p.segments)) == (103, T0 + 30, 1)
    p = plan_replay(chk, Target.to_revision(200))
    assert p.stop_revision == 107 and not p.complete and "before the target revision 200" in p.because
    with pytest.raises(ReplayError, match="before the full backup"):
        plan_replay(chk, Target.to_revision(99))


def test_time_targets(tmp_path):
    chk = chain(tmp_path)
    at = lambda ms: Target.to_time(ms_to_datetime(ms))  # noqa: E731
    assert plan_replay(chk, at(T0 + 25)).stop_revision == 102  # between two revisions
    assert plan_replay(chk, at(T0 + 200)).stop_revision == 104  # in the idle segment
    assert plan_replay(chk, at(T0 + 255)).stop_revision == 105  # inside the last segment
    assert plan_replay(chk, at(T0 + 300)).stop_revision == 107  # after its events, before its end
    p = plan_replay(chk, at(T0 + 5))
    assert p.stop_revision == 100 and p.complete  # nothing yet: the full backup itself
    p = plan_replay(chk, at(T0 + 10_000))
    assert p.stop_revision == 107 and not p.complete and "before the target time" in p.because
    with pytest.raises(ReplayError, match="before the chain starts"):
        plan_replay(chk, at(T0 - 1))


def test_a_broken_chain_stops_at_its_good_prefix(tmp_path):
    infos = write_chain(str(tmp_path), 100, [4, 3, 2])
    os.unlink(infos[1].path)
    chk = check_chain(list_segments(str(tmp_path)), 100)
    p = plan_replay(chk, Target.newest())
    assert p.stop_revision == 104 and not p.complete and p.lost.kind == "gap"
    assert "revision 104" in p.because
