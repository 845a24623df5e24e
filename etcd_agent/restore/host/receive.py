"""``etcd-agent node receive``: one member's snapshot, off its stream, into the restore's work dir.

The receiving end of ``restore.ship`` (the stream is ``node.transfer``'s). What it takes, and for
whom, comes in the stream's first frame, the order: so the process can be started ahead, while the
hosts pre-check. Only for the op journaled there, and only while the session of the same owner
holds this host's lock: a second orchestrator cannot ship over the first one's files. Everything that can refuse is checked before
the ``Ready`` line (lock, journal, codec, a temp file beside the target, room on its disk); then
the stream is decoded in bounded slices, hashed and checked as it is written (one sha256 pass,
etcd's own trailer, the bbolt meta pages), and committed only once the sender's end record
matches: rename, fsync of the dir, then ``received.json`` says what arrived. Anything else
removes the temp file. Nothing is read back afterwards - within the same kernel boot.

The snapshot itself is not fsynced (``StagedFile(durable=False)``): it is read once by ``snapshot
restore`` moments later and deleted right after, so its gigabyte usually never reaches the disk,
which that restore needs. ``received.json`` records the boot it landed in; after a restart (a
resumed restore on a host that rebooted) the file is read and checked again in full before
anything uses it (``still_sound``), and a damaged one is removed with a clear error.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import stat
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple, Union

from etcd_agent.backup.snapcheck import StreamCheck
from etcd_agent.config import Config
from etcd_agent.errors import BackupCorrupt, BusyError, OperationFailed, RefusedError
from etcd_agent.fs import StagedFile, boot_id, enlarge_pipe, write_atomic
from etcd_agent.node.protocol import PROTOCOL
from etcd_agent.node.transfer import Decoder, FrameReader, Ready, Received, StreamError, require_codec
from etcd_agent.restore.host import journal as J
from etcd_agent.restore.host.facts import work_dir_for
from etcd_agent.state.locks import holder_of
from etcd_agent.typedjson import Document

log = logging.getLogger(__name__)

SNAPSHOT = "etcd_snapshot.db"
RECEIVED = "received.json"
READ_SIZE = 1 << 20  # a local copy's reads


@dataclass(frozen=True)
class Landed(Document):
    """``received.json``: what was committed to ``SNAPSHOT``, and the file it was committed as
    (size, inode, mtime: the steps after ``receive`` check they still hold those bytes)."""

    sha256: str
    size: int
    ino: int
    mtime_ns: int
    pages: Optional[int] = None
    page_size: Optional[int] = None
    codec: Optional[str] = None
    wire: Optional[int] = None
    trailer_checked: bool = False  # etcd's sha256 trailer matched the data as it landed
    # the kernel boot in which these bytes were last checked (they were not fsynced); None: they
    # were synced before the record was written (an older agent's)
    boot_id: Optional[str] = None


class Silent(StreamError):
    """No byte came for the idle limit."""


class IdleStream:
    """A file descriptor read with a deadline on every read: a sender that goes silent (a cut link
    can leave the connection half open for hours) ends the receive after ``idle`` seconds."""

    def __init__(self, fd: int, idle: float, what: str) -> None:
        self.fd = fd
        self.idle = idle
        self.what = what
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        enlarge_pipe(fd)  # stdin from sshd: fewer, larger reads

    def read_into(self, view: memoryview) -> int:
        if not self._poll.poll(int(self.idle * 1000)):
            raise Silent(f"{self.what}: no data for {self.idle:g}s (the sender is gone or cut off); nothing kept")
        return os.readv(self.fd, [view])


def _expecting(cfg: Config, member: str, op: str, owner_token: str) -> str:
    """The member's work dir, when this op's journal there waits for the snapshot from this owner."""
    holder = holder_of(cfg.backup.dir)
    owner = holder.owner if holder else None
    if owner is None or owner.token != owner_token:
        raise BusyError(f"{member}: this host's operation lock is not held by the restore shipping to it; nothing written")
    return _waiting(cfg, member, op)


def _waiting(cfg: Config, member: str, op: str) -> str:
    """The member's work dir, when this op's journal there waits for the snapshot."""
    work_dir = work_dir_for(cfg.data_dir(member).rstrip("/"), member)
    j = J.load(J.path_in(work_dir))
    if j is None or j.op != op:
        raise RefusedError(f"{member}: no journal of restore {op} in {work_dir}" + (f" (it holds {j.op})" if j else ""))
    if not j.open or j.done("receive"):
        raise RefusedError(f"{member}: restore {op} does not expect a snapshot now ({j.state}, "
                           f"{'received already' if j.done('receive') else 'not started'})")
    return work_dir


def receive_snapshot(cfg: Config, *, idle: float, stdin_fd: int,
                     ready: Callable[[Ready], None]) -> Optional[Dict[str, Any]]:
    """Take the order off ``stdin_fd``, then the snapshot it announces; ``ready(doc)`` is told (to
    print it) once everything that can refuse has been checked. Returns the ``Received``
    document, or None when the stream ended before any order (a receiver started ahead of a
    restore that did not need it: nothing was looked at)."""
    stream = IdleStream(stdin_fd, idle, "the shipped snapshot")
    frames = FrameReader(stream.read_into, stream.what)
    try:
        order = frames.order()
    except Silent:
        if frames.wire:
            raise
        order = None  # started ahead, and no order came: it leaves without a word, and the
        # sender, finding it gone, starts a fresh one (an answer would count as its host's)
        log.info("no order within %gs: leaving, nothing looked at", idle)
    if order is None:
        return None
    member, size, codec = order.member, order.size, order.codec
    what = stream.what = frames.what = f"{member}: the shipped snapshot"
    work_dir = _expecting(cfg, member, order.op, order.owner)
    require_codec(codec)

    def land(staged: StagedFile, check: StreamCheck) -> Tuple[str, int]:
        free = _room(work_dir, size, member)
        ready(Ready(PROTOCOL, codec, free))
        dec = Decoder(frames, codec, size)
        _write_checked(dec.chunks(), check, staged)
        end = dec.finish()
        if end.sha256 != check.sha256:
            raise StreamError(f"{what}: sha256 {check.sha256[:16]}... arrived, the sender read {end.sha256[:16]}...; "
                              "nothing kept")
        return codec, frames.wire

    rec = _landing(work_dir, size, what, land)
    log.info("%s: received %d bytes for restore %s (%s, %d on the wire; sha256 %s...)", member, size, order.op, codec,
             rec.wire, rec.sha256[:16])
    return Received(member, size, rec.sha256, rec.wire or 0).to_json()


def land_file(cfg: Config, member: str, op: str, path: str, offset: int, size: int) -> Landed:
    """The snapshot of a member on the restoring master itself: ``size`` bytes at ``offset`` of
    ``path`` (the backup, or its extracted copy) copied into the work dir with the receiver's own
    checks in the same single pass (sha256, etcd's trailer, bbolt meta), then committed the same
    way. No pipe, no second process: the orchestrator runs it while it ships to the others."""
    what = f"{member}: the snapshot copied from {path}"
    work_dir = _waiting(cfg, member, op)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise OperationFailed(f"{what}: cannot open it: {exc.strerror or exc}; nothing written") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or offset < 0 or st.st_size < offset + size:
            raise RefusedError(f"{what}: not a regular file holding {size} bytes at offset {offset}; nothing written")

        def land(staged: StagedFile, check: StreamCheck) -> Tuple[str, int]:
            _room(work_dir, size, member)
            _write_checked(_file_chunks(fd, offset, size), check, staged)
            return "file", size

        rec = _landing(work_dir, size, what, land)
    finally:
        os.close(fd)
    log.info("%s: copied %d bytes for restore %s from %s (sha256 %s...)", member, size, op, path, rec.sha256[:16])
    return rec


def _room(work_dir: str, size: int, member: str) -> int:
    st = os.statvfs(work_dir)
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise RefusedError(f"{member}: {free} bytes free in {work_dir}, the snapshot needs {size}; "
                           "refused before any data was sent")
    return free


def _landing(work_dir: str, size: int, what: str,
             land: Callable[[StagedFile, StreamCheck], Tuple[str, int]]) -> Landed:
    """``land`` writes the checked bytes into a staged file; committed (fsync, rename, fsync of the
    dir) only if it returns and the one pass proved a sound snapshot; then ``received.json``.
    Anything else removes the temp file."""
    final = os.path.join(work_dir, SNAPSHOT)
    for old in (final, os.path.join(work_dir, RECEIVED)):  # of an attempt this journal never recorded
        if os.path.lexists(old):
            os.unlink(old)
    boot = boot_id()  # where the kernel does not say, the snapshot is fsynced as anything else
    staged = StagedFile(work_dir, SNAPSHOT, durable=boot is None)
    check = StreamCheck(declared=size, what=what)
    try:
        how, wire = land(staged, check)
        facts = check.finish()  # etcd's sha256 trailer and the bbolt meta pages, from the same pass
        staged.commit()
    except OSError as exc:
        staged.discard()
        raise OperationFailed(f"{what}: writing {staged.path} failed: {exc.strerror or exc}; nothing kept") from None
    except BaseException:
        staged.discard()
        raise
    if staged.removed:
        log.info("%s: removed %d temp file(s) of a receiver that died", what, len(staged.removed))
    st2 = os.stat(final)
    rec = Landed(check.sha256, st2.st_size, st2.st_ino, st2.st_mtime_ns, facts.high_water, facts.page_size, how, wire,
                 facts.trailer_checked, boot)
    _record(work_dir, rec)
    return rec


def _record(work_dir: str, rec: Landed) -> None:
    write_atomic(os.path.join(work_dir, RECEIVED), (json.dumps(rec.to_json()) + "\n").encode(), mode=0o600)


def still_sound(work_dir: str, rec: Landed, what: str) -> Landed:
    """``rec``, once the snapshot it describes can be trusted in this boot. Landed in this boot
    (or synced): as it is, nothing read. Landed before a restart, never fsynced: the crash may
    have left zeros or stale blocks under the right size, so all of it is read and checked again
    (size, bbolt meta, etcd's trailer, the sha256 recorded at landing); then recorded as checked
    in this boot. BackupCorrupt when it is not what landed."""
    now = boot_id()
    if rec.boot_id is None or rec.boot_id == now:
        return rec
    path = os.path.join(work_dir, SNAPSHOT)
    check = StreamCheck(declared=rec.size, what=what)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for chunk in _file_chunks(fd, 0, rec.size):
            check.update(chunk)
    finally:
        os.close(fd)
    check.finish()
    if check.sha256 != rec.sha256:
        raise BackupCorrupt(f"{what}: sha256 {check.sha256[:16]}... now, {rec.sha256[:16]}... when it landed")
    if now is not None:  # (a kernel that no longer says: checked again at every use, never taken for synced)
        rec = dataclasses.replace(rec, boot_id=now)
        _record(work_dir, rec)
    log.info("%s: landed before this host restarted; read and checked again in full", what)
    return rec


def _write_checked(chunks: Iterable[Union[bytes, memoryview]], check: StreamCheck, staged: StagedFile) -> None:
    for chunk in chunks:
        check.update(chunk)
        staged.write(chunk)


def _file_chunks(fd: int, offset: int, size: int) -> Iterator[bytes]:
    left, pos = size, offset
    while left > 0:
        chunk = os.pread(fd, min(READ_SIZE, left), pos)
        if not chunk:
            raise BackupCorrupt(f"the file ended {left} bytes before the snapshot did")
        left -= len(chunk)
        pos += len(chunk)
        yield chunk
