"""The operation lock: one backup/restore at a time on this machine, and its forked holder.

A non-blocking ``flock`` on a file: the kernel drops it when the holder dies (even by kill -9),
so a crashed run never leaves a stale lock behind. Busy means: say who holds it and touch nothing.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from types import TracebackType
from typing import Any, Dict, Optional, Type

from ..config import Config
from ..errors import BackupError, BusyError, OperationFailed
from ..fs import ensure_private_dir, write_atomic

log = logging.getLogger(__name__)

LOCK_NAME = ".etcd-agent.lock"
LOCK_IDLE_TTL = 900.0  # a restore's lock holder gives up this long after the op's last step


def lock_path_for(backup_dir: str) -> str:
    return os.path.join(backup_dir, LOCK_NAME)


class OperationLock:
    """``with OperationLock(path, "backup"):`` - raises BusyError when another process holds it."""

    def __init__(self, path: str, operation: str) -> None:
        self.path = path
        self.operation = operation
        self._fd: Optional[int] = None

    def acquire(self) -> "OperationLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise BackupError(f"cannot open lock file {self.path}: {exc.strerror or exc}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise BusyError(
                    f"busy: another etcd-agent operation holds {self.path}"
                    + (f" ({holder})" if holder else "")
                    + f"; {self.operation} not started, nothing touched"
                )
            raise BackupError(f"cannot lock {self.path}: {exc.strerror or exc}")
        # Record the holder for the busy message of the next one; purely informative.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} {self.operation}\n".encode(), 0)
        self._fd = fd
        log.debug("took operation lock %s for %s", self.path, self.operation)
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> "OperationLock":
        return self.acquire()

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


# ---------------------------------------------------------------- the host's operation lock


def _marker(cfg: Config, op: str, kind: str) -> str:
    return os.path.join(cfg.backup.dir, f".etcd-agent-restore-{op}.{kind}")


def touch_alive(cfg: Config, op: str) -> None:
    """Every step of an op refreshes its lock holder's idle timer."""
    path = _marker(cfg, op, "alive")
    if os.path.exists(path):
        os.utime(path)


def lock(cfg: Config, op: str, idle_ttl: float = LOCK_IDLE_TTL) -> Dict[str, Any]:
    """Take this host's operation lock for restore ``op`` and keep it after this process exits.

    A forked holder inherits the flock'd descriptor and stays (its own session, stdio closed) until
    ``unlock`` or ``idle_ttl`` seconds without a step of this op; the kernel drops the lock when it
    dies. The same op taking it again (a resumed restore) finds it held and adopts it.
    """
    ensure_private_dir(cfg.backup.dir)
    path = lock_path_for(cfg.backup.dir)
    lk = OperationLock(path, f"restore {op}")
    try:
        lk.acquire()
    except BusyError:
        with open(path, encoding="utf-8", errors="replace") as fh:
            holder = fh.read()
        if f"restore {op}" in holder:
            touch_alive(cfg, op)
            return {"lock": path, "held": "already, by this restore"}
        raise
    fd = lk._fd  # the holder keeps this descriptor (and with it the flock)
    assert fd is not None
    for kind in ("release",):
        try:
            os.unlink(_marker(cfg, op, kind))
        except FileNotFoundError:
            pass
    write_atomic(_marker(cfg, op, "alive"), b"", mode=0o600)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the holder; exercised by the integration tests
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for n in (0, 1, 2):
                os.dup2(devnull, n)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} restore {op}\n".encode(), 0)
            _hold(cfg, op, idle_ttl)
        finally:
            os._exit(0)
    os.close(fd)  # the child's copy keeps the lock
    lk._fd = None
    return {"lock": path, "held": "taken", "holder_pid": pid}


def _hold(cfg: Config, op: str, idle_ttl: float) -> None:
    release, alive = _marker(cfg, op, "release"), _marker(cfg, op, "alive")
    while True:
        if os.path.exists(release):
            return
        try:
            idle = time.time() - os.stat(alive).st_mtime
        except FileNotFoundError:
            return
        if idle > idle_ttl:
            return
        time.sleep(0.2)


def unlock(cfg: Config, op: str) -> Dict[str, Any]:
    """Tell the holder of ``op`` to let go, and wait until the lock is free."""
    path = lock_path_for(cfg.backup.dir)
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            holder = fh.read()
    except FileNotFoundError:
        return {"lock": path, "released": "no lock file"}
    if f"restore {op}" not in holder:
        return {"lock": path, "released": "not held by this restore"}
    write_atomic(_marker(cfg, op, "release"), b"", mode=0o600)
    deadline = time.monotonic() + 10
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise OperationFailed(f"lock {path} still held after release of restore {op}")
                time.sleep(0.1)
    finally:
        os.close(fd)
    for kind in ("release", "alive"):
        try:
            os.unlink(_marker(cfg, op, kind))
        except FileNotFoundError:
            pass
    return {"lock": path, "released": True}
