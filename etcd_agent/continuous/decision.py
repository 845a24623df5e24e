"""What the delta supervisor does at each tick, decided from what it sees (pure): ``Facts`` in,
(action, why) out (``decide``); and how long it backs off when chains keep breaking (or the
membership keeps changing) soon after the full backups that started them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from etcd_agent.chain.check import BaseBackup
from etcd_agent.continuous.membership import HALF_DONE_WAIT

# a chain that breaks again soon after the full backup that started it: the next full backup
# waits BREAK_BACKOFF[0] s after the previous one, doubling with every repeat up to
# BREAK_BACKOFF[1]; a chain that ran STABLE_AFTER s resets the count
BREAK_BACKOFF = (30.0, 3600.0)
STABLE_AFTER = 600.0


def break_backoff(in_row: int) -> float:
    """Seconds between the previous chain's full backup and the next one, after ``in_row``
    breaks in a row (the first one is answered at once)."""
    if in_row <= 1:
        return 0.0
    return min(BREAK_BACKOFF[0] * float(2 ** (in_row - 2)), BREAK_BACKOFF[1])


@dataclass(frozen=True)
class Full:
    name: str
    path: str
    revision: int
    time: float
    sha256: str = ""  # its snapshot db's ("" unknown)
    size: int = 0  # the backup file's bytes (what a checkpoint's interval is measured against)
    member_ids: Tuple[str, ...] = ()  # hex, as found in its snapshot's db (the catalog's)

    @property
    def base(self) -> BaseBackup:
        """What its chain names: its snapshot's sha256, and its time."""
        return BaseBackup(self.sha256, int(self.time * 1000))


@dataclass(frozen=True)
class Facts:
    """What one tick sees (the input of ``decide``)."""

    enabled: bool
    restore_in_progress: bool
    newest: Optional[Full]
    newest_unusable: str  # why the newest good backup cannot be a base ("" if it can)
    watching_base: Optional[int]  # the running watcher's base, None when none runs
    broken: str  # why the last watch could not go on ("" none), no full backup taken since
    over_bounds: str  # which bound the current chain passed ("" none)
    retry_wait: bool  # a recent attempt failed: wait before the next
    breaks_in_row: int = 0  # chains that broke soon after they started, in a row
    backoff_left: float = 0.0  # seconds until the full backup for the break may be taken
    checkpoint_due: str = ""  # why the running chain wants a checkpoint now ("" it does not)
    membership: str = ""  # how the cluster's members differ from the newest full backup's ("" the same)
    membership_half_done: str = ""  # a member added but not started yet ("" none)
    half_done_for: float = 0.0  # seconds it has been so


def decide(f: Facts) -> Tuple[str, str]:
    """(action, why): none | stop | backup | rebase | start | wait | checkpoint."""
    if not f.enabled:
        return ("stop", "continuous backup is disabled") if f.watching_base is not None else ("none", "disabled")
    if f.restore_in_progress:
        return ("stop", "a restore of this member is in progress: hands off") if f.watching_base is not None else (
            "none", "a restore is in progress")
    if f.retry_wait:
        return "wait", "the last attempt failed; trying again shortly"
    if f.broken and f.backoff_left > 0:
        return "wait", (f"{f.broken} {f.breaks_in_row} times in a row, each soon after its full backup: the next "
                        f"full backup in {f.backoff_left:.0f}s (backing off, not looping)")
    if f.broken:
        return "backup", f"{f.broken}: a full backup now, then a new chain from it"
    if f.newest is None:
        return "backup", "no full backup on this host to continue: taking one"
    if f.newest_unusable:
        return "backup", f"the newest full backup cannot start a chain ({f.newest_unusable}): taking one"
    held = _membership_held(f)
    if f.membership and not held:
        return "backup", f"{f.membership}: a full backup of the new membership, then a new chain from it"
    # a held membership backup does not stop the watch: the running chain goes on meanwhile
    if f.watching_base is None:
        return "start", f"watching from {f.newest.name} (revision {f.newest.revision})"
    if f.watching_base != f.newest.revision:
        return "rebase", f"{f.newest.name} (revision {f.newest.revision}) is newer: a new chain continues it"
    if f.over_bounds:
        return "backup", f"the chain passed {f.over_bounds}: a full backup bounds what a restore replays"
    if f.checkpoint_due:
        return "checkpoint", f"{f.checkpoint_due}: a checkpoint, so that a restore replays only what follows it"
    return "none", f"watching; {held}" if held else "watching"


def _membership_held(f: Facts) -> str:
    """Why the full backup for a membership change is not taken yet ("" it may be)."""
    if not f.membership:
        return ""
    if f.membership_half_done and f.half_done_for < HALF_DONE_WAIT:
        return (f"{f.membership}, half-done ({f.membership_half_done}): its full backup waits until it has started "
                f"(at most {HALF_DONE_WAIT:.0f}s)")
    if f.backoff_left > 0:
        return (f"{f.membership}: {f.breaks_in_row} chains in a row ended soon after their full backups: the next "
                f"full backup in {f.backoff_left:.0f}s (backing off, not looping)")
    return ""
