"""The delta supervisor's status as the metrics, the textfile and ``status`` show it: what the
running watch reports or, with no watch here, the chain on disk; the host's count of breaks; the
copy queue's progress. Reads only."""
from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from etcd_agent.chain import chains
from etcd_agent.config import Config
from etcd_agent.continuous import status
from etcd_agent.continuous.decision import Full
from etcd_agent.continuous.position import WatcherStatus

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.bucket.copier import CopyStatus


def base_status(cfg: Config, *, state: str, detail: str, base: Optional[Full], breaks_seen: int,
                full_backups: Dict[str, int], breaks_in_row: int, backoff: float) -> status.DeltaStatus:
    """What the supervisor itself knows: its state, the full backup the chain continues, the
    breaks and full backups it counted."""
    # the host's count, from the record beside the segments: on a one-host cluster the daemon
    # writing the chain (and the textfile) now may not be the one whose watch broke
    recorded = status.read_breaks(cfg.backup.dir)[0] if os.path.isdir(cfg.backup.dir) else 0
    return status.DeltaStatus(
        enabled=cfg.backup.delta.enabled, state=state, detail=detail,
        full_backup=base.name if base else None, full_backup_time=base.time if base else None,
        base_revision=base.revision if base else None, breaks_total=max(breaks_seen, recorded),
        full_backups=full_backups, at=time.time(), breaks_in_row=breaks_in_row, backoff_seconds=backoff,
    )


def _seconds(ms: int) -> Optional[float]:
    return ms / 1000.0 if ms else None


def with_watch(st: status.DeltaStatus, ws: WatcherStatus, totals: Tuple[int, int, int]) -> status.DeltaStatus:
    """``st`` with the running watch's positions and the chain's totals (events, bytes, segments)."""
    events, size, segs = totals
    return replace(st, captured_revision=ws.captured_revision, durable_revision=ws.durable_revision,
                   durable_time=_seconds(ws.durable_time_ms), newest_event_time=_seconds(ws.newest_event_ms),
                   covered_time=_seconds(ws.covered_ms), member_revision=ws.member_revision or None,
                   chain_events=events, chain_bytes=size, chain_segments=segs)


def with_chain_on_disk(st: status.DeltaStatus, cfg: Config, newest: Optional[Full]) -> status.DeltaStatus:
    """No watch here (stopped, broken, or another daemon of this host writes the chain on a
    one-host cluster): ``st`` with what is on disk, so the RPO grows from the chain's real end."""
    if not os.path.isdir(cfg.backup.dir):
        return st
    active = chains.active_base(cfg.backup.dir)
    wanted = active if active is not None else (newest.revision if newest else None)
    if wanted is None:
        return st
    of = newest.base if newest is not None and newest.revision == wanted else None
    c = chains.scan(cfg.backup.dir).for_full(wanted, of)
    if c is None or not c.usable:
        return st
    return replace(st, base_revision=c.base_revision, captured_revision=c.end_revision,
                   durable_revision=c.end_revision, durable_time=(c.end_time_ms or 0) / 1000.0 or None,
                   chain_events=c.events, chain_bytes=c.bytes, chain_segments=c.usable)


def with_copies(st: status.DeltaStatus, copies: Optional[CopyStatus]) -> status.DeltaStatus:
    """``st`` with the copy queue's progress (unchanged while [backup.remote] is disabled)."""
    if copies is None:
        return st
    return replace(st, uploads_pending=copies.pending, upload_failures=copies.failures_total,
                   uploads=dict(copies.verified))


def another_writes(cfg: Config, watching: bool) -> bool:
    """Another daemon of this host writes the chain, and the textfile (one-host clusters): one
    not ``watching`` leaves the file to it. A standby daemon trying its watch again (every
    ``RETRY_AFTER``) wrote a status of a watch that never ran: an RPO of the time since the full
    backup, every ~10 s."""
    return not watching and os.path.isdir(cfg.backup.dir) and chains.active_base(cfg.backup.dir) is not None
