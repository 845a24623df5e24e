"""The delta feature's errors, inside the agent's one hierarchy (exit codes come with the base)."""
from __future__ import annotations

import errno
from typing import Optional, Sequence

from etcd_agent.errors import BackupCorrupt, BackupError, OperationFailed
from etcd_agent.fs import NotARegularFile


class DeltaError(BackupError):
    """Delta segments could not be written or read."""


class SegmentCorrupt(BackupCorrupt):
    """A segment file failed its checks (format, bounds, digest); ``path`` names it."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"segment {path}: {problem}")
        self.path = path
        self.problem = problem


class NotASegment(SegmentCorrupt):
    """The file does not begin as a segment does (its magic): junk under a segment's name, not a
    damaged segment of any chain. A chain passes it over, naming it: a gap or a loss is decided
    by what the segments hold, never by a file's name."""


def unopenable(path: str, exc: OSError, verb: str) -> SegmentCorrupt:
    """What a file under a segment's name that cannot be ``verb``-ed is. One that is no regular
    file (a FIFO, directory, device, a symlink: ``fs.regular_fd`` refuses them) was never written
    as a segment: it is junk under the name (``NotASegment``), passed over and named, never a
    damaged segment that stops its chain and calls everything after it lost. Any other failure
    (permissions, I/O, too large) may be a damaged segment."""
    if isinstance(exc, NotARegularFile) and exc.errno != errno.EFBIG:
        return NotASegment(path, exc.strerror or str(exc))
    return SegmentCorrupt(path, f"cannot {verb}: {exc.strerror or exc}")


class ChainBroken(DeltaError):
    """The watch cannot continue the chain: events from ``at_revision`` on are not captured.

    The caller must take a new full backup and start a new chain from its revision.
    ``compact_revision`` is etcd's compaction point when compaction is the cause.
    """

    def __init__(
        self,
        at_revision: int,
        reason: str,
        *,
        compact_revision: Optional[int] = None,
        details: Optional[Sequence[str]] = None,
        restored: bool = False,
    ) -> None:
        super().__init__(f"chain broken at rev {at_revision} because {reason}", details=details)
        self.at_revision = at_revision
        self.reason = reason
        self.compact_revision = compact_revision
        # the member's data was replaced (another cluster id, or behind the chain): a restore,
        # by the agent or by hand - a boundary in the backups' history (``backup.boundaries``)
        self.restored = restored


class ScratchError(OperationFailed):
    """The throwaway etcd could not be restored, started or stopped; ``details`` has its log tail."""


class ReplayError(OperationFailed):
    """A replay failed for a reason other than a broken chain (which it reports, not raises)."""


class CheckpointUnusable(ReplayError):
    """A checkpoint's snapshot is not what its chain vouches for (or cannot be read): the replay
    starts from an older one, or from the full backup, instead."""


class SegmentForged(SegmentCorrupt):
    """A segment whose signature (manifest key) does not match it, or that is less authenticated
    than the segments before it in its chain: not damage but an edit, and a restore that would
    reach it is refused (``segsign``)."""
