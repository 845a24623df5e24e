"""What a throwaway etcd's owner left when it was killed: the dir and the etcd still running in it.

A drill or a point-in-time replay killed with -9 (or a power cut of the agent alone) cannot stop
the scratch member it started: that etcd keeps its ports, its CPU share and its deleted files
forever. The next run of the same kind, holding the same host lock, calls ``remove_left`` (for a
replay: also the next command of any kind, ``pitr.workdirs.clean``; ``status`` reports them till then): every
etcd process whose working directory is one of those dirs or below (``ScratchEtcd`` starts etcd
in its own dir) is stopped by escalation, then the dir is removed. A process is matched by its
working directory and its executable's name, never by a pid someone wrote down, so a reused pid
cannot be hit.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import TYPE_CHECKING, List, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import psutil

log = logging.getLogger(__name__)

TERM_WAIT = 15.0
KILL_WAIT = 10.0


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def etcds_in(tops: Sequence[str]) -> "List[psutil.Process]":
    """Every etcd running in one of ``tops`` (or below)."""
    import psutil

    if not tops:
        return []
    found: List["psutil.Process"] = []
    for p in psutil.process_iter(["cwd", "exe", "name"]):
        try:
            cwd = p.info["cwd"] or ""
            exe = os.path.basename(p.info["exe"] or p.info["name"] or "")
        except (psutil.Error, OSError):
            continue
        if exe.startswith("etcd") and any(_under(cwd, t) for t in tops):
            found.append(p)
    return found


def stop_etcds_in(tops: Sequence[str]) -> List[int]:
    """Stop every etcd running in one of ``tops`` (or below); the pids stopped."""
    import psutil

    found = etcds_in(tops)
    for p in found:
        log.warning("stopping etcd pid %d left running in %s by a run that died", p.pid, p.info["cwd"])
    for p in found:
        try:
            p.terminate()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(found, timeout=TERM_WAIT)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=KILL_WAIT)
    return [p.pid for p in found]


def left_dirs(parent: str, prefixes: Sequence[str]) -> List[str]:
    """The dirs of ``parent`` named with one of ``prefixes`` (a symlink or a file of that name is
    not one: this never follows a link); [] when ``parent`` is absent."""
    try:
        names = sorted(os.listdir(parent))
    except FileNotFoundError:
        return []
    tops = [os.path.join(parent, n) for n in names if n.startswith(tuple(prefixes))]
    return [t for t in tops if os.path.isdir(t) and not os.path.islink(t)]


def remove_left(parent: str, prefixes: Sequence[str]) -> List[str]:
    """Remove ``left_dirs(parent, prefixes)``, after stopping the etcds running in them; the names
    removed. Call it holding the lock of the kind of run that makes them."""
    tops = left_dirs(parent, prefixes)
    stop_etcds_in(tops)
    for t in tops:
        shutil.rmtree(t, ignore_errors=True)
    return [os.path.basename(t) for t in tops]
