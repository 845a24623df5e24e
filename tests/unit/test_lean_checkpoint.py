"""Lean checkpoints (``backup.lean``): etcd's sha256 trailer checked and cut off, the defragmented
db cut to its high-water mark and sealed with a new trailer; the stage, its room and its removal,
and a defrag that fails or is missing leaving the snapshot as etcd sent it. On a real etcd 3.5.16
snapshot (tests/data); the defrag tool here is a script standing in for etcdutl (the real one
runs in tests/integration/test_lean_checkpoints.py)."""
from __future__ import annotations

import hashlib
import os
import stat
from typing import Any, Iterator, List

import pytest

from etcd_agent.backup import lean
from etcd_agent.config import parse_text
from etcd_agent.errors import BackupCorrupt, BackupError, RefusedError
from etcd_agent.hosts.local import LocalHost

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
SNAP = open(os.path.join(DATA, "snap-a.db"), "rb").read()  # etcd 3.5.16, with its trailer


def put(path: Any, data: bytes) -> str:
    with open(path, "wb") as fh:
        fh.write(data)
    return str(path)


def test_a_sound_trailer_is_checked_and_cut_off(tmp_path: Any) -> None:
    p = put(tmp_path / "db", SNAP)
    assert lean.strip_trailer(p) == SNAP[-32:] == hashlib.sha256(SNAP[:-32]).digest()
    assert open(p, "rb").read() == SNAP[:-32]


@pytest.mark.parametrize("data, words", [
    (SNAP[:-100], "not a bbolt db plus etcd's 32-byte sha256 trailer"),  # truncated
    (SNAP[:-1], "not a bbolt db plus etcd's 32-byte sha256 trailer"),
    (SNAP[:-32], "not a bbolt db plus etcd's 32-byte sha256 trailer"),  # no trailer at all
    (SNAP[:-32] + bytes(32), "trailer does not match"),  # wrong trailer
    (SNAP[:4096] + bytes([SNAP[4096] ^ 1]) + SNAP[4097:], "trailer does not match"),  # a flipped data byte
    (b"", "not a bbolt db"),
])
def test_a_truncated_or_wrong_trailer_is_refused_and_the_file_left_alone(tmp_path: Any, data: bytes,
                                                                        words: str) -> None:
    p = put(tmp_path / "db", data)
    with pytest.raises(BackupCorrupt, match=words):
        lean.strip_trailer(p)
    assert open(p, "rb").read() == data


def test_seal_cuts_the_db_to_its_high_water_mark_and_appends_its_sha256(tmp_path: Any) -> None:
    # bbolt grows its file ahead of its pages (a defragmented 266 kB db is a 512 kB file): the
    # sealed snapshot is exactly what etcd would have streamed of the same db
    p = put(tmp_path / "db", SNAP[:-32] + bytes(300 * 1024))
    assert lean.seal(p) == len(SNAP)
    assert open(p, "rb").read() == SNAP
    p = put(tmp_path / "db2", SNAP[:-32])
    assert lean.seal(p) == len(SNAP) and open(p, "rb").read() == SNAP


def test_seal_refuses_a_db_shorter_than_its_pages_or_not_a_db(tmp_path: Any) -> None:
    with pytest.raises(BackupCorrupt, match="not sound"):
        lean.seal(put(tmp_path / "short", SNAP[:-32 - 4096]))
    with pytest.raises(BackupCorrupt, match="not sound"):
        lean.seal(put(tmp_path / "junk", os.urandom(16384)))


def tool(tmp_path: Any, body: str) -> str:
    """A stand-in for etcdutl: ``defrag --data-dir=D`` runs ``body`` with $D the data dir."""
    p = tmp_path / "tool"
    p.write_text('#!/bin/sh\nD="${2#--data-dir=}"\n' + body + "\n")
    p.chmod(0o755)
    return str(p)


def cfg_for(tmp_path: Any, etcdutl: str) -> Any:
    cfg, errors = parse_text(f"""
[cluster]
name = "c"
[etcd]
etcdutl = "{etcdutl}"
[backup]
dir = "{tmp_path}/backups"
[daemon]
state_dir = "{tmp_path}/state"
[[member]]
name = "a"
host = "10.0.0.1"
""")
    assert errors == [], errors
    return cfg


def chunks(data: bytes) -> Iterator[bytes]:
    for i in range(0, len(data), 7000):
        yield data[i : i + 7000]


def stages(cfg: Any) -> List[str]:
    return os.listdir(lean.stage_parent(cfg))


