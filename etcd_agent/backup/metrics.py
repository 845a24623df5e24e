"""Backup freshness metrics for node_exporter's textfile collector.

Each ``etcd-agent backup`` run rewrites ``backup.metrics_file`` (``None`` = no metrics; the usual
place is ``/var/lib/node_exporter/textfile_collector/etcd_agent_backup.prom``). Runs are separate
processes, so what must survive a run (the failure counters, the last success times) is read back
from the previous file. Alert on ``time() - etcd_agent_backup_last_success_timestamp_seconds``.

The exposition text comes from prometheus_client; the file is written with temp + fsync + rename
and mode 0644 (``write_to_textfile`` leaves the mode to the umask, and a cron or systemd
``UMask=0077`` would hide the file from node_exporter). Metrics hold no secrets.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Dict, Iterable, Optional

from etcd_agent.config import Config

if TYPE_CHECKING:  # pragma: no cover - prometheus_client is imported when a file is written
    from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

PREFIX = "etcd_agent_backup_"
# name (without prefix) -> help; gauges keep their last value when a run does not update them
GAUGES: Dict[str, str] = {
    "last_success_timestamp_seconds": "Unix time of the last successful backup.",
    "last_attempt_timestamp_seconds": "Unix time of the last backup attempt, successful or not.",
    "last_duration_seconds": "Duration of the last backup attempt.",
    "last_size_bytes": "Size of the last successful backup archive.",
    "last_revision": "etcd revision captured by the last successful backup.",
    "last_success": "1 if the last backup attempt succeeded, else 0.",
    "remote_last_success_timestamp_seconds": "Unix time of the last verified off-host copy.",
    "prune_held": "1 if the restore record is unreadable, so prune deletes nothing (see `etcd-agent status`).",
}
COUNTERS: Dict[str, str] = {
    "failures": "Backup attempts that failed, over the life of the metrics file.",
    "remote_failures": "Off-host copies that failed to upload or verify.",
}


def record_backup(
    cfg: Config,
    success: bool,
    path: Optional[str],
    size: int,
    duration: float,
    revision: Optional[int],
    remote_ok: Optional[bool] = None,
    *,
    now: Optional[float] = None,
) -> None:
    """Record one backup attempt; never raises (a metrics problem must not fail a good backup).

    ``remote_ok`` is None when no off-host copy was attempted; call this after the upload so the
    remote timestamp and failure counter are in the same file write.
    """
    target = cfg.backup.metrics_file
    if target is None:
        return
    try:
        values = _previous(target)
        t = time.time() if now is None else now
        values["last_attempt_timestamp_seconds"] = t
        values["last_duration_seconds"] = float(duration)
        values["last_success"] = 1.0 if success else 0.0
        values.setdefault("failures", 0.0)
        values.setdefault("remote_failures", 0.0)
        if success:
            values["last_success_timestamp_seconds"] = t
            values["last_size_bytes"] = float(size)
            if revision is not None:
                values["last_revision"] = float(revision)
        else:
            values["failures"] += 1
        values["prune_held"] = 1.0 if _prune_held(cfg) else 0.0
        if remote_ok is True:
            values["remote_last_success_timestamp_seconds"] = t
        elif remote_ok is False:
            values["remote_failures"] += 1
        _write(target, values)
        log.debug("backup metrics written to %s (%s)", target, path or "no archive")
    except Exception as exc:  # noqa: BLE001 - by contract nothing escapes
        log.warning("could not write backup metrics to %s: %s", target, exc)


def _prune_held(cfg: Config) -> bool:
    from etcd_agent.backup.boundaries import load

    return load(cfg.backup.dir).problem is not None


def read_metrics(path: str) -> Dict[str, float]:
    """The values in a metrics file written by ``record_backup`` (names without prefix/_total)."""
    from prometheus_client.parser import text_string_to_metric_families

    from etcd_agent.fs import open_regular

    with open_regular(path, follow_symlinks=True, limit=1 << 20) as fh:  # a FIFO there must not hang a backup
        text = fh.read(1 << 20).decode("utf-8")
    out: Dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if not name.startswith(PREFIX):
                continue
            short = name[len(PREFIX):]
            if short.endswith("_total"):
                short = short[: -len("_total")]
            if short in GAUGES or short in COUNTERS:
                out[short] = float(sample.value)
    return out


def _previous(path: str) -> Dict[str, float]:
    """Values from the last run's file; a missing or unreadable one starts afresh (with a warning)."""
    try:
        return read_metrics(path)
    except FileNotFoundError:
        return {}
    except Exception as exc:  # noqa: BLE001 - a damaged file must not stop the next write
        log.warning("ignoring unreadable metrics file %s (%s): counters restart at 0", path, exc)
        return {}


def _write(path: str, values: Dict[str, float]) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from etcd_agent.fs import write_atomic

    registry = CollectorRegistry()
    registry.register(_Snapshot(values))
    write_atomic(path, generate_latest(registry), mode=0o644)


class _Snapshot:
    """A collector exposing fixed values: gauges, and counters without ``_created`` samples."""

    def __init__(self, values: Dict[str, float]) -> None:
        self.values = dict(values)

    def collect(self) -> "Iterable[Metric]":
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, text in GAUGES.items():
            if name in self.values:
                yield GaugeMetricFamily(PREFIX + name, text, value=self.values[name])
        for name, text in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, text, value=self.values.get(name, 0.0))
