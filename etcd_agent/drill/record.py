"""What restore drills leave behind: one record per drilled backup, this host's drill state, metrics.

- ``DrillRecord``: one drill's outcome (the backup, when, how long, what it proved or why it
  failed), the one typed value every store below holds.
- Per backup: ``.etcd-agent-drills.json`` in the backup dir (0600) keeps each file's last drill,
  stamped like the check cache (size, mtime, inode, ctime): ``backup list`` shows a drill only
  for the bytes it drilled.
- Per host: ``<state_dir>/drill.json`` (0600) keeps the counters and last times across runs (the
  CLI and the daemon are separate processes), read by the daemon's metrics endpoint.
- ``[drill] metrics_file``: the same values for node_exporter's textfile collector, readable with
  the apiserver and etcd down (temp + fsync + rename, 0644). Metrics hold no secrets.

Alert on ``time() - etcd_agent_restore_drill_last_success_timestamp_seconds`` (the newest over
the masters, one drills at a time) and on ``etcd_agent_restore_drill_last_result == 0``.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional

from etcd_agent import safejson
from etcd_agent.backup.checks import Stamp, check_stamp, clip, parsed, stamp_of
from etcd_agent.errors import ProtocolError
from etcd_agent.fs import dir_locked, makedirs, open_regular, write_atomic
from etcd_agent.typedjson import Document

if TYPE_CHECKING:  # pragma: no cover
    from prometheus_client.metrics_core import Metric

    from etcd_agent.backup.catalog import Entry
    from etcd_agent.config import Config

log = logging.getLogger(__name__)

RECORDS = ".etcd-agent-drills.json"
STATE = "drill.json"
MAX_FILE = 4 << 20
PREFIX = "etcd_agent_restore_drill_"


@dataclass(frozen=True)
class DrillRecord(Document):
    """One drill's outcome."""

    backup: str  # the archive's file name
    ok: bool
    at: float  # unix time the drill started
    duration: float
    host: str = ""
    problem: Optional[str] = None  # why it failed, one sentence
    revision: Optional[int] = None
    keys: Optional[int] = None
    leases: Optional[int] = None
    sample: Optional[int] = None
    etcd_version: Optional[str] = None
    digest: Optional[str] = None  # of the key space, shortened
    stamp: Optional[Stamp] = None  # of the archive when it was drilled

    def __post_init__(self) -> None:
        check_stamp(self.stamp, "DrillRecord")
        clip(self, {"backup": 255, "host": 255, "problem": 2000, "etcd_version": 40, "digest": 64})

    def summary(self) -> str:
        """One line for listings: what the drill showed, or why it failed."""
        from datetime import datetime, timezone

        when = datetime.fromtimestamp(self.at, timezone.utc).isoformat(timespec="seconds")
        if self.ok:
            return (f"drilled {when}: restored and checked in {self.duration:.1f}s (revision {self.revision}, "
                    f"{self.keys} keys, {self.sample} sampled, etcd {self.etcd_version})")
        return f"drill FAILED {when}: {self.problem}"


# ---------------------------------------------------------------- per backup


def _read_json(path: str) -> Any:
    try:
        with open_regular(path) as fh:
            raw = fh.read(MAX_FILE + 1)
    except FileNotFoundError:
        return None
    try:
        return safejson.loads(raw, max_bytes=MAX_FILE)
    except ValueError as exc:
        log.warning("%s is damaged (%s); ignored", path, exc)
        return None


def load_records(directory: str) -> Dict[str, DrillRecord]:
    """Every recorded drill of the backups in ``directory`` (stale ones too: ``lookup`` compares stamps)."""
    obj = _read_json(os.path.join(directory, RECORDS))
    out: Dict[str, DrillRecord] = {}
    if isinstance(obj, dict):
        for name, d in obj.items():
            rec = parse_record(d, f"drill records {directory}: {str(name)[:80]!r}")
            if rec is not None and isinstance(name, str):
                out[name] = rec
    return out


def lookup(records: Dict[str, DrillRecord], name: str, st: os.stat_result) -> Optional[DrillRecord]:
    """The last drill of ``name`` if it drilled exactly these bytes."""
    r = records.get(name)
    return r if r is not None and r.stamp == stamp_of(st) else None


def with_drills(entries: List["Entry"], directory: str) -> List["Entry"]:
    """``entries`` (a listing of ``directory``) each with the last drill of exactly its bytes."""
    records = load_records(directory) if os.path.isdir(directory) else {}
    if not records:
        return entries
    out = []
    for e in entries:
        try:
            st = os.stat(os.path.join(directory, e.name), follow_symlinks=False)
        except OSError:  # pruned while we looked
            out.append(e)
            continue
        out.append(replace(e, drill=lookup(records, e.name, st)))
    return out


def record_backup(directory: str, path: str, rec: DrillRecord, before: os.stat_result) -> None:
    """Keep ``rec`` as the last drill of the backup at ``path`` (in ``directory``), stamped with
    ``before`` - the file as it was when the drill read it; nothing is kept when it has changed
    since. Read-modify-write under the dir's lock; entries of vanished files are dropped. Never raises."""
    name = os.path.basename(path)
    try:
        if stamp_of(os.stat(path, follow_symlinks=False)) != stamp_of(before):
            log.warning("%s changed while it was drilled: the drill is not recorded against it", path)
            return
        with dir_locked(directory):
            recs = load_records(directory)
            recs[name] = replace(rec, stamp=stamp_of(before))
            present = set(os.listdir(directory))
            data = {n: r.to_json() for n, r in sorted(recs.items()) if n in present}
            write_atomic(os.path.join(directory, RECORDS), (json.dumps(data, indent=1) + "\n").encode(), mode=0o600)
    except OSError as exc:
        log.warning("cannot record the drill of %s (%s)", name, exc)


