"""``etcd-agent node receive``: one member's snapshot, off its stream, into the restore's work dir.

The receiving end of ``restore.ship`` (the stream is ``node.transfer``'s). Only for the op
journaled there, and only while the session of the same owner holds this host's lock: a second
orchestrator cannot ship over the first one's files. Everything that can refuse is checked before
the ``Ready`` line (lock, journal, codec, a temp file beside the target, room on its disk); then
the stream is decoded in bounded slices, hashed and checked as it is written (one sha256 pass,
etcd's own trailer, the bbolt meta pages), and committed only once the sender's end record
matches: fsync, rename, fsync of the dir, then ``received.json`` says what arrived. Anything else
removes the temp file. Nothing is read back afterwards.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import select
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from ..backup.snapcheck import SnapshotFacts, StreamCheck
from ..config import Config
from ..errors import BusyError, OperationFailed, RefusedError
from ..fs import StagedFile, write_atomic
from ..node.protocol import PROTOCOL
from ..node.transfer import Decoder, FrameReader, Ready, Received, StreamError, require_codec
from ..state.locks import holder_of
from ..typedjson import Document
from . import journal as J
from .precheck import work_dir_for

log = logging.getLogger(__name__)

SNAPSHOT = "etcd_snapshot.db"
RECEIVED = "received.json"
PIPE_SIZE = 1 << 20  # stdin from sshd: a bigger pipe means fewer, larger reads
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux; the name is in fcntl from Python 3.10


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


class IdleStream:
    """A file descriptor read with a deadline on every read: a sender that goes silent (a cut link
    can leave the connection half open for hours) ends the receive after ``idle`` seconds."""

    def __init__(self, fd: int, idle: float, what: str) -> None:
        self.fd = fd
        self.idle = idle
        self.what = what
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        try:
            fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass  # not a pipe, or over /proc/sys/fs/pipe-max-size: the default size works too

    def read_into(self, view: memoryview) -> int:
        if not self._poll.poll(int(self.idle * 1000)):
            raise StreamError(f"{self.what}: no data for {self.idle:g}s (the sender is gone or cut off); nothing kept")
        return os.readv(self.fd, [view])


def _expecting(cfg: Config, member: str, op: str, owner_token: str) -> str:
    """The member's work dir, when this op's journal there waits for the snapshot from this owner."""
    holder = holder_of(cfg.backup.dir)
    owner = holder.owner if holder else None
    if owner is None or owner.token != owner_token:
        raise BusyError(f"{member}: this host's operation lock is not held by the restore shipping to it; nothing written")
    work_dir = work_dir_for(cfg.data_dir(member).rstrip("/"), member)
    j = J.load(J.path_in(work_dir))
    if j is None or j.op != op:
        raise RefusedError(f"{member}: no journal of restore {op} in {work_dir}" + (f" (it holds {j.op})" if j else ""))
    if not j.open or j.done("receive"):
        raise RefusedError(f"{member}: restore {op} does not expect a snapshot now ({j.state}, "
                           f"{'received already' if j.done('receive') else 'not started'})")
    return work_dir


def receive_snapshot(cfg: Config, member: str, op: str, owner_token: str, size: int, codec: str, *,
                     idle: float, stdin_fd: int, ready: Callable[[Ready], None]) -> Dict[str, Any]:
    """Take the snapshot of ``size`` bytes off ``stdin_fd``; ``ready(doc)`` is told (to print it)
    once everything that can refuse has been checked. Returns the ``Received`` document."""
    what = f"{member}: the shipped snapshot"
    work_dir = _expecting(cfg, member, op, owner_token)
    require_codec(codec)
    final = os.path.join(work_dir, SNAPSHOT)
    for old in (final, os.path.join(work_dir, RECEIVED)):  # of an attempt this journal never recorded
        if os.path.lexists(old):
            os.unlink(old)
    staged = StagedFile(work_dir, SNAPSHOT)
    try:
        st = os.statvfs(work_dir)
        free = st.f_bavail * st.f_frsize
        if free < size:
            raise RefusedError(f"{member}: {free} bytes free in {work_dir}, the snapshot needs {size}; "
                               "refused before any data was sent")
        ready(Ready(PROTOCOL, codec, free))
        t0 = time.monotonic()
        frames = FrameReader(IdleStream(stdin_fd, idle, what).read_into, what)
        digest, facts = _land(Decoder(frames, codec, size), StreamCheck(declared=size, what=what), staged, what)
        staged.commit()
    except OSError as exc:
        staged.discard()
        raise OperationFailed(f"{what}: writing {staged.path} failed: {exc.strerror or exc}; nothing kept") from None
    except BaseException:
        staged.discard()
        raise
    st2 = os.stat(final)
    rec = Landed(digest, st2.st_size, st2.st_ino, st2.st_mtime_ns, facts.high_water, facts.page_size, codec, frames.wire,
                 facts.trailer_checked)
    write_atomic(os.path.join(work_dir, RECEIVED), (json.dumps(rec.to_json()) + "\n").encode(), mode=0o600)
    log.info("%s: received %d bytes for restore %s in %.1fs (%s, %d on the wire; sha256 %s...)%s", member, size, op,
             time.monotonic() - t0, codec, frames.wire, digest[:16],
             f"; removed {len(staged.removed)} temp file(s) of a receiver that died" if staged.removed else "")
    return Received(member, size, digest, frames.wire).to_json()


def _land(dec: Decoder, check: StreamCheck, staged: StagedFile, what: str) -> Tuple[str, SnapshotFacts]:
    """Decode, check and write every slice; then the sender's end record must match what landed.
    Returns the sha256 and what the one pass found (etcd's trailer, the bbolt meta pages)."""
    for chunk in dec.chunks():
        check.update(chunk)
        staged.write(chunk)
    end = dec.finish()
    digest = check.sha256
    if end.sha256 != digest:
        raise StreamError(f"{what}: sha256 {digest[:16]}... arrived, the sender read {end.sha256[:16]}...; "
                          "nothing kept")
    facts = check.finish()  # etcd's sha256 trailer and the bbolt meta pages, from the same pass
    return digest, facts
