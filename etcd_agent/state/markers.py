"""Markers in the daemon's state dir that tell it to keep its hands off a member.

- **restore in progress**: ``node begin`` writes ``<[daemon] state_dir>/restore-in-progress-<member>.json`` (op id, backup,
start time) before anything is touched; ``finish`` and ``rollback`` remove it. A restore that
crashed leaves it in place, so the daemon waits until an operator resumes or rolls back instead
of restarting or replacing a member the restore stopped on purpose. One file per member: the
demo runs several members on one host and their steps run in parallel.
- **upgrade in progress**: ``upgrade-in-progress-<member>.json`` (pid and start time of the
  stepping process) while a rolling upgrade steps the member; stale once that process is gone.
- **left on purpose**: ``<member>.left`` after ``etcd-agent leave``: the daemon does not join the
  member back until ``etcd-agent join``.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import List, Optional

from etcd_agent.config import Config
from etcd_agent.errors import ProtocolError
from etcd_agent.fs import makedirs, write_atomic
from etcd_agent.proctime import start_ticks
from etcd_agent.safejson import loads
from etcd_agent.typedjson import Document

log = logging.getLogger(__name__)

RESTORE_PREFIX = "restore-in-progress-"
MAX_MARKER = 65536


def restore_marker_path(cfg: Config, member: str) -> str:
    return os.path.join(cfg.daemon.state_dir, f"{RESTORE_PREFIX}{member}.json")


@dataclass(frozen=True)
class RestoreMarker(Document):
    """``restore-in-progress-<member>.json``, read as found: every field may be absent."""

    op: Optional[str] = None
    member: Optional[str] = None
    backup: Optional[str] = None
    pid: Optional[int] = None
    started: Optional[str] = None
    error: Optional[str] = None  # why the file could not be read (it still pauses the daemon)


def write_restore(cfg: Config, member: str, op: str, backup: str) -> str:
    """Mark ``member`` as being restored (kept when it exists for the same op: a resume)."""
    path = restore_marker_path(cfg, member)
    cur = read_restore(cfg, member)
    if cur is not None and cur.op == op:
        return path
    makedirs(cfg.daemon.state_dir, 0o700)
    _write(path, RestoreMarker(op, member, backup, os.getpid(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    log.info("%s: daemon paused by restore %s (%s)", member, op, path)
    return path


def clear_restore(cfg: Config, member: str, op: Optional[str] = None) -> bool:
    """Remove the marker (only ``op``'s, when given); True when one was removed."""
    cur = read_restore(cfg, member)
    if cur is None or (op is not None and cur.op not in (op, None)):
        return False
    try:
        os.unlink(restore_marker_path(cfg, member))
    except FileNotFoundError:
        return False
    log.info("%s: restore marker removed; the daemon resumes", member)
    return True


def read_restore(cfg: Config, member: str) -> Optional[RestoreMarker]:
    """The marker of ``member``; an unreadable one still counts as a restore in progress."""
    path = restore_marker_path(cfg, member)
    try:
        return RestoreMarker.from_json(_read(path), f"marker {path}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, ProtocolError) as exc:
        # fail closed: a damaged marker must pause the daemon as well as a good one
        return RestoreMarker(op="?", member=member, backup="?", error=_why(path, exc))


def _read(path: str) -> object:
    with open(path, "rb") as fh:
        return loads(fh.read(MAX_MARKER + 1), max_bytes=MAX_MARKER)


def _why(path: str, exc: Exception) -> str:
    return exc.message if isinstance(exc, ProtocolError) else f"unreadable marker {path}: {exc}"


def _write(path: str, rec: Document) -> None:
    write_atomic(path, (json.dumps(rec.to_json(), sort_keys=True) + "\n").encode(), mode=0o600)


def read_restores(cfg: Config) -> List[RestoreMarker]:
    """Every marker of this host's state dir (``status`` shows them)."""
    try:
        names = sorted(os.listdir(cfg.daemon.state_dir))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    out = []
    for n in names:
        if n.startswith(RESTORE_PREFIX) and n.endswith(".json"):
            rec = read_restore(cfg, n[len(RESTORE_PREFIX):-len(".json")])
            if rec is not None:
                out.append(rec)
    return out


def restore_hint(rec: RestoreMarker) -> str:
    """The two commands that end a restore left open."""
    backup = rec.backup or "<the same backup>"
    return (f"`etcd-agent restore --from {backup} --yes` resumes it, "
            "`etcd-agent restore rollback` rolls every member back (refused once a member has finished it)")


# ---------------------------------------------------------------- "left on purpose" mark


def left_path(cfg: Config, member: str) -> str:
    return os.path.join(cfg.daemon.state_dir, f"{member}.left")


def mark_left(cfg: Config, member: str) -> None:
    """Remember that ``member`` left the cluster on purpose (`leave`): the daemon then waits
    instead of joining it again."""
    makedirs(cfg.daemon.state_dir, 0o700)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_atomic(left_path(cfg, member), f"left {stamp}\n".encode(), mode=0o600)


def clear_left(cfg: Config, member: str) -> None:
    try:
        os.unlink(left_path(cfg, member))
    except FileNotFoundError:
        pass


def has_left(cfg: Config, member: str) -> bool:
    return os.path.exists(left_path(cfg, member))


# ---------------------------------------------------------------- "upgrade in progress" marker

UPGRADE_PREFIX = "upgrade-in-progress-"


def upgrade_marker_path(cfg: Config, member: str) -> str:
    return os.path.join(cfg.daemon.state_dir, f"{UPGRADE_PREFIX}{member}.json")


def _process_started(pid: int) -> Optional[float]:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


@dataclass(frozen=True)
class UpgradeMarker(Document):
    """``upgrade-in-progress-<member>.json``, read as found: every field may be absent."""

    member: Optional[str] = None
    version: Optional[str] = None
    previous: Optional[str] = None
    pid: Optional[int] = None
    pid_started: Optional[float] = None  # wall-clock start of ``pid`` (what older agents compare)
    pid_start_ticks: Optional[int] = None  # its start in clock ticks since boot (``proctime``)
    started: Optional[str] = None
    error: Optional[str] = None  # why the file could not be read (it still pauses the daemon)


def mark_upgrading(cfg: Config, member: str, version: str, previous: str) -> str:
    """Pause the daemon for ``member`` while this process steps it to ``version``."""
    makedirs(cfg.daemon.state_dir, 0o700)
    pid = os.getpid()
    path = upgrade_marker_path(cfg, member)
    _write(path, UpgradeMarker(member, version, previous, pid, _process_started(pid), start_ticks(pid),
                               time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    log.info("%s: daemon paused while upgrading to %s (%s)", member, version, path)
    return path


def clear_upgrading(cfg: Config, member: str) -> None:
    try:
        os.unlink(upgrade_marker_path(cfg, member))
    except FileNotFoundError:
        return
    log.info("%s: upgrade marker removed; the daemon resumes", member)


def upgrading(cfg: Config, member: str) -> Optional[UpgradeMarker]:
    """The live upgrade marker of ``member``, or None (absent, or its process is gone).

    An unreadable or malformed marker counts as live (fail closed): the daemon waits and says
    which file to remove, rather than restarting a member an upgrade may have stopped on purpose.
    """
    path = upgrade_marker_path(cfg, member)
    try:
        rec = UpgradeMarker.from_json(_read(path), f"marker {path}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, ProtocolError) as exc:
        return UpgradeMarker(member=member, version="?", error=_why(path, exc))
    pid, began, ticks = rec.pid, rec.pid_started, rec.pid_start_ticks
    started = _process_started(pid) if pid is not None else None
    alive = started is not None
    if pid is not None and started is not None and ticks is not None:
        alive = start_ticks(pid) == ticks  # not a recycled pid, whatever the clock did (proctime)
    elif started is not None and began is not None:
        alive = abs(started - began) < 1.0  # a marker of an older agent: wall-clock times only
    if not alive:
        # the step died (killed, host rebooted): removed once, so the warning is not repeated
        log.warning("%s: stale upgrade marker %s (process %s is gone); removing it", member, path, pid)
        try:
            os.unlink(path)
        except OSError:
            pass
        return None
    return rec
