"""Restore drills, the pure parts: what is kept per backup and per host, the metrics, the schedule."""
from __future__ import annotations

import json
import os
import stat
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from etcd_agent.config import Config, parse_text
from etcd_agent.drill import record as drillrecord
from etcd_agent.drill.record import DrillRecord, HostDrillState, parse_record
from etcd_agent.drill.schedule import CLOCK_MARGIN, decide

DAY = 86400.0


def _cfg(tmp_path: Path, metrics: bool = True) -> Config:
    text = (f'[[member]]\nname = "m1"\nhost = "127.0.0.1"\n[daemon]\nstate_dir = "{tmp_path}/state"\n'
            f'[drill]\nevery = 86400\n' + (f'metrics_file = "{tmp_path}/prom/etcd_agent_drill.prom"\n' if metrics else ""))
    cfg, errors = parse_text(text)
    assert not errors and cfg is not None
    return cfg


def ok(at: float, backup: str = "etcd-a.tar", duration: float = 12.5) -> DrillRecord:
    return DrillRecord(backup=backup, ok=True, at=at, duration=duration, host="m1", revision=77, keys=500, leases=2,
                       sample=100, etcd_version="3.5.16", digest="ab" * 8)


def failed(at: float, problem: str = "the archive is bad: etcd_snapshot.db: sha256 mismatch") -> DrillRecord:
    return DrillRecord(backup="etcd-b.tar", ok=False, at=at, duration=0.4, host="m2", problem=problem)


