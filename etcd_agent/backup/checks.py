"""The check cache: which backup files had their bytes checked, and what the check found.

``backup list`` must not call a file verified because its manifest says ``verified: true`` (a
claim, copied along with every copy). A file is verified when its bytes on disk were checked: by
the writer's in-stream check of what it wrote, by ``backup verify``, or by ``backup import``. Each
result is kept in ``.etcd-agent-checks.json`` in the backup dir (0600), keyed by the file's name
and stamped with its size, mtime_ns, inode and ctime_ns: a file changed (or replaced, or copied)
since its check no longer matches its stamp and shows as unchecked until checked again.

Also the clock the backup side uses (``WallClock``): injectable, so a test can take 24 hourly
backups in a second.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Dict, Optional, Protocol, Tuple, Type, TypeVar

from etcd_agent.errors import ProtocolError
from etcd_agent.fs import dir_locked, open_regular, write_atomic
from etcd_agent.safejson import UnsafeJson, loads
from etcd_agent.typedjson import Document

log = logging.getLogger(__name__)

D = TypeVar("D", bound=Document)

CACHE = ".etcd-agent-checks.json"
MAX_CACHE = 4 << 20


class WallClock(Protocol):
    """Wall-clock time as the backup side sees it (names, ages, retention)."""

    def now(self) -> datetime: ...  # aware

    def sleep(self, seconds: float) -> None: ...


class SystemWallClock:
    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_WALL_CLOCK: WallClock = SystemWallClock()

Stamp = Tuple[int, int, int, int]


def stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def clip(doc: Document, limits: Dict[str, int]) -> None:
    """Cut the named string fields (or a tuple's strings) of a frozen ``doc`` to their lengths:
    what a record read back from a file shows stays bounded, as its previous reader cut it."""
    for name, n in limits.items():
        v = getattr(doc, name)
        if isinstance(v, str) and len(v) > n:
            object.__setattr__(doc, name, v[:n])
        elif isinstance(v, tuple) and any(isinstance(x, str) and len(x) > n for x in v):
            object.__setattr__(doc, name, tuple(x[:n] for x in v))


def check_stamp(stamp: Optional[Stamp], what: str) -> None:
    if stamp is not None and len(stamp) != 4:
        raise ProtocolError(f"{what}.stamp must hold 4 integers (size, mtime_ns, inode, ctime_ns), not {len(stamp)}")


@dataclass(frozen=True)
class Check(Document):
    """One check of one file's bytes."""

    stamp: Stamp
    ok: bool
    how: str  # "written" | "verify" | "import"
    at: float  # unix time of the check
    kind: str = "agent"  # agent | runbook
    revision: Optional[int] = None
    sha256: Optional[str] = None  # of the snapshot
    member_ids: Tuple[str, ...] = ()  # from the snapshot's db, hex
    problem: Optional[str] = None
    signature: Optional[str] = None

    def __post_init__(self) -> None:
        check_stamp(self.stamp, "Check")
        if len(self.member_ids) > 64:
            object.__setattr__(self, "member_ids", self.member_ids[:64])
        clip(self, {"how": 20, "kind": 20, "sha256": 64, "member_ids": 16, "problem": 2000, "signature": 20})


def parsed(cls: Type[D], d: object, where: str) -> Optional[D]:
    """An entry of a cache read as ``cls``; None for anything that is not one (an entry that is
    not a record counts as none: unchecked, undrilled)."""
    try:
        return cls.from_json(d, where)
    except ProtocolError as exc:
        log.debug("%s", exc.message)
        return None


def _load(directory: str) -> Dict[str, Check]:
    path = os.path.join(directory, CACHE)
    try:
        with open_regular(path) as fh:
            raw = fh.read(MAX_CACHE + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("check cache %s unreadable (%s): every backup shows as unchecked", path, exc)
        return {}
    if len(raw) > MAX_CACHE:
        log.warning("check cache %s is larger than %d bytes; ignored", path, MAX_CACHE)
        return {}
    try:
        obj = loads(raw, max_bytes=MAX_CACHE)
    except UnsafeJson:
        log.warning("check cache %s is not valid JSON; ignored", path)
        return {}
    out: Dict[str, Check] = {}
    if isinstance(obj, dict):
        for name, d in obj.items():
            c = parsed(Check, d, f"check cache {path}: {str(name)[:80]!r}")
            if c is not None and isinstance(name, str):
                out[name] = c
    return out


def load(directory: str) -> Dict[str, Check]:
    """Every recorded check (stale ones included: ``lookup`` compares stamps)."""
    return _load(directory)


def lookup(checks: Dict[str, Check], name: str, st: os.stat_result) -> Optional[Check]:
    """The check of ``name`` if it was made on exactly these bytes (same stamp)."""
    c = checks.get(name)
    return c if c is not None and c.stamp == stamp_of(st) else None


def record(directory: str, name: str, check: Check) -> None:
    """Add one check (read-modify-write under the dir's lock; entries of vanished files dropped)."""
    try:
        with dir_locked(directory):
            checks = _load(directory)
            checks[name] = check
            present = set(os.listdir(directory))
            data = {n: c.to_json() for n, c in sorted(checks.items()) if n in present}
            write_atomic(os.path.join(directory, CACHE), (json.dumps(data, indent=1) + "\n").encode(), mode=0o600)
    except OSError as exc:
        log.warning("cannot record the check of %s (%s)", name, exc)


def check_of(path: str, *, ok: bool, how: str, clock: WallClock = SYSTEM_WALL_CLOCK, **kw: Any) -> Optional[Check]:
    """A Check stamped with ``path`` as it is now (None if it vanished)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return Check(stamp=stamp_of(st), ok=ok, how=how, at=clock.now().timestamp(), **kw)
