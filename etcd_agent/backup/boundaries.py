"""Restores as boundaries in a backup dir's history, and what they hold back from retention.

A restore replaces the cluster's data: every backup taken before it is of the cluster as it was
(a rollback point, restorable with ``--new-cluster``). Each one is recorded in the backup dir
(``.etcd-agent-restores.json``, hidden: the catalogue lists no hidden file):

- by the agent's own restore, on every member's host as the member finishes (``restore.node``):
  when it began, the backup it came from (name and snapshot sha256), the data dirs it set aside;
- by the daemon, when its delta watch finds the member's data replaced (another cluster id, a
  revision behind the chain) and no restore of the agent's explains it: a restore by hand
  (``etcdutl snapshot restore``), recorded as ``detected``.

``holds`` (pure) says which backups each boundary keeps whatever retention's rules say: the
backup a restore came from, and the last backup before it - while the data dirs it set aside
are still there (``restore cleanup`` removes them), and for a restore by hand, whose set-aside
dirs the agent cannot know, for as long as the boundary is recorded. ``before`` names, for
``backup list``, the first boundary after a backup.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import ProtocolError
from ..fs import write_atomic
from ..safejson import UnsafeJson, loads
from ..typedjson import Document

log = logging.getLogger(__name__)

FILE = ".etcd-agent-restores.json"
MAX_BOUNDARIES = 50
MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Boundary(Document):
    """One restore (or a replacement of the member's data seen by the daemon) on this host."""

    op: str  # the restore's op id, or "detected-<unix ms>"
    time: float  # Unix s: when the restore began (or the daemon saw the data replaced)
    kind: str = "restore"  # restore | detected
    from_backup: Optional[str] = None  # the backup's file name, when the agent restored it
    from_sha256: Optional[str] = None  # its snapshot's sha256
    set_aside: Tuple[str, ...] = ()  # data dirs this restore set aside on this host
    cluster_id: Optional[str] = None  # the cluster after it (hex), when known
    reason: str = ""  # for a detected one: what the watch saw

    def when(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time))

    def describe(self) -> str:
        what = (f"restore {self.op} at {self.when()}" if self.kind == "restore"
                else f"the data replaced by hand, seen at {self.when()}")
        return what + (f" (from {self.from_backup})" if self.from_backup else "")


def read(directory: str) -> List[Boundary]:
    """Every boundary recorded in ``directory``, oldest first; [] when none (or unreadable: said)."""
    path = os.path.join(directory, FILE)
    try:
        with open(path, "rb") as fh:
            doc = loads(fh.read(MAX_BYTES + 1), max_bytes=MAX_BYTES)
    except FileNotFoundError:
        return []
    except (OSError, UnsafeJson) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return []
    raw = doc.get("restores") if isinstance(doc, dict) else None
    out: List[Boundary] = []
    for i, x in enumerate(raw if isinstance(raw, list) else []):
        try:
            out.append(Boundary.from_json(x, f"{FILE} entry {i}"))
        except ProtocolError as exc:
            log.warning("ignoring %s", exc.message)
    return sorted(out, key=lambda b: b.time)


def record(directory: str, b: Boundary) -> bool:
    """Add ``b``, once per op: the members of a one-host cluster share the dir, and each adds the
    data dir it set aside to the op's record. False when nothing changed. The newest
    MAX_BOUNDARIES are kept."""
    have = read(directory)
    same = next((x for x in have if x.op == b.op), None)
    if same is not None:
        merged = tuple(sorted(set(same.set_aside) | set(b.set_aside)))
        if merged == tuple(sorted(same.set_aside)):
            return False
        have = [dataclasses.replace(x, set_aside=merged) if x is same else x for x in have]
    else:
        have.append(b)
    keep = sorted(have, key=lambda x: x.time)[-MAX_BOUNDARIES:]
    doc = {"restores": [x.to_json() for x in keep]}
    write_atomic(os.path.join(directory, FILE), (json.dumps(doc, indent=1) + "\n").encode(), mode=0o600)
    return True


def recorded_since(directory: str, since: float) -> Optional[Boundary]:
    """The newest boundary recorded at or after ``since`` (Unix s), or None."""
    later = [b for b in read(directory) if b.time >= since]
    return later[-1] if later else None


# ---------------------------------------------------------------- pure


@dataclass(frozen=True)
class Held:
    """A backup a boundary keeps, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class BackupAt:
    name: str
    time: float  # Unix s
    snapshot_sha256: Optional[str] = None


def holds(boundaries: Sequence[Boundary], backups: Sequence[BackupAt],
          exists: Callable[[str], bool]) -> List[Held]:
    """What each boundary keeps: the backup it came from (found by name, or by its snapshot's
    sha256 when the file was renamed) and the last backup before it (while its set-aside data
    dirs exist: ``exists``; always for one seen by the daemon)."""
    out: List[Held] = []
    for b in boundaries:
        came = [x for x in backups if b.from_backup and x.name == b.from_backup]
        if not came and b.from_sha256:
            came = [x for x in backups if x.snapshot_sha256 == b.from_sha256]
        for x in came[:1]:
            out.append(Held(x.name, f"the backup {b.describe()} came from"))
        before = sorted((x for x in backups if x.time < b.time), key=lambda x: (x.time, x.name))
        if not before:
            continue
        last = before[-1]
        if b.kind == "detected":
            out.append(Held(last.name, f"the last backup before {b.describe()}"))
            continue
        aside = [p for p in b.set_aside if exists(p)]
        if aside:
            out.append(Held(last.name, f"the last backup before {b.describe()}, kept while its set-aside data "
                                       f"dir(s) exist ({', '.join(aside)}; `restore cleanup` removes them)"))
    return out


def before(boundaries: Sequence[Boundary], t: float) -> Optional[Boundary]:
    """The first boundary after a backup taken at ``t``: the backup is of the cluster before it."""
    later = [b for b in boundaries if b.time > t]
    return min(later, key=lambda b: b.time) if later else None


def by_name(held: Sequence[Held]) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for h in held:
        out.setdefault(h.name, []).append(h.reason)
    return out
