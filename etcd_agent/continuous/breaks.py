"""A broken chain written down: the break beside the segments, for restores to name
(``status.record_break``; a chain ended on purpose too, uncounted: ``record_end``), and a member's data replaced without a restore of the agent's as a
restore by hand (``backup.boundaries``). A failure to write either is said, never raised: the
supervisor goes on to the full backup that starts the next chain."""
from __future__ import annotations

import logging
import time

from etcd_agent.chain.errors import ChainBroken
from etcd_agent.config import Config
from etcd_agent.continuous import status
from etcd_agent.continuous.watcher import DeltaWatcher
from etcd_agent.errors import AgentError

log = logging.getLogger(__name__)


def record_break(cfg: Config, w: DeltaWatcher, exc: ChainBroken, counted: int) -> int:
    """The break of ``w``'s chain recorded; the host's count of breaks after it (``counted`` + 1
    when the record cannot be written)."""
    rec = status.BreakRecord(w.base_revision, w.pos.chain_id, exc.at_revision, exc.reason, time.time(),
                             exc.compact_revision)
    try:
        return status.record_break(cfg.backup.dir, rec)
    except OSError as err:
        log.warning("could not record the chain break in %s: %s", cfg.backup.dir, err)
        return counted + 1


def record_end(cfg: Config, w: DeltaWatcher, reason: str, counted: int) -> int:
    """``w``'s chain ended on purpose (stopped, its next chain continuing a new full backup, e.g.
    for a membership change): recorded beside the breaks, for a restore to say why the chain ends
    there, but not counted as one (nothing was lost). Returns the host's count of breaks."""
    rec = status.BreakRecord(w.base_revision, w.pos.chain_id, w.pos.next_revision, reason, time.time())
    try:
        return status.record_break(cfg.backup.dir, rec, count=False)
    except OSError as err:
        log.warning("could not record the end of the chain in %s: %s", cfg.backup.dir, err)
        return counted


def record_by_hand(cfg: Config, began: float, exc: ChainBroken) -> None:
    """The member's data was replaced under a chain that began at ``began`` (Unix s). A restore of
    the agent's records itself as it finishes (a record newer than the chain); one it did not
    record (by hand: etcdutl, no journal) is recorded here, so the backups from before it are kept
    and listed as such."""
    from etcd_agent.backup import boundaries

    try:
        if boundaries.recorded_since(cfg.backup.dir, began) is not None:
            return  # the agent's own restore (its record is newer than this chain)
        now = time.time()
        b = boundaries.Boundary(op=f"detected-{int(now * 1000)}", time=now, kind="detected", reason=exc.reason)
        boundaries.record(cfg.backup.dir, b)
        log.warning("delta: the member's data was replaced without a restore of the agent's (%s): recorded as a "
                    "restore by hand; the backups from before it are kept as its rollback points", exc.reason)
    except OSError as err:
        log.warning("could not record the restore by hand in %s: %s", cfg.backup.dir, err)
    except AgentError as err:  # an unreadable record: kept as found (prune holds), said
        log.warning("could not record the restore by hand in %s: %s", cfg.backup.dir, err.message)
