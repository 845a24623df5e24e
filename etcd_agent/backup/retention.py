"""Retention policy: which backups to keep and why. Pure: no I/O, no clock.

Rules, each applied independently (a backup is kept when any rule keeps it):

- the last ``keep_last`` backups;
- the newest backup of each of the ``keep_hourly`` newest hours that hold a backup;
- the newest backup of each of the ``keep_daily`` newest days that hold a backup;
- the newest backup *verified by content* (its bytes checked, see ``checks``), whatever the rules
  above say (a restore must always have one);
- the backups named in ``protect`` (the one just written), whatever the rules say;
- the backups ``holds`` names (a restore's own and the last one before it: ``boundaries``),
  whatever the rules say, each with its reason.

The three counting rules run over the operator's backups (cron, timers, by hand) and over the
daemon's own (full backups it takes to start a delta chain) apart: however many full backups the
daemon takes, they never take a slot of the operator's history.

Quarantined files (corrupt, foreign, dated in the future: ``catalog``) are not given to the policy
at all: they take no slot and are never deleted.

The daemon's checkpoints (full backups it takes inside a delta chain so that a point-in-time
restore replays only the chain after them) take no slot either: ``plan_checkpoints`` keeps the
newest few of each chain that is itself kept, and nothing else of them (the chain's full backup
and its segments still reach every point a checkpoint does).

Buckets count hours/days that actually hold backups (as Borg does), so a cron that stopped for a
week does not make the next prune throw every old backup away.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Collection, Dict, List, Sequence, Tuple


@dataclass(frozen=True)
class BackupRef:
    """What the policy needs to know about one backup."""

    name: str
    time: datetime
    verified: bool
    origin: str = "operator"  # operator | daemon (``manifest.ORIGINS``)
    chain: str = ""  # a checkpoint: the id of the delta chain it was taken inside


@dataclass(frozen=True)
class Decision:
    name: str
    keep: bool
    reasons: Tuple[str, ...]

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def _hour(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:00")


def _day(t: datetime) -> str:
    return t.strftime("%Y-%m-%d")


def plan(
    backups: Sequence[BackupRef], *, keep_last: int, keep_hourly: int, keep_daily: int,
    protect: Sequence[str] = (),
    holds: Sequence[Tuple[str, str]] = (),
) -> List[Decision]:
    """One decision per backup, newest first, each with the reasons behind it. ``holds``:
    (name, reason) pairs kept whatever the rules say."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    ordered = sorted(backups, key=lambda b: (b.time, b.name), reverse=True)
    keep: Dict[str, List[str]] = {b.name: [] for b in ordered}
    drop: Dict[str, List[str]] = {b.name: [] for b in ordered}

    for origin, whose in (("operator", ""), ("daemon", "the daemon's chain backups: ")):
        pool = [b for b in ordered if (b.origin == "daemon") == (origin == "daemon")]
        for i, b in enumerate(pool):
            if i < keep_last:
                keep[b.name].append(f"{whose}one of the last {keep_last} (#{i + 1})")
            else:
                drop[b.name].append(f"{whose}not among the last {keep_last}")
        _buckets(pool, keep_hourly, _hour, "hour", "hourly", keep, drop, whose)
        _buckets(pool, keep_daily, _day, "day", "daily", keep, drop, whose)

    newest_verified = next((b for b in ordered if b.verified), None)
    if newest_verified is not None:
        keep[newest_verified.name].append("newest verified backup (never deleted)")
    for name in protect:
        if name in keep:
            keep[name].append("the backup just written (never deleted)")
    for name, why in holds:
        if name in keep and why not in keep[name]:
            keep[name].append(why)

    out = []
    for b in ordered:
        if keep[b.name]:
            out.append(Decision(b.name, True, tuple(keep[b.name])))
        else:
            out.append(Decision(b.name, False, tuple(drop[b.name]) or ("matched no keep rule",)))
    return out


def plan_checkpoints(
    checkpoints: Sequence[BackupRef], *, live_chains: Collection[str], keep: int,
    protect: Sequence[str] = (), holds: Sequence[Tuple[str, str]] = (),
) -> List[Decision]:
    """One decision per checkpoint (``BackupRef.chain`` set), newest first: the newest ``keep``
    of each chain in ``live_chains`` (the chains retention keeps); a checkpoint of a chain that
    goes restores nothing a point in time needs. ``protect`` and ``holds`` keep one whatever
    (the one just written; a restore's own)."""
    ordered = sorted(checkpoints, key=lambda b: (b.time, b.name), reverse=True)
    seen: Dict[str, int] = {}
    held = dict(holds)
    out = []
    for b in ordered:
        reasons: List[str] = []
        if b.chain in live_chains:
            seen[b.chain] = seen.get(b.chain, 0) + 1
            if seen[b.chain] <= keep:
                reasons.append(f"checkpoint #{seen[b.chain]} of {keep} kept of delta chain {b.chain[:8]}")
            drop = f"an older checkpoint of delta chain {b.chain[:8]} (its newest {keep} are kept)"
        else:
            drop = f"a checkpoint of delta chain {b.chain[:8]}, which is pruned or gone"
        if b.name in protect:
            reasons.append("the backup just written (never deleted)")
        if b.name in held:
            reasons.append(held[b.name])
        out.append(Decision(b.name, True, tuple(reasons)) if reasons else Decision(b.name, False, (drop,)))
    return out


def _buckets(
    ordered: Sequence[BackupRef],
    slots: int,
    key: Callable[[datetime], str],
    unit: str,
    label: str,
    keep: Dict[str, List[str]],
    drop: Dict[str, List[str]],
    whose: str = "",
) -> None:
    """Keep the newest backup of each of the ``slots`` newest buckets that hold one."""
    if slots == 0:  # rule switched off: it neither keeps nor explains anything
        return
    seen: Dict[str, str] = {}
    for b in ordered:  # newest first: the first one met in a bucket is its newest
        k = key(b.time)
        if k in seen:
            drop[b.name].append(f"{whose}{unit} {k} already kept by {seen[k]}")
        elif len(seen) < slots:
            seen[k] = b.name
            keep[b.name].append(f"{whose}newest of {unit} {k} ({label} {len(seen)}/{slots})")
        else:
            drop[b.name].append(f"{whose}{unit} {k} is older than the {slots} {label} buckets kept")
