"""Where a restore drill runs on this host: its dir, what a dead drill left there, its priority.

``[drill] dir`` is made 0711 (the drill's etcd user must traverse it to reach the throwaway
member's own 0700 dir, and may list nothing) and must be the agent's own: a drill removes what it
finds there. ``sweep`` removes what a drill killed on the way left (its staging dir, its scratch
dir, and the etcd still running in it, found by working directory and executable name, stopped by
escalation); call it with the host's drill lock held. ``lowered_priority`` runs the drill's own
work at its nice/ionice: both are per thread on Linux, so the daemon's drill thread lowers itself
alone, and what it starts inherits them.
"""
from __future__ import annotations

import contextlib
import logging
import os
import stat
from typing import Iterator, List

from etcd_agent.errors import RefusedError
from etcd_agent.fs import makedirs
from etcd_agent.scratch.leftovers import remove_left

log = logging.getLogger(__name__)

LOCK = ".drill.lock"
STAGE_PREFIX = ".stage-"
SCRATCH_PREFIX = "etcd-scratch-"  # delta.scratch's private dirs


@contextlib.contextmanager
def lowered_priority(nice: int, ionice: str) -> Iterator[None]:
    """This thread (Linux: nice and ionice are per thread) at ``nice``/``ionice`` for the block;
    what it starts inherits both. Put back afterwards where allowed (root), so a drill run inside
    a test or a CLI call does not leave its caller slowed."""
    import psutil

    tid = _thread_id()
    try:
        old_nice = os.getpriority(os.PRIO_PROCESS, tid)
        proc = psutil.Process(tid)
        old_io = proc.ionice()
    except (OSError, psutil.Error):
        yield
        return
    try:
        if nice > old_nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        if ionice == "idle":
            proc.ionice(psutil.IOPRIO_CLASS_IDLE)
        elif ionice.startswith("best-effort:"):
            proc.ionice(psutil.IOPRIO_CLASS_BE, int(ionice.split(":", 1)[1]))
    except (OSError, psutil.Error, ValueError) as exc:
        log.warning("could not lower the drill's own priority: %s", exc)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, psutil.Error, ValueError):
            os.setpriority(os.PRIO_PROCESS, tid, old_nice)
            cls = old_io.ioclass
            proc.ionice(cls, old_io.value if cls in (psutil.IOPRIO_CLASS_BE, psutil.IOPRIO_CLASS_RT) else None)


def _thread_id() -> int:
    import threading

    return threading.get_native_id()


def prepare_dir(path: str) -> None:
    """``[drill] dir``: created 0711 (the etcd user must traverse it to reach its own 0700 dir,
    and may list nothing); an existing one must be ours and writable by nobody else, since what
    a drill finds there it removes."""
    try:
        if makedirs(path, 0o711):
            return
        st = os.lstat(path)
    except OSError as exc:
        if os.path.lexists(path) and not os.path.isdir(path):
            raise RefusedError(f"the drill dir {path} exists and is not a directory") from None
        raise RefusedError(f"cannot create the drill dir {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RefusedError(f"the drill dir {path} exists and is not a directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RefusedError(
            f"the drill dir {path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}: it must be "
            f"the agent's own and writable by nobody else (a drill removes what it finds there); configure a new one"
        )


def sweep(path: str) -> List[str]:
    """What a drill that died left in ``path`` (call with the host's drill lock held): a staging
    dir, a scratch dir and the etcd still running in it (``delta.leftovers``)."""
    return remove_left(path, (STAGE_PREFIX, SCRATCH_PREFIX))