def test_the_defragmented_db_is_staged_privately_sealed_and_removed_after(tmp_path: Any) -> None:
    # the tool "defragments" into a bigger file, as bbolt does: the pages, then room it grew
    cfg = cfg_for(tmp_path, tool(tmp_path, 'head -c 307200 /dev/zero >> "$D/member/snap/db"'))
    seen = {}
    with lean.staged(cfg, LocalHost(), lambda: chunks(SNAP), len(SNAP)) as st:
        assert st.lean and st.from_bytes == len(SNAP)
        assert b"".join(st.chunks()) == SNAP  # sealed: the same pages, a trailer of their own
        seen["mode"] = stat.S_IMODE(os.stat(os.path.dirname(os.path.dirname(os.path.dirname(st.path)))).st_mode)
        assert st.path.startswith(lean.stage_parent(cfg) + "/" + lean.STAGE_PREFIX)
        assert not st.path.startswith(cfg.backup.dir)
    assert seen["mode"] == 0o700
    assert stat.S_IMODE(os.stat(lean.stage_parent(cfg)).st_mode) == 0o700
    assert stages(cfg) == []


def test_a_failing_defrag_leaves_the_snapshot_as_etcd_sent_it(tmp_path: Any, caplog: Any) -> None:
    cfg = cfg_for(tmp_path, tool(tmp_path, 'echo "Error: bbolt says no" >&2; exit 3'))
    with lean.staged(cfg, LocalHost(), lambda: chunks(SNAP), len(SNAP)) as st:
        assert not st.lean and st.from_bytes == len(SNAP)
        assert b"".join(st.chunks()) == SNAP
    assert stages(cfg) == []
    line = next(r.getMessage() for r in caplog.records if "not defragmented" in r.getMessage())
    assert "bbolt says no" in line and "\n" not in line


def test_a_defrag_that_fails_after_changing_the_db_takes_no_checkpoint(tmp_path: Any) -> None:
    cfg = cfg_for(tmp_path, tool(tmp_path, 'printf x >> "$D/member/snap/db"; exit 1'))
    with pytest.raises(BackupError, match="left the staged snapshot changed"):
        with lean.staged(cfg, LocalHost(), lambda: chunks(SNAP), len(SNAP)):
            pass
    assert stages(cfg) == []


def test_a_missing_tool_is_said_and_the_stage_removed(tmp_path: Any) -> None:
    cfg = cfg_for(tmp_path, str(tmp_path / "no-etcdutl"))
    assert "no-etcdutl is not an executable here" in lean.tool_missing(cfg)
    with lean.staged(cfg, LocalHost(), lambda: chunks(SNAP), len(SNAP)) as st:
        assert not st.lean and b"".join(st.chunks()) == SNAP
    assert stages(cfg) == []


def test_a_wrong_stream_or_a_failing_archive_leaves_no_stage(tmp_path: Any) -> None:
    cfg = cfg_for(tmp_path, tool(tmp_path, "exit 0"))
    with pytest.raises(BackupCorrupt, match="trailer does not match"):
        with lean.staged(cfg, LocalHost(), lambda: chunks(SNAP[:-32] + bytes(32)), len(SNAP)):
            pass
    assert stages(cfg) == []
    with pytest.raises(OSError):
        with lean.staged(cfg, LocalHost(), lambda: chunks(SNAP), len(SNAP)):
            raise OSError("the archive's disk is full")
    assert stages(cfg) == []


def test_too_little_room_to_stage_is_a_refusal_before_anything_is_read(tmp_path: Any) -> None:
    cfg = cfg_for(tmp_path, tool(tmp_path, "exit 0"))

    def never() -> Iterator[bytes]:
        raise AssertionError("the snapshot was read")

    with pytest.raises(RefusedError, match=r"not enough space in .*checkpoint-stage to defragment the checkpoint"):
        with lean.staged(cfg, LocalHost(), never, 1 << 60):
            pass
    assert stages(cfg) == []


def test_sweep_removes_what_a_killed_checkpoint_left_and_nothing_else(tmp_path: Any) -> None:
    cfg = cfg_for(tmp_path, "/usr/bin/etcdutl")
    assert lean.sweep(cfg) == []  # no stage dir yet
    parent = lean.stage_parent(cfg)
    os.makedirs(os.path.join(parent, lean.STAGE_PREFIX + "abc", "member", "snap"))
    put(os.path.join(parent, lean.STAGE_PREFIX + "abc", "member", "snap", "db"), SNAP)
    os.makedirs(os.path.join(parent, "other"))
    put(os.path.join(parent, lean.STAGE_PREFIX + "file"), b"x")  # not a stage dir: left alone
    assert lean.sweep(cfg) == [os.path.join(parent, lean.STAGE_PREFIX + "abc")]
    assert sorted(os.listdir(parent)) == [lean.STAGE_PREFIX + "file", "other"]


