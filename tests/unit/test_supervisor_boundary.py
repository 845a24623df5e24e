"""Which breaks of a chain the daemon records as a restore by hand (``_record_boundary``)."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from etcd_agent.backup import boundaries
from etcd_agent.chain.errors import ChainBroken
from etcd_agent.continuous.decision import Full
from etcd_agent.continuous.supervisor import DeltaSupervisor


def supervisor(full_time: float) -> DeltaSupervisor:
    s = DeltaSupervisor(lambda: (None, None))  # type: ignore[arg-type,return-value]  # never ticked
    s._full = Full("etcd-x.tar", "/nowhere/etcd-x.tar", 100, full_time)
    return s


def watch(seq: int, start: float) -> Any:
    return SimpleNamespace(pos=SimpleNamespace(seq=seq, start_time_ms=int(start * 1000)))


BROKEN = ChainBroken(101, "the member now belongs to cluster 0b, not 0a", restored=True)


def kinds_after(tmp_path: Any, restore_ago: float, full_ago: float, seq: int, watch_ago: float) -> Any:
    """Boundaries after a break, given the agent's restore record and the chain's backup and watch
    (each so many seconds ago)."""
    now, d = time.time(), str(tmp_path)
    boundaries.record(d, boundaries.Boundary(op="r1", time=now - restore_ago, from_backup="etcd-old.tar"))
    cfg = SimpleNamespace(backup=SimpleNamespace(dir=d))
    supervisor(now - full_ago)._record_boundary(cfg, watch(seq, now - watch_ago), BROKEN)  # type: ignore[arg-type]
    return boundaries.read(d)


def test_a_watch_restarted_on_the_old_backup_after_the_agents_restore_records_nothing_more(tmp_path: Any) -> None:
    # the full backup before the restore; the watch (first segment) started on it after the restore
    assert [b.kind for b in kinds_after(tmp_path, restore_ago=20, full_ago=60, seq=0, watch_ago=5)] == ["restore"]


def test_a_replacement_after_the_chains_backup_with_no_record_is_a_restore_by_hand(tmp_path: Any) -> None:
    # the agent's restore is older than the chain's full backup: this break is something else
    got = kinds_after(tmp_path, restore_ago=600, full_ago=60, seq=3, watch_ago=30)
    assert [b.kind for b in got] == ["restore", "detected"] and "cluster 0b" in got[-1].reason


def test_a_break_met_as_the_watch_stops_is_left_for_the_next_watch() -> None:
    """The daemon stops its watch for a restore and the watch's last batch already sees the
    restored member: that break is not settled then (no full backup asked for, no boundary
    recorded before the restore has recorded itself); the next watch resumes the chain after the
    restore and meets it, and only that one is handled (``_on_break``)."""
    calls = []

    def stop(timeout: float) -> None:
        calls.append(timeout)
        raise BROKEN

    s = supervisor(time.time() - 60)
    s.watcher = SimpleNamespace(stop=stop)  # type: ignore[assignment]
    s._stop_watcher("a restore of this member is in progress: hands off")
    assert calls and s.watcher is None
    assert s._broken == "" and s._breaks_total is None and s._breaks_in_row == 0  # nothing asked of the next tick


def test_a_member_found_replaced_while_a_restore_of_it_runs_records_no_boundary(tmp_path: Any) -> None:
    """The watch sees the restored member before the tick that stops it for the restore: the
    break is counted and recorded as a break, but the boundary is left to the restore itself
    (its finish records it); without a restore in progress it is a restore by hand."""
    d = str(tmp_path)
    cfg = SimpleNamespace(backup=SimpleNamespace(dir=d))
    w = SimpleNamespace(pos=SimpleNamespace(seq=2, start_time_ms=int((time.time() - 30) * 1000), chain_id="c" * 32),
                        segments_written=3, base_revision=100)
    s = supervisor(time.time() - 60)
    s._on_break(cfg, w, BROKEN, True)  # type: ignore[arg-type]
    assert boundaries.read(d) == [] and s._broken == "the chain broke"
    s._on_break(cfg, w, BROKEN, False)  # type: ignore[arg-type]
    assert [b.kind for b in boundaries.read(d)] == ["detected"]
