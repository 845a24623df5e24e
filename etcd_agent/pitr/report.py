"""What the restore plan says about a point-in-time restore: the full backup or checkpoint it
starts from, the segments it folds, what it reached and what is lost after it, the leases."""
from __future__ import annotations

import os
from typing import List, Optional

from etcd_agent.pitr.prepare import Prepared, b_reason, when_text
from etcd_agent.pitr.replay import ReplayResult


def describe(p: Optional[Prepared], res: ReplayResult, *, reused: bool = False) -> List[str]:
    """What the plan says about the point in time: full backup, segments, reached, lost after, leases."""
    lines: List[str] = []
    if p is not None:
        rev = res.started_revision or p.entry.revision or 0
        segs = [s for s in p.plan.segments if s.end_revision > rev] or list(p.plan.segments)
        used = (f"{len(segs)} delta segment(s) {os.path.basename(segs[0].disk_path)} .. {os.path.basename(segs[-1].disk_path)}"
                if segs else "no delta segment")
        full = f"full backup {p.entry.name} (revision {p.entry.revision}, {p.entry.time.isoformat()})"
        if res.started_from:
            full = (f"checkpoint {res.started_from} (revision {res.started_revision}, taken inside the chain of {full} "
                    "and vouched for by it: its snapshot's sha256 and revision checked)")
        lines.append(f"point in time: {full} + {used}; target {p.target.describe()}")
        if p.passed_over:
            lines.append(f"point in time: newer checkpoint(s) passed over: {'; '.join(p.passed_over)}")
        lines += [f"point in time: {x}" for x in p.choice]
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
    if not res.complete and res.lost_after is not None:
        s = res.lost_after
        return (f"NOT COMPLETE - the chain stops at revision {s.at_revision} ({s.kind}: {s.reason}); everything from "
                f"there on is lost to this restore (the last good point, revision {s.last_good_revision}, is what "
                "is restored)")
    if p is None:
        return "what comes after the reached point is not restored"
    c = p.check
    if c.end_revision > res.reached_revision:
        return (f"lost after it: revisions {res.reached_revision + 1}..{c.end_revision} that the chain holds (until "
                f"{when_text(c.end_time_ms)}) are not restored, nor anything later")
    brk = next((b for b in reversed(p.breaks)), None)
    tail = f"; the daemon recorded a break there: {b_reason(brk)}" if brk is not None else ""
    return (f"lost after it: only what was never captured - changes after {when_text(c.end_time_ms)}, the end of the "
            f"newest closed segment{tail}")
