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

import fcntl
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Dict, Optional, Protocol, Tuple

from etcd_agent.fs import open_regular, write_atomic
from etcd_agent.safejson import loads

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Check:
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

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["stamp"] = list(self.stamp)
        d["member_ids"] = list(self.member_ids)
        return d

    @classmethod
    def from_json(cls, d: Any) -> Optional["Check"]:
        try:
            st = d["stamp"]
            stamp = (int(st[0]), int(st[1]), int(st[2]), int(st[3]))
            return cls(
                stamp=stamp, ok=bool(d["ok"]), how=str(d["how"])[:20], at=float(d["at"]), kind=str(d.get("kind", "agent"))[:20],
                revision=int(d["revision"]) if d.get("revision") is not None else None,
                sha256=str(d["sha256"])[:64] if d.get("sha256") else None,
                member_ids=tuple(str(x)[:16] for x in d.get("member_ids", [])[:64]),
                problem=str(d["problem"])[:2000] if d.get("problem") else None,
                signature=str(d["signature"])[:20] if d.get("signature") else None,
            )
        except (KeyError, TypeError, ValueError, IndexError):
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
    except (ValueError, UnicodeDecodeError, RecursionError):
        log.warning("check cache %s is not valid JSON; ignored", path)
        return {}
    out: Dict[str, Check] = {}
    if isinstance(obj, dict):
        for name, d in obj.items():
            c = Check.from_json(d)
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
    """Add one check (read-modify-write under a lock; entries of vanished files dropped)."""
    lock = os.path.join(directory, CACHE + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        log.warning("cannot record the check of %s (%s)", name, exc)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        checks = _load(directory)
        checks[name] = check
        present = set(os.listdir(directory))
        data = {n: c.to_json() for n, c in sorted(checks.items()) if n in present}
        write_atomic(os.path.join(directory, CACHE), (json.dumps(data, indent=1) + "\n").encode(), mode=0o600)
    except OSError as exc:
        log.warning("cannot record the check of %s (%s)", name, exc)
    finally:
        os.close(fd)


def check_of(path: str, *, ok: bool, how: str, clock: WallClock = SYSTEM_WALL_CLOCK, **kw: Any) -> Optional[Check]:
    """A Check stamped with ``path`` as it is now (None if it vanished)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return Check(stamp=stamp_of(st), ok=ok, how=how, at=clock.now().timestamp(), **kw)
