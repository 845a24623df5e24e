"""What the restore plan says about a point-in-time restore: the full backup or checkpoint it
starts from, the segments it folds, what it reached and what is lost after it, the leases."""
from __future__ import annotations

import os
from typing import List, Optional

from etcd_agent.chain.check import ChainStop
from etcd_agent.pitr.prepare import Prepared, b_reason, when_text
from etcd_agent.pitr.replay import ReplayResult


def _start(p: Prepared, started_from: str, started_revision: int) -> List[str]:
    """The plan's first lines on a point in time: what it starts from, the segments, the target."""
    rev = started_revision or p.entry.revision or 0
    segs = [s for s in p.plan.segments if s.end_revision > rev] or list(p.plan.segments)
    used = (f"{len(segs)} delta segment(s) {os.path.basename(segs[0].disk_path)} .. {os.path.basename(segs[-1].disk_path)}"
            if segs else "no delta segment")
    full = f"full backup {p.entry.name} (revision {p.entry.revision}, {p.entry.time.isoformat()})"
    if started_from:
        full = (f"checkpoint {started_from} (revision {started_revision}, taken inside the chain of {full} "
                "and vouched for by it: its snapshot's sha256 and revision checked)")
    lines = [f"point in time: {full} + {used}; target {p.target.describe()}"]
    if p.passed_over:
        lines.append(f"point in time: newer checkpoint(s) passed over: {'; '.join(p.passed_over)}")
    return lines + [f"point in time: {x}" for x in p.choice]


def describe_tail(p: Prepared, restored: int) -> List[str]:
    """What the plan says about a point in time whose tail is loaded into the restored members."""
    lines = _start(p, p.start.name if p.start is not None else "", restored)
    plan = p.plan
    when = when_text(plan.stop_time_ms) if plan.stop_time_ms is not None else "the chain's end"
    events = f"~{p.start.events_after} event(s)" if p.start is not None else "every event"
    lines.append(f"point in time: every member restores this snapshot, and the chain after revision {restored} "
                 f"({events}) is folded while the hosts get ready and written into the restored members once they "
                 "serve, before the apiservers start (no throwaway member; nothing else must write to etcd "
                 f"meanwhile): reached revision {plan.stop_revision} at {when}; {plan.because}")
    lines.append(f"point in time: {_lost(p, plan.complete, plan.lost, plan.stop_revision)}")
    return lines


def describe(p: Optional[Prepared], res: ReplayResult, *, reused: bool = False) -> List[str]:
    """What the plan says about the point in time: full backup, segments, reached, lost after, leases."""
    lines: List[str] = _start(p, res.started_from, res.started_revision) if p is not None else []
    when = res.reached_time.isoformat(timespec="milliseconds") if res.reached_time else "the chain's end"
    lines.append(f"point in time: replayed {res.revisions_applied} revision(s), {res.events_applied} event(s) in "
                 f"{res.replay_seconds:.1f}s{' (reused from an interrupted run)' if reused else ''}: reached revision "
                 f"{res.reached_revision} at {when}; {res.stopped_because}")
    if res.load_revisions:
        lines.append(f"point in time: the {res.keys_loaded} key(s) they left changed were written in "
                     f"{len(res.load_revisions)} transaction(s) at new revisions {res.load_revisions[0]}.."
                     f"{res.load_revisions[-1]}, above any the cluster reached (every key and value as at the "
                     "target; keys the chain wrote have new mod revisions)")
    lines.append(f"point in time: {lost_after(p, res)}")
    lo = res.leases
    lines.append(f"point in time: leases as at the target: {lo.alive} alive with the TTL they had left (at least "
                 f"5 s), {lo.expired} expired by then ({lo.keys_dropped} key(s) not restored), {lo.keys_reattached} "
                 f"key(s) moved to a lease with their remaining TTL"
                 + (f" (fix-up revision {', '.join(map(str, res.fixup_revisions))})" if res.fixup_revisions else ""))
    return lines


def lost_after(p: Optional[Prepared], res: ReplayResult) -> str:
    return _lost(p, res.complete, res.lost_after, res.reached_revision)


def _lost(p: Optional[Prepared], complete: bool, lost: Optional[ChainStop], reached: int) -> str:
    if not complete and lost is not None:
        s = lost
        return (f"NOT COMPLETE - the chain stops at revision {s.at_revision} ({s.kind}: {s.reason}); everything from "
                f"there on is lost to this restore (the last good point, revision {s.last_good_revision}, is what "
                "is restored)")
    if p is None:
        return "what comes after the reached point is not restored"
    c = p.check
    if c.end_revision > reached:
        return (f"lost after it: revisions {reached + 1}..{c.end_revision} that the chain holds (until "
                f"{when_text(c.end_time_ms)}) are not restored, nor anything later")
    brk = next((b for b in reversed(p.breaks)), None)
    tail = f"; the daemon recorded a break there: {b_reason(brk)}" if brk is not None else ""
    return (f"lost after it: only what was never captured - changes after {when_text(c.end_time_ms)}, the end of the "
            f"newest closed segment{tail}")