def samples(path: Path) -> List[Tuple[str, Dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(path.read_text()) for s in f.samples]


def test_record_round_trips_and_damage_is_ignored() -> None:
    r = ok(1000.0)
    assert DrillRecord.from_json(json.loads(json.dumps(r.to_json())), "test") == r
    for bad in (None, [], {"backup": "x"}, {"backup": "x", "ok": True, "at": "soon", "duration": 1},
                {"backup": "x", "ok": True, "at": 1, "duration": 1, "stamp": [1, 2]}):
        assert parse_record(bad, "test") is None
    assert "restored and checked in 12.5s (revision 77, 500 keys, 100 sampled" in r.summary()
    assert failed(0.0).summary().startswith("drill FAILED 1970-01-01T00:00:00+00:00: the archive is bad")


def test_per_backup_records_follow_the_bytes(tmp_path: Path) -> None:
    d = tmp_path / "backups"
    d.mkdir()
    a, b = d / "etcd-a.tar", d / "etcd-b.tar"
    a.write_bytes(b"a" * 100)
    b.write_bytes(b"b" * 100)
    before_a = os.stat(a)
    drillrecord.record_backup(str(d), str(a), ok(1000.0), before_a)
    drillrecord.record_backup(str(d), str(b), failed(2000.0), os.stat(b))
    recs = drillrecord.load_records(str(d))
    assert drillrecord.lookup(recs, "etcd-a.tar", os.stat(a)).ok
    assert drillrecord.lookup(recs, "etcd-b.tar", os.stat(b)).problem.endswith("sha256 mismatch")
    assert stat.S_IMODE(os.stat(d / drillrecord.RECORDS).st_mode) == 0o600
    # changed since the drill: its record no longer speaks for it
    a.write_bytes(b"A" * 100)
    assert drillrecord.lookup(drillrecord.load_records(str(d)), "etcd-a.tar", os.stat(a)) is None
    # changed while the drill read it: nothing recorded against it
    drillrecord.record_backup(str(d), str(a), ok(3000.0), before_a)
    assert drillrecord.load_records(str(d))["etcd-a.tar"].at == 1000.0
    # a vanished file's record is dropped at the next write
    os.unlink(b)
    drillrecord.record_backup(str(d), str(a), ok(4000.0), os.stat(a))
    assert set(drillrecord.load_records(str(d))) == {"etcd-a.tar"}
    # a damaged file is ignored, never trusted
    (d / drillrecord.RECORDS).write_text('{"etcd-a.tar": [[[[')
    assert drillrecord.load_records(str(d)) == {}


def test_host_state_counts_and_the_textfile_moves(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    prom = tmp_path / "prom" / "etcd_agent_drill.prom"
    prom.parent.mkdir()
    drillrecord.record_host(cfg, ok(1000.0))
    m = {(n, tuple(sorted(lb.items()))): v for n, lb, v in samples(prom)}
    p = "etcd_agent_restore_drill_"
    assert m[(p + "last_success_timestamp_seconds", ())] == 1000.0
    assert m[(p + "last_success_duration_seconds", ())] == 12.5
    assert m[(p + "last_result", ())] == 1.0
    assert m[(p + "runs_total", ())] == 1 and m[(p + "failures_total", ())] == 0
    assert (p + "last_failure_timestamp_seconds", ()) not in m
    info = [(lb, v) for n, lb, v in samples(prom) if n == p + "backup_info"]
    assert info == [({"backup": "etcd-a.tar", "revision": "77", "host": "m1", "etcd_version": "3.5.16"}, 1.0)]
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644

    # a failed drill: the alert's metrics move, what the last success proved stays
    drillrecord.record_host(cfg, failed(2000.0))
    m = {n: v for n, lb, v in samples(prom)}
    assert m[p + "last_result"] == 0.0 and m[p + "last_failure_timestamp_seconds"] == 2000.0
    assert m[p + "failures_total"] == 1 and m[p + "runs_total"] == 2
    assert m[p + "last_success_timestamp_seconds"] == 1000.0
    assert m[p + "last_attempt_timestamp_seconds"] == 2000.0 and m[p + "last_duration_seconds"] == 0.4
    assert drillrecord.load_state(cfg).last_failure.host == "m2"
    assert sorted(os.listdir(prom.parent)) == ["etcd_agent_drill.prom"]  # no temp file left for node_exporter


def test_metrics_problems_never_escape(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(tmp_path)  # the textfile's dir does not exist
    state = drillrecord.record_host(cfg, ok(1000.0))
    assert state.runs == 1 and "could not write drill metrics" in caplog.text
    (tmp_path / "state" / drillrecord.STATE).write_text("[1, 2")
    assert drillrecord.load_state(cfg) == HostDrillState()


# ---------------------------------------------------------------- the schedule


class FakeWallClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.t, timezone.utc)

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def test_schedule_is_a_function_of_the_last_drill_and_every() -> None:
    clock = FakeWallClock(1_000_000.0)
    assert not decide(None, 0, clock.t).due  # off
    assert "every = 0" in decide(ok(0.0), 0, clock.t).reason
    first = decide(None, DAY, clock.t)
    assert first.due and first.reason == "no drill of this cluster is recorded"
    last = ok(clock.t)
    for step, due in ((3600, False), (DAY - 3601, False), (1, True)):
        clock.sleep(step)
        s = decide(last, DAY, clock.t)
        assert s.due is due, (clock.t - last.at, s)
        if not due:
            assert s.next_at == last.at + DAY
    assert "passed) started 24.0h ago; one is due every 24.0h" in decide(last, DAY, clock.t).reason
    # a failed drill counts as the period's drill (the failure metric asks a person to look)
    assert not decide(failed(clock.t - 60), DAY, clock.t).due
    assert "FAILED" in decide(failed(clock.t - 60), DAY, clock.t).reason


def test_a_record_from_a_clock_far_ahead_is_not_trusted() -> None:
    now = 1_000_000.0
    assert not decide(ok(now + CLOCK_MARGIN - 1), DAY, now).due  # small skew: a recent drill
    s = decide(ok(now + 3 * 3600), DAY, now)
    assert s.due and "in the future" in s.reason


# ---------------------------------------------------------------- the drill's dir


def test_drill_dir_is_made_0711_and_a_dir_others_can_write_is_refused(tmp_path: Path) -> None:
    from etcd_agent.drill.host import prepare_dir, sweep
    from etcd_agent.errors import RefusedError

    d = tmp_path / "a" / "drill"
    prepare_dir(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o711 and stat.S_IMODE(os.stat(d.parent).st_mode) == 0o711
    prepare_dir(str(d))  # again: fine, untouched
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(RefusedError, match="writable by nobody else"):
        prepare_dir(str(open_dir))
    assert stat.S_IMODE(os.stat(open_dir).st_mode) == 0o777  # never chmodded
    (tmp_path / "file").write_text("x")
    with pytest.raises(RefusedError, match="not a directory"):
        prepare_dir(str(tmp_path / "file"))
    # what a dead drill left is swept; anything else is the operator's and stays
    for name in (".stage-abc", "etcd-scratch-xyz", "notes.txt", ".drill.lock"):
        (d / name).mkdir() if not name.endswith((".txt", ".lock")) else (d / name).write_text("")
    (d / "etcd-scratch-link").symlink_to(tmp_path)
    assert sweep(str(d)) == [".stage-abc", "etcd-scratch-xyz"]
    assert sorted(os.listdir(d)) == [".drill.lock", "etcd-scratch-link", "notes.txt"]
    assert os.path.isdir(tmp_path / "open")  # the symlink was not followed
