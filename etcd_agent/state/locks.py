"""The host's operation lock: one backup, restore or upgrade step at a time on this machine.

A non-blocking ``flock`` on ``<backup dir>/.etcd-agent.lock``: the kernel drops it when the
holding process exits, even by kill -9, so a crashed run never leaves a stale lock behind and
"the lock is free" proves its last holder is gone. Busy means: say who holds it (the holder
records itself in the file) and touch nothing.

A restore or an upgrade holds it on every host for its whole run through the node protocol's
session (``etcd-agent node serve``): the lock lives exactly as long as that session, which ends
when its orchestrator closes it, dies, or goes silent (``node.protocol.SILENCE_LIMIT``).
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from types import TracebackType
from typing import List, Optional, Type

from etcd_agent.errors import BackupError, BusyError, OperationFailed
from etcd_agent.proctime import start_ticks
from etcd_agent.safejson import UnsafeJson, loads
from etcd_agent.typedjson import Document
from etcd_agent.waiting import SYSTEM_CLOCK, Clock, NotYet, poll

log = logging.getLogger(__name__)

LOCK_NAME = ".etcd-agent.lock"
MAX_HOLDER = 4096
# operations that end on their own within seconds to a minute (the daemon's or cron's backup):
# a restore or an upgrade that finds one holding the lock waits for it (``acquire(wait=...)``)
# instead of sending the operator away; anything else holding it is refused at once
CLEANUP = "leftovers cleanup"  # any command's sweep of what a killed point-in-time replay left
SHORT_OPERATIONS = frozenset({"backup", "prune", "import", CLEANUP})
SHORT_WAIT = 60.0


@dataclass(frozen=True)
class SessionOwner(Document):
    """The orchestrator driving a node session that holds the lock (``node.protocol.Owner``)."""

    command: Optional[str] = None
    host: Optional[str] = None
    pid: Optional[int] = None
    token: Optional[str] = None


@dataclass(frozen=True)
class Holder(Document):
    """The lock file's record of its holder; every field optional (the file is read as found)."""

    operation: Optional[str] = None
    pid: Optional[int] = None
    host: Optional[str] = None
    since: Optional[str] = None
    owner: Optional[SessionOwner] = None  # a node session's orchestrator
    base_revision: Optional[int] = None  # a delta watcher's chain (``delta.chains.active_base``)
    endpoint: Optional[str] = None
    text: Optional[str] = None  # an old plain-text record, or a damaged one
    start_ticks: Optional[int] = None  # ``pid``'s start (``proctime``): a reused pid is not the holder


def lock_path_for(backup_dir: str) -> str:
    return os.path.join(backup_dir, LOCK_NAME)


class OperationLock:
    """``with OperationLock(path, "backup"):`` - raises BusyError when another process holds it.

    ``holder`` is recorded in the file for the next caller's busy message (and for ``status``);
    ``wait``: what ``with`` passes to ``acquire``."""

    def __init__(self, path: str, operation: str, holder: Optional[Holder] = None, *, wait: float = 0.0) -> None:
        self.path = path
        self.operation = operation
        self.holder = holder or Holder()
        self.wait = wait
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait: float = 0.0, clock: Clock = SYSTEM_CLOCK) -> "OperationLock":
        """Take the lock, or BusyError naming its holder. ``wait`` > 0: while the holder is one of
        ``SHORT_OPERATIONS`` (this host's backup), wait up to ``wait`` seconds for it to end."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise BackupError(f"cannot open lock file {self.path}: {exc.strerror or exc}") from None
        seen: List[Holder] = []

        def take() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
            rec = read_holder_fd(fd)
            if wait > 0 and _short(rec):
                if not seen:
                    log.info("waiting up to %.0fs for %s to finish", wait, describe_holder(rec))
                seen.append(rec)
                raise NotYet(f"{describe_holder(rec)} still holds it")
            raise _HeldBy(rec)

        def busy(rec: Holder, waited: str = "") -> BusyError:
            os.close(fd)
            stale = stale_note(rec)
            return BusyError(f"busy: {describe_holder(rec) or 'another etcd-agent operation'} holds "
                             f"{self.path}{waited}; {self.operation} not started, nothing touched"
                             + (f". STALE: {stale}" if stale else ""))

        try:
            try:
                take()
            except NotYet:
                poll(take, timeout=wait, what=f"the operation lock {self.path}", interval=0.25, clock=clock)
        except _HeldBy as held:
            raise busy(held.rec) from None
        except OperationFailed:
            raise busy(seen[-1], f" (waited {wait:.0f}s for it to finish)") from None
        except OSError as exc:
            os.close(fd)
            raise BackupError(f"cannot lock {self.path}: {exc.strerror or exc}") from None
        rec = dataclasses.replace(self.holder, operation=self.operation, pid=os.getpid(), host=socket.gethostname(),
                                  since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                  start_ticks=start_ticks(os.getpid()))
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(rec.to_json(), sort_keys=True) + "\n").encode(), 0)
        self._fd = fd
        log.debug("took operation lock %s for %s", self.path, self.operation)
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> "OperationLock":
        return self.acquire(wait=self.wait)

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.release()


class _HeldBy(Exception):
    """The lock's holder is not one to wait for."""

    def __init__(self, rec: Holder) -> None:
        super().__init__("held")
        self.rec = rec


