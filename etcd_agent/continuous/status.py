"""The continuous backup's state as the daemon reports it: a typed status, Prometheus metrics from
it (the daemon's endpoint) and the same metrics in a node_exporter textfile (readable with the
apiserver down, and with the daemon's own endpoint unscraped), plus the record of chain breaks
kept beside the segments.

RPO (worst-case data loss now): the time since which a change may not be on disk in a closed
segment. While the open segment holds no events that is the confirmed coverage (every revision
committed before it is captured, checked against the member every few seconds); otherwise the
end of the newest closed segment. With no chain it is the age of the newest full backup. Alert on
``etcd_agent_delta_rpo_seconds`` (or ``time() - etcd_agent_delta_safe_until_timestamp_seconds``,
which keeps growing when the daemon itself is gone).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Annotated, Callable, Dict, Iterable, List, Optional, Tuple

from etcd_agent.errors import ProtocolError
from etcd_agent.fs import open_regular, write_atomic
from etcd_agent.safejson import load as load_json
from etcd_agent.typedjson import Document, Items, JsonObject, Text

if TYPE_CHECKING:  # pragma: no cover
    from prometheus_client.metrics_core import Metric

    from etcd_agent.bucket.copier import CopyStatus
    from etcd_agent.config import Config

log = logging.getLogger(__name__)

PREFIX = "etcd_agent_delta_"
BREAKS_FILE = ".etcd-agent-delta-breaks.json"
MAX_BREAKS = 100
MAX_TEXT = 16 * 1024  # a reason, a detail, a path: sentences, never more
DEFAULT_TEXTFILE = "etcd_agent_delta.prom"


@dataclass(frozen=True)
class DeltaStatus(Document):
    enabled: bool
    state: Annotated[str, Text(32)]  # disabled | no-backup | starting | watching | reconnecting | standby | paused | broken | stopped
    detail: Annotated[str, Text(MAX_TEXT)] = ""
    full_backup: Annotated[Optional[str], Text(MAX_TEXT)] = None  # the full backup the chain continues
    full_backup_time: Optional[float] = None  # Unix s
    base_revision: Optional[int] = None
    captured_revision: Optional[int] = None  # in a segment, closed or open
    durable_revision: Optional[int] = None  # in a closed segment
    durable_time: Optional[float] = None
    newest_event_time: Optional[float] = None
    covered_time: Optional[float] = None
    member_revision: Optional[int] = None
    chain_events: int = 0
    chain_bytes: int = 0
    chain_segments: int = 0
    breaks_total: int = 0
    full_backups: Dict[str, int] = field(default_factory=dict)  # taken by the daemon, by reason
    uploads_pending: int = 0
    upload_failures: int = 0
    uploads: Dict[str, int] = field(default_factory=dict)  # segments copied, by the check that verified them
    at: float = 0.0  # when this status was made (Unix s)
    breaks_in_row: int = 0  # chains that broke soon after their full backup, in a row
    backoff_seconds: float = 0.0  # until the next full backup for a break may be taken (0: none pending)

    def safe_until(self) -> Optional[float]:
        """Every change committed before this time is in a closed segment (or the full backup)."""
        if self.durable_revision is not None and self.captured_revision is not None:
            if self.captured_revision <= self.durable_revision:
                cands = [t for t in (self.covered_time, self.durable_time) if t]
            else:
                cands = [t for t in (self.durable_time,) if t]
            if cands:
                return max(cands)
        return self.full_backup_time

    def rpo_seconds(self, now: Optional[float] = None) -> Optional[float]:
        t = self.safe_until()
        if t is None:
            return None
        return max(0.0, (self.at if now is None else now) - t)

    def lag_revisions(self) -> Optional[int]:
        if self.member_revision is None or self.durable_revision is None or not self.member_revision:
            return None
        return max(0, self.member_revision - self.durable_revision)

    def to_json(self) -> JsonObject:
        d = asdict(self)  # every field, null ones too: what ``status --json`` has always shown
        d["rpo_seconds"] = self.rpo_seconds()
        d["lag_revisions"] = self.lag_revisions()
        return d


# ---------------------------------------------------------------- metrics


GAUGES = {
    "enabled": "1 if continuous backup ([backup.delta]) is enabled.",
    "watching": "1 while the delta watch is connected and capturing.",
    "newest_event_timestamp_seconds": "Unix time the newest captured revision was received.",
    "newest_event_revision": "The newest revision captured into a delta segment.",
    "durable_revision": "The newest revision in a closed (fsynced, visible) segment.",
    "member_revision": "The member's revision at the watcher's last check.",
    "lag_revisions": "Revisions the member has that no closed segment holds yet.",
    "safe_until_timestamp_seconds": "Every change committed before this Unix time is in a closed segment.",
    "rpo_seconds": "Worst-case data loss now: seconds of changes not yet in a closed segment (or since the "
                   "newest full backup when there is no chain).",
    "chain_base_revision": "Revision of the full backup the current chain continues.",
    "chain_events": "Events in the current chain (what a restore to its end replays).",
    "chain_bytes": "Bytes of the current chain's segments.",
    "chain_segments": "Segments in the current chain.",
    "upload_pending": "Files (full backups, checkpoints, segments) waiting for their off-host copy (see "
                      "etcd_agent_bucket_*).",
    "breaks_in_row": "Chains that broke again soon after the full backup that started them, in a row.",
    "break_backoff_seconds": "Seconds until the daemon takes the full backup for a repeated break (0: not backing "
                             "off).",
    "status_timestamp_seconds": "Unix time this status was computed.",
}
COUNTERS = {
    "chain_breaks": "Chains that could not continue (compaction, outage, restored member), over the backup dir's life.",
    "full_backups": "Full backups the daemon took, by reason: to start a new chain (after a break, past a bound, for "
                    "a membership change), or as a checkpoint inside one.",
    "upload_failures": "Off-host copy passes that failed (retried; see etcd_agent_bucket_*).",
    "uploads": "Objects copied off-host, by the check that verified the copy: checksum (SHA-256 checked by the "
               "store), etag (Content-MD5 checked by the store, and the MD5 ETag) or read-back.",
}


def metric_values(s: DeltaStatus) -> Dict[str, Optional[float]]:
    def f(v: Optional[float]) -> Optional[float]:
        return None if v is None else float(v)

    return {
        "enabled": float(s.enabled),
        "watching": float(s.state == "watching"),
        "newest_event_timestamp_seconds": f(s.newest_event_time),
        "newest_event_revision": f(s.captured_revision),
        "durable_revision": f(s.durable_revision),
        "member_revision": f(s.member_revision),
        "lag_revisions": f(s.lag_revisions()),
        "safe_until_timestamp_seconds": f(s.safe_until()),
        "rpo_seconds": f(s.rpo_seconds()),
        "chain_base_revision": f(s.base_revision),
        "chain_events": float(s.chain_events),
        "chain_bytes": float(s.chain_bytes),
        "chain_segments": float(s.chain_segments),
        "upload_pending": float(s.uploads_pending),
        "breaks_in_row": float(s.breaks_in_row),
        "break_backoff_seconds": float(s.backoff_seconds),
        "status_timestamp_seconds": s.at,
    }


class DeltaCollector:
    """A prometheus_client collector: the metrics of ``status_fn()`` at each scrape."""

    def __init__(self, status_fn: Callable[[], DeltaStatus]) -> None:
        self.status_fn = status_fn

    def collect(self) -> "Iterable[Metric]":
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.status_fn()
        for name, value in metric_values(s).items():
            if value is not None:
                yield GaugeMetricFamily(PREFIX + name, GAUGES[name], value=value)
        yield CounterMetricFamily(PREFIX + "chain_breaks", COUNTERS["chain_breaks"], value=s.breaks_total)
        fb = CounterMetricFamily(PREFIX + "full_backups", COUNTERS["full_backups"], labels=["reason"])
        for reason in sorted(set(s.full_backups) | {"chain_broken", "chain_bounds", "no_full_backup", "stale_full_backup",
                                                    "membership_changed", "checkpoint"}):
            fb.add_metric([reason], s.full_backups.get(reason, 0))
        yield fb
        yield CounterMetricFamily(PREFIX + "upload_failures", COUNTERS["upload_failures"], value=s.upload_failures)
        up = CounterMetricFamily(PREFIX + "uploads", COUNTERS["uploads"], labels=["check"])
        for check in sorted(set(s.uploads) | {"checksum", "etag", "read-back"}):
            up.add_metric([check], s.uploads.get(check, 0))
        yield up


def textfile_path(cfg: "Config") -> Optional[str]:
    d = cfg.backup.delta
    if d.metrics_file:
        return d.metrics_file
    if cfg.backup.metrics_file:
        return os.path.join(os.path.dirname(cfg.backup.metrics_file), DEFAULT_TEXTFILE)
    return None


def write_textfile(path: str, status: DeltaStatus, copies: "Optional[CopyStatus]" = None) -> None:
    """The metrics as a node_exporter textfile (0644, atomic), with the copy queue's when it runs;
    never raises."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest

        reg = CollectorRegistry()
        reg.register(DeltaCollector(lambda: status))
        if copies is not None:
            from etcd_agent.bucket.copier import BucketCollector

            reg.register(BucketCollector(lambda: copies))
        write_atomic(path, generate_latest(reg), mode=0o644)
    except Exception as exc:  # noqa: BLE001 - metrics must never stop the watch
        log.warning("could not write delta metrics to %s: %s", path, exc)


