"""Which full backup ``restore --from latest`` takes for a point-in-time target: the newest one
whose delta chain reaches the target, the chain found by its content (``chains.Scan.for_full``:
the base sha256 its segments name), never the newest file alone.

Two full backups can share a revision (an operator's ``backup`` with no write since the
daemon's; an etcd 3.4 restore keeps the revision): the newer may have no chain while the other's
holds every revision since. Which one reaches further is read from headers and footers here; the
restore then verifies the chosen chain whole (``pitr.prepare``) and the plan names the backups
passed over and why, and which chain it replays and the files at its base it passed over
(``chain_lines``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from etcd_agent.chain.chains import ChainSummary, Scan
from etcd_agent.chain.check import ChainCheck
from etcd_agent.chain.segments import ms_to_datetime
from etcd_agent.pitr.replay import Target

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.backup.catalog import Entry


@dataclass(frozen=True)
class Reach:
    """How far a restore from one full backup can go: its chain's end, else the backup itself."""

    entry: "Entry"
    chain: Optional[ChainSummary]
    revision: int
    time_ms: int
    # a partial chain's first revision a replay can reach (from its oldest checkpoint whose lease
    # census is here); 0: any from the backup's own
    floor: int = 0
    floor_ms: int = 0  # likewise the first time it can reach (``chains.served_floor``); 0: any from the backup's
    why_not: str = ""  # why a chain of it here is not used (a partial chain without the key)

    def describe(self) -> str:
        e = self.entry
        what = f"{e.name} (revision {e.revision}, taken {e.time.isoformat()})"
        if self.why_not:
            return f"{what}: {self.why_not}"
        if self.chain is None:
            return f"{what}, which no delta chain continues"
        if self.floor:
            return (f"{what}, whose partial delta chain {self.chain.chain_id[:8]} here reaches revisions "
                    f"{self.floor}..{self.revision} (from {ms_to_datetime(self.floor_ms).isoformat(timespec='milliseconds')}"
                    f" until {ms_to_datetime(self.time_ms).isoformat(timespec='milliseconds')}; the earlier "
                    "segments not here)")
        return (f"{what}, whose delta chain {self.chain.chain_id[:8]} reaches revision {self.revision} "
                f"(until {ms_to_datetime(self.time_ms).isoformat(timespec='milliseconds')})")


def reach(sc: Scan, e: "Entry", key: bool = False) -> Reach:
    """How far ``e`` reaches: the chain that continues it, or one it was taken inside (a replay
    folds that one from the backup's revision: ``replay.find_base``), or - with the manifest key
    (``key``), which alone proves whose a run without its first segments is - its partial chain
    (a restore from the bucket fetched only the segments after a checkpoint's lease census)."""
    taken = int(e.time.timestamp() * 1000)
    rev = e.revision or 0
    c = sc.for_full(rev, e.base)
    part = None if c is not None else next(
        (x for x in sc.chains if x.begins_at and x.usable and x.base_revision == rev and x.listed_under(e.base)), None)
    if part is not None:
        census = [cp.revision for cp in part.checkpoints if cp.served_from(part.begins_at)]
        if not key:
            return Reach(e, None, rev, taken, why_not=(
                f"its partial delta chain (revisions {part.begins_at}..{part.end_revision}, the earlier segments not "
                "here) is followed only with the manifest key, which this host does not have: pass --key-file FILE"))
        if census:  # else no replay of what is here can start: it reaches nothing past the backup
            return Reach(e, part, max(rev, part.end_revision), max(taken, part.end_time_ms or 0), floor=min(census),
                         floor_ms=part.floor_time_ms)
    if c is None:
        # never a partial chain: a replay from inside it would need the segments not here
        inside = [x for x in sc.chains if x.usable and not x.begins_at and x.base_revision < rev <= x.end_revision]
        c = max(inside, key=lambda x: x.base_revision, default=None)
    if c is None or not c.usable:
        return Reach(e, None, rev, taken)
    return Reach(e, c, max(rev, c.end_revision), max(taken, c.end_time_ms or 0))


def _reaches(r: Reach, target: Target) -> bool:
    if target.kind == "revision" and target.revision is not None:
        return r.floor <= target.revision <= r.revision if r.floor else r.revision >= target.revision
    if target.kind == "time" and target.time_ms is not None:
        # a partial chain reaches no time before its floor, as no revision before it
        return r.floor_ms <= target.time_ms <= r.time_ms if r.floor else r.time_ms >= target.time_ms
    return True


def reaches(sc: Scan, e: "Entry", target: Target, key: bool = False, live: bool = False) -> bool:
    """Would a restore from ``e`` reach ``target``, as far as headers and footers tell (the
    restore verifies): ``e`` at or before it, and its chain reaching it - or, ``live``, its chain
    is the one being written now (it reaches further every second, from its first segment on: a
    target past its end is only not reached yet)."""
    if target.kind == "revision" and (e.revision is None or target.revision is None or target.revision < e.revision):
        return False
    if target.kind == "time" and (target.time_ms is None or e.time.timestamp() * 1000 > target.time_ms):
        return False
    return live or _reaches(reach(sc, e, key), target)


def pick(sc: Scan, candidates: Sequence["Entry"], target: Target, key: bool = False) -> Tuple["Entry", List[str]]:
    """Of ``candidates`` (good full backups at or before the target, newest first, none empty)
    the one to restore from, and the plan's lines saying which and why. ``newest``: the one
    reaching the latest point in time (then the furthest revision, then the newer backup: a
    backup taken inside a chain that reaches as far is the shorter replay); a revision or a
    time: the newest whose chain reaches it, else the newest (the restore then refuses, saying
    where its chain stops). ``key``: the manifest key is here (a partial chain counts)."""
    rs = [reach(sc, e, key) for e in candidates]
    if target.kind == "newest":
        best = max(rs, key=lambda r: (r.time_ms, r.revision, r.entry.time))
        why = "the one whose delta chain reaches the newest point"
    else:
        reaching = [r for r in rs if _reaches(r, target)]
        # none reaching: one whose partial chain is not followed without the key, so that the
        # refusal says why (``prepare``), else the newest
        keyless = [r for r in rs if r.why_not]
        best = reaching[0] if reaching else (keyless or rs)[0]
        why = (f"the newest one whose delta chain reaches {target.describe()}" if reaching else
               f"the newest one at or before {target.describe()}; none reaches it"
               + (" without the manifest key" if keyless else ""))
    lines = [f"--from latest: {best.describe()}: {why}"]
    for r in rs:
        if r is best or r.entry.time < best.entry.time:
            continue
        lines.append(f"--from latest passed over {r.describe()}: newer, but "
                     + ("it does not reach " + target.describe() if not _reaches(r, target) else
                        f"it reaches only revision {r.revision} at "
                        f"{ms_to_datetime(r.time_ms).isoformat(timespec='milliseconds')}"))
    return best.entry, lines


def chain_lines(entry: "Entry", check: ChainCheck) -> List[str]:
    """Which chain the replay takes and why, and each file at its base passed over, and why."""
    lines = []
    if check.segments:
        h = check.segments[0].header
        if check.base_revision != entry.revision:
            lines.append(f"delta chain {h.chain_id[:8]} after revision {check.base_revision}: {entry.name} (revision "
                         f"{entry.revision}) was taken inside it, the replay folds it from there")
        else:
            lines.append(f"delta chain {h.chain_id[:8]} continues {entry.name}: {check.chosen_because}")
    lines += [f"passed over {os.path.basename(p)}: {why}" for p, why in check.passed]
    return lines
