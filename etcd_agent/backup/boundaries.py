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

The record fails closed. It is opened as a regular file only (a FIFO there once hung every
``backup list``, ``prune`` and the daemon's tick holding the operation lock), bounded, and every
value checked through ``Boundary.from_json`` (a time of 1e300 ended them in an OverflowError).
``load`` says what could not be read; retention then deletes nothing (``service.prune_backups``)
until the operator repairs or removes the file, and ``record`` refuses to overwrite it (what it
held would be lost). Writes are read-modify-write under the backup dir's own lock
(``fs.dir_locked``): the daemon's ``detected`` record and a restore's, at the same moment, both
stay. A point-in-time restore records the full backup it started from, the chain and the target
revision, never the throwaway replay it shipped (``restore.node``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from etcd_agent.errors import AgentError, BackupError, ProtocolError
from etcd_agent.fs import dir_locked, open_regular, write_atomic
from etcd_agent.safejson import UnsafeJson, loads
from etcd_agent.typedjson import Document

log = logging.getLogger(__name__)

FILE = ".etcd-agent-restores.json"
MAX_BOUNDARIES = 50
MAX_BYTES = 1 << 20
# a boundary's time: a restore the agent could have run (2000-01-01 .. 2200-01-01, Unix s)
TIME_RANGE = (946684800.0, 7258118400.0)


class RecordUnreadable(BackupError):
    """The restore record exists but cannot be read whole: retention holds, nothing is written."""


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
    chain_id: Optional[str] = None  # a point-in-time restore: the delta chain replayed onto from_backup
    to_revision: Optional[int] = None  # ... and the revision it was replayed to

    RANGES = {"time": TIME_RANGE, "to_revision": (0.0, float(1 << 63))}

    def when(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time))

    def describe(self) -> str:
        what = (f"restore {self.op} at {self.when()}" if self.kind == "restore"
                else f"the data replaced by hand, seen at {self.when()}")
        src = f"{self.from_backup} + its delta chain to revision {self.to_revision}" if self.to_revision is not None \
            else self.from_backup
        return what + (f" (from {src})" if self.from_backup else "")


@dataclass(frozen=True)
class RestoreRecord(Document):
    """The file as written: ``{"restores": [...]}``. Its entries are read one by one as
    ``Boundary`` (``load``): one that does not read is named, the others still count."""

    restores: Tuple[Any, ...]

    ERROR = RecordUnreadable


@dataclass(frozen=True)
class Record:
    """The record as read: the boundaries that could be read, and what could not (None: all)."""

    boundaries: List[Boundary]
    problem: Optional[str] = None


def load(directory: str) -> Record:
    """The record in ``directory``; no file is an empty record. Never raises for its content: a
    record that cannot be read whole says why in ``problem`` (one line naming the file)."""
    path = os.path.join(directory, FILE)
    try:
        with open_regular(path) as fh:
            doc = loads(fh.read(MAX_BYTES + 1), max_bytes=MAX_BYTES)
        raw = RestoreRecord.from_json(doc, f"{path} is not a restore record").restores
    except FileNotFoundError:
        return Record([])
    except OSError as exc:
        return Record([], f"{path} cannot be read: {exc.strerror or exc}")
    except UnsafeJson as exc:
        return Record([], f"{path} is not a restore record: {exc}")
    except RecordUnreadable as exc:
        return Record([], exc.message)
    out: List[Boundary] = []
    bad: List[str] = []
    for i, x in enumerate(raw):
        try:
            out.append(Boundary.from_json(x, f"entry {i}"))
        except ProtocolError as exc:
            bad.append(exc.message)
    problem = f"{path} has {len(bad)} unreadable entr{'y' if len(bad) == 1 else 'ies'}: {bad[0]}" if bad else None
    return Record(sorted(out, key=lambda b: b.time), problem)


def read(directory: str) -> List[Boundary]:
    """The boundaries that can be read, oldest first (for listings; retention uses ``load``)."""
    rec = load(directory)
    if rec.problem:
        log.warning("%s", rec.problem)
    return rec.boundaries


def unreadable_message(problem: str) -> str:
    """What an unreadable record means for retention, and the fix: one sentence."""
    return (f"the restore record is unreadable ({problem}): prune deletes nothing until it is repaired, "
            f"or moved away once you know which backups it protected")


def record(directory: str, b: Boundary) -> bool:
    """Add ``b``, once per op: the members of a one-host cluster share the dir, and each adds the
    data dir it set aside to the op's record. False when nothing changed. The newest
    MAX_BOUNDARIES are kept. Under the dir's lock: concurrent writers (the daemon, a restore's
    members) all land. RecordUnreadable when the record cannot be read whole."""
    with dir_locked(directory):
        rec = load(directory)
        if rec.problem:
            # said with what it would have recorded: the operator repairing the file can add it
            raise RecordUnreadable(f"{b.describe()} not recorded: {unreadable_message(rec.problem)}")
        have = rec.boundaries
        same = next((x for x in have if x.op == b.op), None)
        if same is not None:
            merged = tuple(sorted(set(same.set_aside) | set(b.set_aside)))
            if merged == tuple(sorted(same.set_aside)):
                return False
            have = [dataclasses.replace(x, set_aside=merged) if x is same else x for x in have]
        else:
            have.append(b)
        keep = sorted(have, key=lambda x: x.time)[-MAX_BOUNDARIES:]
        doc = RestoreRecord(tuple(x.to_json() for x in keep)).to_json()
        write_atomic(os.path.join(directory, FILE), (json.dumps(doc, indent=1) + "\n").encode(), mode=0o600)
    return True


# ``pitr.prepare.Prepared.kept_name`` (a replay's db), ``pitr.members.record_path`` (a tail's record)
REPLAY_RE = re.compile(r"^(?P<full>.+)\.to-(?P<revision>\d{1,19})\.(?:db|tail)$")


def source_of(backup: str, sha256: Optional[str]) -> Tuple[Optional[str], Optional[str], Optional[int]]:
    """What a restore of ``backup`` (the path its journal names) came from: (the backup's name,
    its snapshot's sha256, the revision a point-in-time restore replayed to). A point-in-time
    restore ships a throwaway replay, ``<full backup>.to-<revision>.db``, or names the record of a
    tail loaded into the members, ``<full backup>.to-<revision>.tail`` (it ships a checkpoint or
    the full backup): it came from the full backup and its chain, whose sha256 the shipped bytes
    need not be."""
    name = os.path.basename(backup) or None
    m = REPLAY_RE.match(name or "")
    if m is None:
        return name, sha256, None
    return m.group("full"), None, int(m.group("revision"))


# (directory, full backup, op) -> its chain's id, as the last restore asked it in this process
_CHAIN_OF: Dict[Tuple[str, str, str], Optional[str]] = {}


def chain_of(directory: str, full: str, op: str = "") -> Optional[str]:
    """The id of the delta chain continuing backup ``full`` in ``directory`` (None: not here).
    ``op``: the restore asking; its answer is kept for that op (the last one only): the members
    of one host finish one after another, and each scan reads every segment's header and footer
    (0.15-0.4 s a member at a 600,000-event chain on a busy machine, three times on a host of
    three members, where it is the chain of the same full backup each time)."""
    from etcd_agent.backup.catalog import entry_for
    from etcd_agent.chain import chains

    key = (directory, full, op)
    if op and key in _CHAIN_OF:
        return _CHAIN_OF[key]
    try:
        e = entry_for(os.path.join(directory, full))
        c = chains.scan(directory).for_full(e.revision, e.base) if e.revision is not None else None
        got = (c.chain_id or None) if c is not None else None
    except (OSError, AgentError) as exc:  # not kept: the next member tries again
        log.info("the chain of %s not recorded: %s", full, exc)
        return None
    if op:
        _CHAIN_OF.clear()
        _CHAIN_OF[key] = got
    return got


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
