"""Backup metrics: the textfile parses back, counters survive runs, failures never escape."""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Dict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from etcd_agent.backup.metrics import record_backup
from etcd_agent.config import Config, parse_text

BASE = """
[[member]]
name = "m1"
host = "127.0.0.1"
"""


def _cfg(metrics_file: str) -> Config:
    cfg, errors = parse_text(BASE + f'[backup]\nmetrics_file = "{metrics_file}"\n')
    assert not errors and cfg is not None
    return cfg


def _parse(path: Path) -> Dict[str, float]:
    """Every sample in the file, by full sample name, via prometheus_client's own parser."""
    out: Dict[str, float] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            assert not s.labels, s
            out[s.name] = s.value
    return out


def test_success_then_failures_accumulate(tmp_path: Path) -> None:
    prom = tmp_path / "etcd_agent_backup.prom"
    cfg = _cfg(str(prom))
    record_backup(cfg, True, "/x/etcd-2026-01-01-00-00-00.tar", 12345, 2.5, 77, remote_ok=True, now=1000.0)
    m = _parse(prom)
    assert m["etcd_agent_backup_last_success_timestamp_seconds"] == 1000.0
    assert m["etcd_agent_backup_last_attempt_timestamp_seconds"] == 1000.0
    assert m["etcd_agent_backup_last_duration_seconds"] == 2.5
    assert m["etcd_agent_backup_last_size_bytes"] == 12345
    assert m["etcd_agent_backup_last_revision"] == 77
    assert m["etcd_agent_backup_remote_last_success_timestamp_seconds"] == 1000.0
    assert m["etcd_agent_backup_failures_total"] == 0
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644
    # counters carry no _created sample: it would reset on every run
    assert not any(k.endswith("_created") for k in m)

    # two failed runs (a separate process each time: only the file carries state)
    record_backup(cfg, False, None, 0, 0.7, 0, now=2000.0)
    record_backup(cfg, False, None, 0, 0.9, 0, remote_ok=False, now=3000.0)
    m = _parse(prom)
    assert m["etcd_agent_backup_failures_total"] == 2
    assert m["etcd_agent_backup_remote_failures_total"] == 1
    assert m["etcd_agent_backup_last_attempt_timestamp_seconds"] == 3000.0
    assert m["etcd_agent_backup_last_duration_seconds"] == 0.9
    # what the last success said is kept
    assert m["etcd_agent_backup_last_success_timestamp_seconds"] == 1000.0
    assert m["etcd_agent_backup_last_size_bytes"] == 12345
    assert m["etcd_agent_backup_last_revision"] == 77
    assert m["etcd_agent_backup_remote_last_success_timestamp_seconds"] == 1000.0
    assert m["etcd_agent_backup_last_success"] == 0

    record_backup(cfg, True, "/x/b.tar", 222, 1.0, 99, now=4000.0)
    m = _parse(prom)
    assert m["etcd_agent_backup_failures_total"] == 2
    assert m["etcd_agent_backup_last_success_timestamp_seconds"] == 4000.0
    assert m["etcd_agent_backup_last_revision"] == 99
    assert m["etcd_agent_backup_last_success"] == 1
    # no temp files left beside it (node_exporter reads every *.prom in the dir)
    assert sorted(os.listdir(tmp_path)) == ["etcd_agent_backup.prom"]


def test_first_run_failure_has_no_success_timestamp(tmp_path: Path) -> None:
    prom = tmp_path / "m.prom"
    record_backup(_cfg(str(prom)), False, None, 0, 0.1, 0, now=5.0)
    m = _parse(prom)
    assert m["etcd_agent_backup_failures_total"] == 1
    assert "etcd_agent_backup_last_success_timestamp_seconds" not in m


def test_success_without_revision_still_written(tmp_path: Path) -> None:
    prom = tmp_path / "m.prom"
    record_backup(_cfg(str(prom)), True, "/x/a.tar", 10, 0.1, None, now=5.0)
    m = _parse(prom)
    assert m["etcd_agent_backup_last_size_bytes"] == 10
    assert "etcd_agent_backup_last_revision" not in m


def test_disabled_writes_nothing(tmp_path: Path) -> None:
    cfg, errors = parse_text(BASE)
    assert not errors and cfg is not None and cfg.backup.metrics_file is None
    record_backup(cfg, True, None, 1, 1.0, 1)
    assert os.listdir(tmp_path) == []


def test_write_failure_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(str(tmp_path / "missing-dir" / "m.prom"))
    with caplog.at_level(logging.WARNING, logger="etcd_agent.backup.metrics"):
        record_backup(cfg, True, None, 1, 1.0, 1)
    assert "could not write backup metrics" in caplog.text


def test_damaged_previous_file_restarts_counters(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    prom = tmp_path / "m.prom"
    prom.write_text("this is { not exposition\n")
    with caplog.at_level(logging.WARNING, logger="etcd_agent.backup.metrics"):
        record_backup(_cfg(str(prom)), False, None, 0, 0.1, 0, now=5.0)
    assert "ignoring unreadable metrics file" in caplog.text
    assert _parse(prom)["etcd_agent_backup_failures_total"] == 1


def test_metrics_file_must_be_absolute() -> None:
    cfg, errors = parse_text(BASE + '[backup]\nmetrics_file = "relative.prom"\n')
    assert any("backup.metrics_file" in e for e in errors)
