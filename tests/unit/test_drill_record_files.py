"""The drill records on disk and in etcd, typed: files of the previous version are read, a field
of the wrong type is refused (the record ignored) instead of coerced into another meaning."""
from __future__ import annotations

import json
import os
from pathlib import Path

from etcd_agent.backup.checks import stamp_of
from etcd_agent.config import Config, parse_text
from etcd_agent.drill import record as drillrecord
from etcd_agent.drill.record import DrillRecord, HostDrillState, parse_record

OLD = {"backup": "etcd-a.tar", "ok": True, "at": 1000, "duration": 12.5, "host": "m1", "problem": None,
       "revision": 77, "keys": 500, "leases": 2, "sample": 100, "etcd_version": "3.5.16", "digest": "abab",
       "stamp": None}  # as asdict wrote it: every key, nulls included


def _cfg(tmp_path: Path) -> Config:
    cfg, errors = parse_text(f'[[member]]\nname = "m1"\nhost = "127.0.0.1"\n[daemon]\nstate_dir = "{tmp_path}/state"\n')
    assert not errors and cfg is not None
    return cfg


def test_records_of_the_previous_version_are_read(tmp_path: Path) -> None:
    rec = DrillRecord("etcd-a.tar", True, 1000.0, 12.5, "m1", None, 77, 500, 2, 100, "3.5.16", "abab")
    assert parse_record(OLD, "test") == rec
    f = tmp_path / "etcd-a.tar"
    f.write_bytes(b"x")
    (tmp_path / drillrecord.RECORDS).write_text(json.dumps({"etcd-a.tar": {**OLD, "stamp": list(stamp_of(os.stat(f)))}},
                                                           indent=1))
    got = drillrecord.lookup(drillrecord.load_records(str(tmp_path)), "etcd-a.tar", os.stat(f))
    assert got is not None and got.revision == 77
    cfg = _cfg(tmp_path)
    os.makedirs(cfg.daemon.state_dir)
    with open(drillrecord.state_path(cfg), "w") as fh:
        json.dump({"runs": 3, "failures": 1, "last": OLD, "last_success": OLD, "last_failure": None}, fh, indent=1)
    assert drillrecord.load_state(cfg) == HostDrillState(3, 1, rec, rec, None)


def test_a_field_of_the_wrong_type_is_not_coerced(tmp_path: Path) -> None:
    # bool("false") is True: the previous reader took this failed drill for a success
    assert parse_record({**OLD, "ok": "false"}, "test") is None
    assert parse_record({**OLD, "revision": "77"}, "test") is None
    assert parse_record({**OLD, "backup": "x" * 1000}, "test") == DrillRecord(**{**OLD, "at": 1000.0, "backup": "x" * 255})
    cfg = _cfg(tmp_path)
    os.makedirs(cfg.daemon.state_dir)
    with open(drillrecord.state_path(cfg), "w") as fh:
        json.dump({"runs": -5, "failures": 1}, fh)
    assert drillrecord.load_state(cfg) == HostDrillState()