def _short(rec: Holder) -> bool:
    """The holder is this host's own backup (or prune, import): it ends by itself, soon."""
    return rec.owner is None and rec.operation in SHORT_OPERATIONS


def read_holder_fd(fd: int) -> Holder:
    """What the holder recorded (an old plain-text record or damage gives ``text``)."""
    try:
        raw = os.pread(fd, MAX_HOLDER, 0)
    except OSError:
        return Holder()
    text = raw.decode("utf-8", "replace").strip()
    if not text:
        return Holder()
    try:
        return Holder.from_json(loads(raw, max_bytes=MAX_HOLDER), "lock holder")
    except (UnsafeJson, OperationFailed):
        return Holder(text=text[:200])


def describe_holder(rec: Holder) -> str:
    """``rec`` as one phrase naming command, host, pid and since (``etcd-agent restore 2026...-ab12``
    from master1 (pid 4242) since ...); a node session's own pid when it is not the run's."""
    if rec == Holder():
        return ""
    if rec.text is not None:
        return rec.text
    owner = rec.owner or SessionOwner()
    # a sparse owner (an orchestrator that could not name itself) falls back on the lock's own record
    what = owner.command or rec.operation or "an operation"
    host = owner.host or rec.host or "an unnamed host"
    pid = owner.pid or rec.pid
    out = f"`etcd-agent {what}` from {host} (pid {pid or '?'}) since {rec.since or '?'}"
    if rec.owner is not None and rec.pid and rec.pid != pid:
        out += f", through its node session (pid {rec.pid} on {rec.host or '?'})"
    return out


def stale_note(rec: Holder) -> str:
    """Why the holder of a held lock is not a live run, and what to do; "" when it is (or cannot
    be told: a run on another host). The flock itself dies with its process, so a held lock whose
    run is gone means a process the run started still holds it: a node session whose step never
    ended (``node serve`` ends it ``STOP_GRACE`` seconds after its caller)."""
    here = socket.gethostname()
    if rec.text is not None or rec.host != here or not rec.pid:
        return ""
    if not _same_process(rec.pid, rec.start_ticks, rec.since):
        return (f"the process that took it is gone (pid {rec.pid} is gone), yet the lock is held by a process it left "
                f"behind: find it with `fuser -v {LOCK_NAME}` in the backup dir and stop it")
    owner = rec.owner
    if owner is None or owner.host != here or not owner.pid or owner.pid == rec.pid:
        return ""
    if _same_process(owner.pid, None, rec.since):
        return ""
    return (f"the run that took it is gone (pid {owner.pid} is gone); its node session (pid {rec.pid}) still holds the lock "
            f"and ends by itself within a minute; if it does not, stop it: `kill {rec.pid}` (the hosts' journals "
            "let the same command resume, or `etcd-agent restore rollback` roll back)")


def _same_process(pid: int, ticks: Optional[int], since: Optional[str]) -> bool:
    """``pid`` still runs and is the process recorded: same start ticks when recorded, else not
    started after ``since`` (a pid reused since then is another process)."""
    now_ticks = start_ticks(pid)
    if now_ticks is None:
        return False
    if ticks is not None:
        return now_ticks == ticks
    if not since:
        return True
    import calendar

    import psutil

    try:
        started = psutil.Process(pid).create_time()
        taken = calendar.timegm(time.strptime(since, "%Y-%m-%dT%H:%M:%SZ"))
    except (psutil.Error, ValueError):
        return True  # cannot tell: not named stale
    return started <= taken + 1  # ``since`` has whole seconds


def holder_of(backup_dir: str) -> Optional[Holder]:
    """The live holder of this host's lock, or None when it is free (the flock decides, not the
    file: a record left by a dead holder is not a holder)."""
    return held_by(lock_path_for(backup_dir))


def held_by(path: str) -> Optional[Holder]:
    """The live holder of the lock file ``path``, or None when it is free (or absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return read_holder_fd(fd)
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
