"""The operation lock: one backup/restore at a time on this machine.

A non-blocking ``flock`` on a file: the kernel drops it when the holder dies (even by kill -9),
so a crashed run never leaves a stale lock behind. Busy means: say who holds it and touch nothing.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
from types import TracebackType
from typing import Optional, Type

from ..errors import BackupError, BusyError

log = logging.getLogger(__name__)

LOCK_NAME = ".etcd-agent.lock"


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