def test_lean_checkpoints_config() -> None:
    base = '[cluster]\nname = "c"\n[[member]]\nname = "a"\nhost = "10.0.0.1"\n[backup.delta]\n'
    cfg, errors = parse_text(base)
    assert errors == [] and cfg is not None and cfg.backup.delta.lean_checkpoints is True
    cfg, errors = parse_text(base + "lean_checkpoints = false\n")
    assert errors == [] and cfg is not None and cfg.backup.delta.lean_checkpoints is False
    _, errors = parse_text(base + 'lean_checkpoints = "yes"\n')
    assert any("backup.delta.lean_checkpoints" in e for e in errors), errors



def test_only_the_daemons_checkpoints_are_staged_and_a_missing_tool_streams_as_today(tmp_path: Any,
                                                                                    caplog: Any) -> None:
    from dataclasses import replace

    from etcd_agent.backup import service

    class Client:
        streamed = 0

        def snapshot_chunks(self, endpoint: str) -> Iterator[bytes]:
            self.streamed += 1
            return chunks(SNAP)

    def stage(cfg: Any, checkpoint_of: Any) -> Any:
        c = Client()
        with service._checkpoint_stage(cfg, LocalHost(), c, cfg.members[0], len(SNAP), checkpoint_of) as st:
            return st, c.streamed

    ok = cfg_for(tmp_path, tool(tmp_path, "exit 0"))
    # a plain full backup (cron, the CLI, a chain's start) streams from etcd as ever: nothing staged
    assert stage(ok, None) == (None, 0)
    off = replace(ok, backup=replace(ok.backup, delta=replace(ok.backup.delta, lean_checkpoints=False)))
    assert stage(off, "c" * 32) == (None, 0)
    gone = cfg_for(tmp_path, str(tmp_path / "no-etcdutl"))
    assert stage(gone, "c" * 32) == (None, 0)  # etcd's stream, straight into the archive
    line = next(r.getMessage() for r in caplog.records if "not defragmented: " in r.getMessage())
    assert "no-etcdutl is not an executable here" in line
    assert not os.path.exists(lean.stage_parent(gone))
    st, streamed = stage(ok, "c" * 32)
    assert streamed == 1 and st.lean and st.from_bytes == len(SNAP)
    assert stages(ok) == []


def test_the_manifest_says_what_a_lean_snapshot_came_from_and_old_ones_read_as_before() -> None:
    from etcd_agent.backup.manifest import Manifest

    def man(snapshot: Any) -> Manifest:
        from etcd_agent.backup.manifest import FileEntry

        return Manifest(files={"etcd_snapshot.db": FileEntry(len(SNAP), hashlib.sha256(SNAP).hexdigest())},
                        snapshot=snapshot)

    assert man({"taken_by": "daemon", "lean": {"from_bytes": 11354144}}).lean_from == 11354144
    assert man({"taken_by": "daemon"}).lean_from is None  # before lean checkpoints, or not one
    for junk in ({"from_bytes": "1"}, {"from_bytes": True}, {"from_bytes": 0}, [1], None):
        assert man({"lean": junk}).lean_from is None
    m = man({"taken_by": "daemon", "lean": {"from_bytes": 4096}})
    assert Manifest.from_json(m.to_json(), "manifest").lean_from == 4096


def test_the_daemons_start_sweeps_a_killed_stage_unless_a_backup_holds_the_lock(tmp_path: Any) -> None:
    from etcd_agent.state.locks import OperationLock, lock_path_for

    cfg = cfg_for(tmp_path, "/usr/bin/etcdutl")
    assert lean.sweep_at_start(cfg) == []  # nothing was ever staged here
    left = os.path.join(lean.stage_parent(cfg), lean.STAGE_PREFIX + "killed")
    os.makedirs(os.path.join(left, "member", "snap"))
    os.makedirs(cfg.backup.dir, mode=0o700)
    with OperationLock(lock_path_for(cfg.backup.dir), "backup"):  # a checkpoint being taken: its stage
        assert lean.sweep_at_start(cfg) == [] and os.path.isdir(left)
    assert lean.sweep_at_start(cfg) == [left] and not os.path.exists(left)
