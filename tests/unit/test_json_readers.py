"""Every JSON the agent reads from a file or the wire goes through ``safejson``: hostile files in its
state, backup and run dirs (deep nesting, numbers no writer of ours makes) meet each reader's own
answer to a damaged file, never a RecursionError out of ``json.loads`` that escapes it."""
from __future__ import annotations

import ast
import fcntl
import os
from typing import Any

import pytest

from etcd_agent.config import parse_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "etcd_agent")
DEEP = "[" * 30_000 + "]" * 30_000  # within every bound; json.loads recurses per level: RecursionError, not ValueError

# the readers that may parse JSON themselves, and why
PARSERS = {
    "etcd_agent/safejson.py": "the bounded reader itself",
}


def test_json_is_parsed_only_by_the_bounded_reader() -> None:
    found = []
    for d, _dirs, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py") or f.endswith("_pb2.py"):
                continue
            path = os.path.join(d, f)
            rel = os.path.relpath(path, ROOT)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.Attribute) and node.attr in ("loads", "load") \
                        and isinstance(node.value, ast.Name) and node.value.id == "json" and rel not in PARSERS:
                    found.append(f"{rel}:{node.lineno} json.{node.attr}")
    assert found == []


def _cfg(tmp_path: Any) -> Any:
    c, errors = parse_text(
        '[cluster]\nname = "u"\ntoken = "t"\n[[member]]\nname = "m1"\nhost = "10.0.0.1"\n[local]\nname = "m1"\n'
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n[backup]\ndir = "{tmp_path / "backups"}"\n'
    )
    assert errors == []
    os.makedirs(c.daemon.state_dir)
    return c


def test_a_hostile_restore_marker_still_pauses_the_daemon(tmp_path: Any) -> None:
    from etcd_agent.state import markers

    c = _cfg(tmp_path)
    with open(markers.restore_marker_path(c, "m1"), "w") as fh:
        fh.write(DEEP)
    rec = markers.read_restore(c, "m1")
    assert rec is not None and rec.op == "?" and "nested deeper than" in rec.error


def test_a_hostile_upgrade_marker_counts_as_live(tmp_path: Any) -> None:
    from etcd_agent.state import markers

    c = _cfg(tmp_path)
    with open(markers.upgrade_marker_path(c, "m1"), "w") as fh:
        fh.write('{"pid": 1, "pid_started": 1e400}')
    rec = markers.upgrading(c, "m1")
    assert rec is not None and rec.version == "?" and "out of range" in rec.error


def test_a_hostile_version_pin_falls_back_to_the_configured_binary(tmp_path: Any) -> None:
    from etcd_agent.state import pins

    c = _cfg(tmp_path)
    with open(pins.pin_path(c, "m1"), "w") as fh:
        fh.write(DEEP)
    assert pins.read_pin(c, "m1") is None


def test_a_hostile_break_record_is_ignored(tmp_path: Any) -> None:
    from etcd_agent.continuous import status

    with open(tmp_path / status.BREAKS_FILE, "w") as fh:
        fh.write(DEEP)
    assert status.read_breaks(str(tmp_path)) == (0, [])


def test_a_hostile_watcher_record_names_no_chain(tmp_path: Any) -> None:
    from etcd_agent.chain import chains

    path = tmp_path / chains.WATCHER_LOCK
    path.write_text("[" * 3000)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held, as a running watcher holds it
        assert chains.active_base(str(tmp_path)) is None
    finally:
        os.close(fd)


def test_a_hostile_lineage_value_is_no_lineage() -> None:
    from etcd_agent.backup.evidence import parse_lineage

    assert parse_lineage(DEEP.encode()) == ((), frozenset())


def test_a_hostile_bootstrap_record_is_a_note(tmp_path: Any) -> None:
    from etcd_agent.backup.evidence import local_hosts
    from etcd_agent.state.bootstrap import record_path

    c = _cfg(tmp_path)
    path = record_path(c, "m1")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write('{"member_id": ' + "[" * 30_000 + "]" * 30_000 + "}")
    hosts, notes = local_hosts(c)
    assert hosts == [] and len(notes) == 1 and "unreadable" in notes[0]


def test_a_hostile_check_cache_is_ignored(tmp_path: Any) -> None:
    from etcd_agent.backup import checks

    # a check "made" at infinity would sort after every real one
    (tmp_path / checks.CACHE).write_text('{"etcd-x.tar": {"stamp": [1, 2, 3, 4], "ok": true, "how": "h", "at": 1e400}}')
    assert checks._load(str(tmp_path)) == {}


def test_snapshot_values_refuse_numbers_no_etcd_writes() -> None:
    from etcd_agent.etcd import snapdb

    for raw, why in [(b'{"ID": 1e400}', "x: bad JSON (the number 1e400 is out of range)"),
                     (b'{"ID": ' + b"9" * 25 + b"}", "x: bad JSON (an integer of 25 digits, more than the 20 allowed)")]:
        with pytest.raises(snapdb.SnapshotFormatError) as ei:
            snapdb._json(raw, "x")
        assert ei.value.message == why
