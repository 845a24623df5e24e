"""The "restore in progress" marker in the daemon's state dir: the daemon keeps its hands off.

``node begin`` writes ``<[daemon] state_dir>/restore-in-progress-<member>.json`` (op id, backup,
start time) before anything is touched; ``finish`` and ``rollback`` remove it. A restore that
crashed leaves it in place, so the daemon waits until an operator resumes or rolls back instead
of restarting or replacing a member the restore stopped on purpose. One file per member: the
demo runs several members on one host and their steps run in parallel.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, List, Optional

from ..config import Config
from ..hosts.local import write_atomic

log = logging.getLogger(__name__)

PREFIX = "restore-in-progress-"


def marker_path(cfg: Config, member: str) -> str:
    return os.path.join(cfg.daemon.state_dir, f"{PREFIX}{member}.json")


def write(cfg: Config, member: str, op: str, backup: str) -> str:
    """Mark ``member`` as being restored (kept when it exists for the same op: a resume)."""
    path = marker_path(cfg, member)
    cur = read(cfg, member)
    if cur is not None and cur.get("op") == op:
        return path
    os.makedirs(cfg.daemon.state_dir, mode=0o700, exist_ok=True)
    rec = {"op": op, "member": member, "backup": backup, "pid": os.getpid(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_atomic(path, (json.dumps(rec, sort_keys=True) + "\n").encode(), mode=0o600)
    log.info("%s: daemon paused by restore %s (%s)", member, op, path)
    return path


def clear(cfg: Config, member: str, op: Optional[str] = None) -> bool:
    """Remove the marker (only ``op``'s, when given); True when one was removed."""
    cur = read(cfg, member)
    if cur is None or (op is not None and cur.get("op") not in (op, None)):
        return False
    try:
        os.unlink(marker_path(cfg, member))
    except FileNotFoundError:
        return False
    log.info("%s: restore marker removed; the daemon resumes", member)
    return True


def read(cfg: Config, member: str) -> Optional[Dict[str, Any]]:
    """The marker of ``member``; an unreadable one still counts as a restore in progress."""
    path = marker_path(cfg, member)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        # fail closed: a damaged marker must pause the daemon as well as a good one
        return {"op": "?", "member": member, "backup": "?", "error": f"unreadable marker {path}: {exc}"}
    return data if isinstance(data, dict) else {"op": "?", "member": member, "backup": "?"}


def read_all(cfg: Config) -> List[Dict[str, Any]]:
    """Every marker of this host's state dir (``status`` shows them)."""
    try:
        names = sorted(os.listdir(cfg.daemon.state_dir))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    out = []
    for n in names:
        if n.startswith(PREFIX) and n.endswith(".json"):
            rec = read(cfg, n[len(PREFIX):-len(".json")])
            if rec is not None:
                out.append(rec)
    return out


def resume_hint(rec: Dict[str, Any]) -> str:
    """The two commands that end a restore left open."""
    backup = rec.get("backup") or "<the same backup>"
    return (f"`etcd-agent restore --from {backup} --yes` resumes it, "
            "`etcd-agent restore rollback` rolls every member back")
