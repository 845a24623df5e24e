"""Data dirs a restore sets aside (``<data dir>.pre-restore-<time>``, ``.failed-restore-<time>``):
their names, and ``restore cleanup``'s removal of all but the newest ``keep`` on this host."""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import List, Sequence

from etcd_agent.node.replies import CleanupReply, Decision

log = logging.getLogger(__name__)


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def free_name(base: str, tag: str) -> str:
    """``<base>.<tag>-<UTC time>``, with ``.2``, ``.3`` ... when that name is taken."""
    target = f"{base}.{tag}-{_stamp()}"
    n = 1
    while os.path.lexists(target if n == 1 else f"{target}.{n}"):
        n += 1
    return target if n == 1 else f"{target}.{n}"


def cleanup_set_aside(data_dir: str, member: str, keep: int, dry_run: bool) -> CleanupReply:
    """Remove this member's set-aside data dirs but the newest ``keep`` (``dry_run``: report only)."""
    parent = os.path.dirname(data_dir) or "/"
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        entries = []
    decisions = cleanup_plan(data_dir, entries, keep)
    removed = []
    for d in decisions:
        if not d.keep and not dry_run:
            shutil.rmtree(d.path)
            removed.append(d.path)
            log.info("removed %s: %s", d.path, d.reason)
    return CleanupReply(member=member, dry_run=dry_run, removed=tuple(removed),
                        decisions=tuple(Decision(d.path, d.keep, d.reason) for d in decisions))


ASIDE_TAGS = ("pre-restore", "failed-restore")


ASIDE_RE = re.compile(r"^(?P<base>.+)\.(?P<tag>pre-restore|failed-restore)-(?P<stamp>\d{8}T\d{6}Z)(?:\.(?P<n>\d+))?$")


@dataclass(frozen=True)
class AsideDecision:
    path: str
    keep: bool
    reason: str


def cleanup_plan(data_dir: str, entries: Sequence[str], keep: int) -> List[AsideDecision]:
    """Which set-aside dirs of ``data_dir`` (names in its parent) to keep: the newest ``keep``."""
    base = data_dir.rstrip("/")
    parent, name = base.rsplit("/", 1) if "/" in base else (".", base)
    found = []
    for e in entries:
        m = ASIDE_RE.match(e)
        if m and m.group("base") == name:
            found.append((m.group("stamp"), int(m.group("n") or 1), e, m.group("tag")))
    found.sort(reverse=True)
    out = []
    for i, (stamp, _n, e, tag) in enumerate(found):
        path = f"{parent}/{e}"
        if i < keep:
            out.append(AsideDecision(path, True, f"{tag} from {stamp}: among the newest {keep}"))
        else:
            out.append(AsideDecision(path, False, f"{tag} from {stamp}: older than the newest {keep}"))
    return out