# ---------------------------------------------------------------- this host


@dataclass(frozen=True)
class HostDrillState(Document):
    """This host's drills over time: what the metrics show."""

    RANGES = {"runs": (0, 2 ** 63 - 1), "failures": (0, 2 ** 63 - 1)}

    runs: int = 0
    failures: int = 0
    last: Optional[DrillRecord] = None  # the last attempt, whatever its result
    last_success: Optional[DrillRecord] = None
    last_failure: Optional[DrillRecord] = None

    def after(self, rec: DrillRecord) -> "HostDrillState":
        return HostDrillState(
            runs=self.runs + 1,
            failures=self.failures + (0 if rec.ok else 1),
            last=rec,
            last_success=rec if rec.ok else self.last_success,
            last_failure=self.last_failure if rec.ok else rec,
        )



def parse_record(d: object, where: str) -> Optional[DrillRecord]:
    """None for anything that is not a record (a damaged file is ignored, not trusted)."""
    return parsed(DrillRecord, d, where)


def state_path(cfg: "Config") -> str:
    return os.path.join(cfg.daemon.state_dir, STATE)


def load_state(cfg: "Config") -> HostDrillState:
    """This host's state; a fresh one when there is none or it is damaged (logged)."""
    doc = _read_json(state_path(cfg))
    if doc is None:
        return HostDrillState()
    try:
        return HostDrillState.from_json(doc, f"drill state {state_path(cfg)}")
    except ProtocolError as exc:
        log.warning("%s; counting from zero", exc.message)
        return HostDrillState()


def record_host(cfg: "Config", rec: DrillRecord) -> HostDrillState:
    """Count ``rec`` in this host's state and rewrite the textfile; never raises (a metrics
    problem must not turn a drill's result into another one)."""
    state = load_state(cfg).after(rec)
    try:
        makedirs(cfg.daemon.state_dir, 0o700)
        write_atomic(state_path(cfg), (json.dumps(state.to_json(), indent=1) + "\n").encode(), mode=0o600)
    except OSError as exc:
        log.warning("cannot keep the drill state in %s: %s", state_path(cfg), exc)
    write_textfile(cfg, state)
    return state


# ---------------------------------------------------------------- metrics

GAUGES: Dict[str, str] = {
    "last_success_timestamp_seconds": "Unix time the last successful restore drill started.",
    "last_success_duration_seconds": "Duration of the last successful restore drill.",
    "last_failure_timestamp_seconds": "Unix time the last failed restore drill started.",
    "last_attempt_timestamp_seconds": "Unix time the last restore drill started, whatever its result.",
    "last_duration_seconds": "Duration of the last restore drill, whatever its result.",
    "last_result": "1 if the last restore drill proved its backup, 0 if it failed.",
}
COUNTERS: Dict[str, str] = {
    "runs": "Restore drills run on this host.",
    "failures": "Restore drills that failed on this host.",
}
INFO = ("backup_info", "The backup the last successful restore drill proved (value 1).")


def values(state: HostDrillState) -> Dict[str, float]:
    out: Dict[str, float] = {"runs": float(state.runs), "failures": float(state.failures)}
    if state.last_success is not None:
        out["last_success_timestamp_seconds"] = state.last_success.at
        out["last_success_duration_seconds"] = state.last_success.duration
    if state.last_failure is not None:
        out["last_failure_timestamp_seconds"] = state.last_failure.at
    if state.last is not None:
        out["last_attempt_timestamp_seconds"] = state.last.at
        out["last_duration_seconds"] = state.last.duration
        out["last_result"] = 1.0 if state.last.ok else 0.0
    return out


@dataclass(eq=False)  # the registry keys collectors by identity
class DrillCollector:
    """A prometheus_client collector of one ``HostDrillState`` (replaceable: the daemon swaps in
    the state it read last)."""

    state: HostDrillState = field(default_factory=HostDrillState)

    def collect(self) -> "Iterable[Metric]":
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        v = values(self.state)
        for name, text in GAUGES.items():
            if name in v:
                yield GaugeMetricFamily(PREFIX + name, text, value=v[name])
        for name, text in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, text, value=v[name])
        ok = self.state.last_success
        if ok is not None:
            info = InfoMetricFamily(PREFIX + INFO[0][: -len("_info")], INFO[1])
            info.add_metric([], {"backup": ok.backup, "revision": str(ok.revision), "host": ok.host,
                                 "etcd_version": ok.etcd_version or ""})
            yield info


def write_textfile(cfg: "Config", state: HostDrillState) -> None:
    target = cfg.drill.metrics_file
    if target is None:
        return
    try:
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        registry.register(DrillCollector(state))
        write_atomic(target, generate_latest(registry), mode=0o644)
    except Exception as exc:  # noqa: BLE001 - by contract nothing escapes
        log.warning("could not write drill metrics to %s: %s", target, exc)
