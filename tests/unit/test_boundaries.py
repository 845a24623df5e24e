"""Restores as boundaries of a backup dir's history (pure rules, and the record on disk)."""
from __future__ import annotations

import json
import os
import stat
from typing import Any

from etcd_agent.backup import boundaries as B

T = 1_800_000_000.0


def at(name: str, t: float, sha: str = "") -> B.BackupAt:
    return B.BackupAt(name, t, sha or None)


BACKUPS = [at("h1", T - 7200), at("h2", T - 3600), at("src", T - 1800, "ab" * 32), at("last", T - 60),
           at("after", T + 60)]


def test_a_restore_holds_its_source_and_the_last_backup_before_it_while_its_data_is_aside() -> None:
    b = B.Boundary(op="r1", time=T, from_backup="src", from_sha256="ab" * 32, set_aside=("/d/m1.etcd.pre-restore-x",))
    held = B.by_name(B.holds([b], BACKUPS, exists=lambda p: True))
    assert list(held) == ["src", "last"]
    assert "the backup restore r1" in held["src"][0] and "came from" in held["src"][0]
    assert "the last backup before restore r1" in held["last"][0] and "/d/m1.etcd.pre-restore-x" in held["last"][0]
    # once `restore cleanup` removed the set-aside dirs, only the source is held
    assert list(B.by_name(B.holds([b], BACKUPS, exists=lambda p: False))) == ["src"]


def test_a_renamed_source_is_found_by_its_snapshot_hash_and_a_detected_one_holds_the_last_before() -> None:
    b = B.Boundary(op="r1", time=T, from_backup="gone.tar", from_sha256="ab" * 32)
    assert list(B.by_name(B.holds([b], BACKUPS, exists=lambda p: False))) == ["src"]
    d = B.Boundary(op="detected-1", time=T, kind="detected", reason="another cluster id")
    held = B.by_name(B.holds([d], BACKUPS, exists=lambda p: False))
    assert list(held) == ["last"] and "by hand" in held["last"][0]


def test_before_names_the_first_boundary_after_a_backup() -> None:
    b1, b2 = B.Boundary(op="r1", time=T), B.Boundary(op="r2", time=T + 3600)
    assert B.before([b2, b1], T - 10) == b1
    assert B.before([b1, b2], T + 10) == b2
    assert B.before([b1, b2], T + 7200) is None


def test_record_once_per_op_merging_set_aside_dirs(tmp_path: Any) -> None:
    d = str(tmp_path)
    assert B.read(d) == []
    assert B.record(d, B.Boundary(op="r1", time=T, set_aside=("/a",)))
    assert B.record(d, B.Boundary(op="r1", time=T, set_aside=("/b",)))  # the op's second member on this host
    assert not B.record(d, B.Boundary(op="r1", time=T, set_aside=("/a",)))
    assert B.record(d, B.Boundary(op="r0", time=T - 10))
    got = B.read(d)
    assert [x.op for x in got] == ["r0", "r1"] and got[1].set_aside == ("/a", "/b")
    path = os.path.join(d, B.FILE)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_hostile_record_is_ignored_not_trusted(tmp_path: Any) -> None:
    d = str(tmp_path)
    with open(os.path.join(d, B.FILE), "w") as fh:
        json.dump({"restores": [{"op": "ok", "time": T}, {"op": 5, "time": "x"}, "junk"]}, fh)
    assert [x.op for x in B.read(d)] == ["ok"]
    with open(os.path.join(d, B.FILE), "w") as fh:
        fh.write("[" * 100_000)
    assert B.read(d) == []
