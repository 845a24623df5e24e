"""restore.receive.land_file: the restoring master's own member copies the snapshot from the file
here with the receiver's checks in one pass, and commits only a sound copy; and node receive's
wait for its order. Real etcd snapshot (tests/data), real files and pipes; nothing but the work
dir is written."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, List

import pytest

from etcd_agent.config import parse_text
from etcd_agent.errors import AgentError, BackupCorrupt, OperationFailed, RefusedError
from etcd_agent.node.replies import ReceiveReply
from etcd_agent.restore.host import journal as J
from etcd_agent.restore.host.facts import work_dir_for
from etcd_agent.restore.host.receive import RECEIVED, SNAPSHOT, Landed, land_file

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
SNAP = open(os.path.join(DATA, "snap-a.db"), "rb").read()  # etcd 3.5.16, with its sha256 trailer

TEXT = """
[cluster]
name = "k8s"
[etcd]
data_dir = "{d}/etcd/m1.etcd"
[backup]
dir = "{d}/backups"
[[member]]
name = "m1"
host = "127.0.0.1"
"""


@pytest.fixture
def bed(tmp_path: Any) -> Any:
    cfg, errors = parse_text(TEXT.format(d=tmp_path))
    assert cfg is not None and not errors, errors
    wd = work_dir_for(cfg.data_dir("m1"), "m1")
    os.makedirs(wd, mode=0o700)
    j = J.Journal(op="op1", member="m1", backup="b.tar", token="t", initial_cluster="", sha256=None, size=len(SNAP),
                  bump=None, fence_owner=False, new_cluster=False, was_running=True)
    J.save(J.path_in(wd), j)
    return cfg, wd, str(tmp_path)


def source_file(d: str, data: bytes, prefix: bytes = b"") -> str:
    path = os.path.join(d, "backup.tar")
    with open(path, "wb") as fh:
        fh.write(prefix + data + b"\0" * 1024)  # a snapshot inside a bigger file, like a plain tarball's
    return path


def left_in(wd: str) -> List[str]:
    return sorted(n for n in os.listdir(wd) if n != "journal.json")


def test_a_copy_from_inside_a_tarball_is_checked_and_committed(bed: Any) -> None:
    cfg, wd, d = bed
    path = source_file(d, SNAP, prefix=b"x" * 1536)
    rec = land_file(cfg, "m1", "op1", path, 1536, len(SNAP))
    assert rec.sha256 == hashlib.sha256(SNAP).hexdigest() and rec.trailer_checked and rec.codec == "file"
    with open(os.path.join(wd, SNAPSHOT), "rb") as fh:
        assert fh.read() == SNAP
    with open(os.path.join(wd, RECEIVED)) as fh:
        assert Landed.from_json(json.load(fh), RECEIVED) == rec
    assert left_in(wd) == [SNAPSHOT, RECEIVED] and oct(os.stat(os.path.join(wd, SNAPSHOT)).st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("damage", ["trailer", "meta", "short"])
def test_a_damaged_copy_is_refused_and_nothing_is_kept(bed: Any, damage: str) -> None:
    cfg, wd, d = bed
    data = bytearray(SNAP)
    if damage == "trailer":
        data[len(data) // 2] ^= 0x01  # one bit in the db: etcd's trailer no longer matches
    elif damage == "meta":
        data[0:16] = b"\0" * 16  # the first meta page's header
    path = source_file(d, bytes(data))
    size = len(SNAP) + (1024 + 512 if damage == "short" else 0)  # claims more than the file holds
    with pytest.raises(AgentError) as err:
        land_file(cfg, "m1", "op1", path, 0, size)
    assert isinstance(err.value, (BackupCorrupt, RefusedError)), err.value
    assert left_in(wd) == [], "a refused copy left files behind"


def test_a_symlink_or_a_journal_not_waiting_is_refused_before_anything_is_written(bed: Any) -> None:
    cfg, wd, d = bed
    path = source_file(d, SNAP)
    link = os.path.join(d, "link.tar")
    os.symlink(path, link)
    with pytest.raises(OperationFailed, match="cannot open it"):
        land_file(cfg, "m1", "op1", link, 0, len(SNAP))
    with pytest.raises(RefusedError, match="no journal of restore op2"):
        land_file(cfg, "m1", "op2", path, 0, len(SNAP))  # another restore's copy
    land_file(cfg, "m1", "op1", path, 0, len(SNAP))
    j = J.load(J.path_in(wd))
    assert j is not None
    j.steps["receive"] = ReceiveReply(step="receive", member="m1", sha256=hashlib.sha256(SNAP).hexdigest())
    J.save(J.path_in(wd), j)
    with pytest.raises(RefusedError, match="received already"):
        land_file(cfg, "m1", "op1", path, 0, len(SNAP))
    assert left_in(wd) == [SNAPSHOT, RECEIVED]  # the first copy is still there, untouched


# ---------------------------------------------------------------- node receive before its order


def test_a_receiver_whose_order_never_comes_leaves_without_a_word(bed: Any) -> None:
    """Started ahead, and the restore never got to its ship within the idle limit: it says
    nothing (an answer would count as its host's refusal) and looks at nothing."""
    from etcd_agent.restore.host.receive import receive_snapshot

    cfg, wd, _d = bed
    r, w = os.pipe()
    said: List[Any] = []
    try:
        assert receive_snapshot(cfg, idle=0.2, stdin_fd=r, ready=said.append) is None
    finally:
        os.close(r)
        os.close(w)
    assert said == [] and sorted(os.listdir(wd)) == [os.path.basename(J.path_in(wd))]


def test_a_receiver_cut_off_inside_its_order_says_so(bed: Any) -> None:
    from etcd_agent.node.transfer import HEADER, StreamError
    from etcd_agent.restore.host.receive import receive_snapshot

    cfg, wd, _d = bed
    r, w = os.pipe()
    os.write(w, HEADER.pack(b"O", 64) + b'{"member":')  # then silence
    try:
        with pytest.raises(StreamError) as err:
            receive_snapshot(cfg, idle=0.2, stdin_fd=r, ready=lambda doc: None)
    finally:
        os.close(r)
        os.close(w)
    assert "no data for 0.2s" in err.value.message


# ---------------------------------------------------------------- a landing from before a restart


OTHER_BOOT = "00000000-1111-2222-3333-444444444444"


def landed_in_another_boot(cfg: Any, wd: str, d: str, damage: bool) -> str:
    """A snapshot landed (never fsynced) and recorded in a boot that is over; ``damage``: the
    crash left one wrong block under the same size, inode and mtime."""
    from etcd_agent.fs import boot_id

    rec = land_file(cfg, "m1", "op1", source_file(d, SNAP), 0, len(SNAP))
    assert rec.boot_id == boot_id() and rec.boot_id is not None, "a landing records the boot it was checked in"
    with open(os.path.join(wd, RECEIVED), "w") as fh:
        json.dump(dataclasses.replace(rec, boot_id=OTHER_BOOT).to_json(), fh)
    snap = os.path.join(wd, SNAPSHOT)
    if damage:
        st = os.stat(snap)
        fd = os.open(snap, os.O_WRONLY)
        os.pwrite(fd, b"\0" * 4096, 8192)
        os.close(fd)
        os.utime(snap, ns=(st.st_atime_ns, st.st_mtime_ns))
    return rec.sha256


def test_a_snapshot_landed_before_a_restart_is_checked_again_in_full_then_trusted(bed: Any) -> None:
    from etcd_agent.fs import boot_id
    from etcd_agent.restore.host.node import NodeRestore

    cfg, wd, d = bed
    sha = landed_in_another_boot(cfg, wd, d, damage=False)
    reply = NodeRestore(cfg, "m1", "op1").receive(sha)
    assert reply.sha256 == sha
    with open(os.path.join(wd, RECEIVED)) as fh:
        assert Landed.from_json(json.load(fh), RECEIVED).boot_id == boot_id(), "checked again: recorded for this boot"


def test_a_snapshot_damaged_by_a_restart_is_removed_and_the_way_out_named(bed: Any) -> None:
    from etcd_agent.restore.host.node import NodeRestore

    cfg, wd, d = bed
    sha = landed_in_another_boot(cfg, wd, d, damage=True)
    with pytest.raises(OperationFailed) as err:
        NodeRestore(cfg, "m1", "op1").receive(sha)
    text = err.value.message
    assert "before this host restarted" in text and "trailer" in text and "restore rollback --yes" in text, text
    assert left_in(wd) == [], "the damaged snapshot and its record stay behind"
