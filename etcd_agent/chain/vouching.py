"""What a watch keeps for the daemon's checkpoints (``segments.Checkpoint``): the lease censuses
the supervisor asks for, and the checkpoints handed over that wait for a segment to vouch for
them. Pure bookkeeping, no I/O: the watcher (``watcher.DeltaWatcher``) holds one, under its lock,
and runs the censuses on its own thread."""
from __future__ import annotations

import threading
from typing import List, Optional, Tuple

from etcd_agent.chain.segments import MAX_CHECKPOINTS, Checkpoint


class Census:
    """One lease census asked of the watch: done, and the chain's last revision when it ran
    (None: it did not run, or a lease could not be asked)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.revision: Optional[int] = None

    def finish(self, revision: Optional[int]) -> None:
        self.revision = revision
        self.done.set()


class Vouching:
    """Checkpoints waiting for a footer, and when the member was last found the chain's own.

    A checkpoint is ready once the member was found the chain's own (same cluster, not behind
    it) in an answer to a request sent after the checkpoint was handed over, and the segment
    being closed reaches its revision: the chain had written that far and seen the same member
    after the backup."""

    def __init__(self) -> None:
        self._pending: List[Tuple[Checkpoint, float]] = []  # (checkpoint, monotonic hand-over)
        self._censuses: List[Census] = []
        # monotonic: the newest request whose answer found the member the chain's own
        self.verified_at = 0.0

    def hand_over(self, checkpoint: Checkpoint, now: float) -> None:
        self._pending.append((checkpoint, now))

    def verified(self, asked: float) -> None:
        """An answer to a request sent at ``asked`` found the member the chain's own."""
        self.verified_at = max(self.verified_at, asked)

    def ready(self, last_revision: int) -> List[Checkpoint]:
        """The checkpoints a segment ending at ``last_revision`` vouches for (taken off the list)."""
        out = [cp for cp, handed in self._pending
               if handed < self.verified_at and cp.revision <= last_revision][:MAX_CHECKPOINTS]
        if out:
            self._pending = [(cp, t) for cp, t in self._pending if cp not in out]
        return out

    @property
    def pending(self) -> int:
        return len(self._pending)

    def ask(self, census: Census) -> None:
        self._censuses.append(census)

    def forget(self, census: Census) -> None:
        if census in self._censuses:
            self._censuses.remove(census)

    def take_censuses(self) -> List[Census]:
        out, self._censuses = self._censuses, []
        return out

    def cancel_censuses(self) -> None:
        """The watch ends: the censuses it never ran answer None (the supervisor takes no
        checkpoint). Checkpoints still pending after its last segment are never vouched for."""
        for c in self.take_censuses():
            c.finish(None)
