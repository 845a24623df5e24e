"""The backups in the backup dir: listing, and ``--from`` resolution for restore.

Only files named like a backup count; hidden partial files never do. An archive without a
complete manifest is listed as incomplete (so the operator sees it) but is never chosen.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ..errors import BackupCorrupt, UsageError
from .archive import parse_name, read_manifest

if TYPE_CHECKING:  # pragma: no cover
    from ..config import Config

log = logging.getLogger(__name__)

DATE_SPEC_RE = re.compile(r"^\d{4}(-\d{2}){0,5}$")


@dataclass(frozen=True)
class Entry:
    name: str
    path: str
    time: datetime  # aware
    size: int
    revision: Optional[int]
    verified: bool
    compression: str
    problem: Optional[str] = None
    manifest: Optional[Dict[str, Any]] = None

    @property
    def complete(self) -> bool:
        return self.problem is None

    @property
    def stamp(self) -> str:
        return self.name.split(".", 1)[0][len("etcd-") :]

    def to_json(self) -> Dict[str, Any]:
        m = self.manifest or {}
        return {
            "name": self.name,
            "path": self.path,
            "time": self.time.isoformat(),
            "size": self.size,
            "revision": self.revision,
            "verified": self.verified,
            "compression": self.compression,
            "member": m.get("member"),
            "cluster_id": (m.get("cluster") or {}).get("id"),
            "problem": self.problem,
        }


def _aware(naive: datetime, utc: bool) -> datetime:
    return naive.replace(tzinfo=timezone.utc) if utc else naive.astimezone()


def entry_for(path: str, *, utc: bool = True) -> Entry:
    """Describe one archive (reads its manifest; a missing/broken one becomes ``problem``)."""
    name = os.path.basename(path)
    parsed = parse_name(name)
    st = os.stat(path)
    when = _aware(parsed[0], utc) if parsed else datetime.fromtimestamp(st.st_mtime, timezone.utc)
    comp = parsed[1] if parsed else "none"
    try:
        m = read_manifest(path)
    except BackupCorrupt as exc:
        return Entry(name, path, when, st.st_size, None, False, comp, problem=exc.message.replace(path + ": ", ""))
    rev = m.get("revision")
    return Entry(
        name, path, when, st.st_size, rev if isinstance(rev, int) else None, m.get("verified") is True, comp, None, m
    )


def list_backups(directory: str, *, utc: bool = True) -> List[Entry]:
    """Every backup-named file in ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        path = os.path.join(directory, n)
        if parse_name(n) is None or not os.path.isfile(path) or os.path.islink(path):
            continue
        try:
            out.append(entry_for(path, utc=utc))
        except FileNotFoundError:  # pruned while we looked
            continue
    out.sort(key=lambda e: (e.time, e.name), reverse=True)
    return out


def resolve(directory: str, spec: str, *, utc: bool = True) -> Entry:
    """``spec`` -> a complete backup: a path, a file name in ``directory``, a date(-time) prefix
    (``2019-08-07`` = the newest of that day, ``2019-08-07-13`` of that hour, ...), or ``latest``."""
    spec = spec.strip()
    if not spec:
        raise UsageError("--from needs a backup: a path, a file name, a date like 2019-08-07, or latest")
    if "/" in spec or (os.path.exists(spec) and parse_name(spec) is None):
        if not os.path.isfile(spec):
            raise UsageError(f"--from {spec}: no such file")
        return _complete(entry_for(os.path.abspath(spec), utc=utc), spec)
    if parse_name(spec) is not None:
        path = os.path.join(directory, spec)
        if not os.path.isfile(path):
            raise UsageError(f"--from {spec}: no such backup in {directory}")
        return _complete(entry_for(path, utc=utc), spec)
    entries = [e for e in list_backups(directory, utc=utc) if e.complete]
    if spec == "latest":
        if not entries:
            raise UsageError(f"--from latest: no complete backup in {directory}")
        return entries[0]
    if not DATE_SPEC_RE.match(spec):
        raise UsageError(
            f"--from {spec!r}: not a path, a backup file name, a date(-time) prefix like 2019-08-07 or "
            "2019-08-07-13, or latest"
        )
    matches = [e for e in entries if e.stamp == spec or e.stamp.startswith(spec + "-")]
    if not matches:
        have = f"backups there range from {entries[-1].stamp} to {entries[0].stamp}" if entries else "there are none"
        raise UsageError(f"--from {spec}: no complete backup from {spec} in {directory} ({have})")
    return matches[0]


def resolve_from(cfg: "Config", spec: str) -> Entry:
    """``resolve`` against the configured backup dir."""
    return resolve(cfg.backup.dir, spec, utc=cfg.backup.utc)


def _complete(entry: Entry, spec: str) -> Entry:
    if not entry.complete:
        raise UsageError(f"--from {spec}: {entry.problem}")
    return entry