# ---------------------------------------------------------------- the break record


@dataclass(frozen=True)
class BreakRecord(Document):
    """A chain that could not continue, kept so a restore can say where and why it stops."""


    base_revision: int
    chain_id: Annotated[str, Text(64, r"[0-9a-f]*")]
    at_revision: int  # the first revision the chain does not hold
    reason: Annotated[str, Text(MAX_TEXT)]
    time: float  # Unix s
    compact_revision: Optional[int] = None

    def to_json(self) -> JsonObject:
        return asdict(self)


@dataclass(frozen=True)
class _Breaks(Document):
    """The break record's file: how many breaks ever, and the newest MAX_BREAKS."""

    total: int = 0
    breaks: Annotated[Tuple[BreakRecord, ...], Items(0, MAX_BREAKS)] = ()


def read_breaks(directory: str) -> Tuple[int, List[BreakRecord]]:
    """(breaks ever recorded, the newest MAX_BREAKS of them)."""
    path = os.path.join(directory, BREAKS_FILE)
    try:
        with open_regular(path) as fh:
            doc = _Breaks.from_json(load_json(fh, max_bytes=1 << 20), path)
        return doc.total, list(doc.breaks)
    except FileNotFoundError:
        return 0, []
    except (OSError, ValueError, ProtocolError) as exc:
        log.warning("ignoring unreadable %s: %s", BREAKS_FILE, exc)
        return 0, []


def record_break(directory: str, rec: BreakRecord, *, count: bool = True) -> int:
    """Append ``rec``; returns the total count (``count=False``: a chain ended on purpose, kept
    for restores to name but not a break: the total stays)."""
    total, breaks = read_breaks(directory)
    breaks = (breaks + [rec])[-MAX_BREAKS:]
    total += 1 if count else 0
    doc = {"total": total, "breaks": [b.to_json() for b in breaks]}
    write_atomic(os.path.join(directory, BREAKS_FILE), (json.dumps(doc, indent=1) + "\n").encode(), mode=0o600)
    return total


def now() -> float:
    return time.time()
