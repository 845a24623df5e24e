"""File-system helpers every part of the agent uses: atomic writes, private dirs, bounded reads.

Every file and directory the agent creates gets an explicit mode, whatever the process umask: a
restore run from a shell with ``umask 000`` must not leave a conf dir another local user can swap
files in.
"""
from __future__ import annotations

import logging
import os
import tempfile

log = logging.getLogger(__name__)


def write_atomic(path: str, data: bytes, *, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename (+ fsync of the dir)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_private_dir(directory: str) -> None:
    """``directory`` exists and is 0700 (created so, tightened if found looser)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_mode & 0o077:
        log.warning("dir %s had mode %o; tightening to 0700", directory, st.st_mode & 0o777)
        os.chmod(directory, 0o700)
