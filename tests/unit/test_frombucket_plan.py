"""The pure choices of `restore --from-bucket`: which of a chain's checkpoints is worth fetching
(each is a full backup's size; only the newest at or before the target is)."""
from __future__ import annotations

from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any, List

from etcd_agent.bucket import layout
from etcd_agent.bucket.fetch import Wanted
from etcd_agent.pitr.replay import Target
from etcd_agent.restore.orchestrator.frombucket import _checkpoint

CFG: Any = SimpleNamespace(backup=SimpleNamespace(utc=True))


def _cps(*stamps: str) -> List[Wanted]:
    return [Wanted(f"chains/k/checkpoints/etcd-{s}.tar", f"etcd-{s}.tar", layout.CHECKPOINT, 1 << 30) for s in stamps]


def test_the_newest_checkpoint_at_or_before_the_target_only() -> None:
    cps = _cps("2026-03-01-10-05-00", "2026-03-01-10-15-00", "2026-03-01-10-10-00")
    assert _checkpoint(CFG, cps, Target.newest()) == cps[1]
    at = Target.to_time(datetime(2026, 3, 1, 10, 12, tzinfo=timezone.utc))
    assert _checkpoint(CFG, cps, at) == cps[2]
    exactly = Target.to_time(datetime(2026, 3, 1, 10, 5, tzinfo=timezone.utc))
    assert _checkpoint(CFG, cps, exactly) == cps[0]
    before_all = Target.to_time(datetime(2026, 3, 1, 10, 0, tzinfo=timezone.utc))
    assert _checkpoint(CFG, cps, before_all) is None  # the replay starts from the full backup
    assert _checkpoint(CFG, [], Target.newest()) is None
