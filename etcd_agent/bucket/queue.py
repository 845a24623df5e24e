"""What still has to be copied off-host, derived each time from the backup dir and one listing of
the bucket: there is no record of pending copies to lose on a kill or to disagree with the disk.

A file is pending when it exists here, the remote retention would keep it (``plan_fulls``: a copy
it would delete at once is not made), and the bucket does not hold it under its ``layout`` name
with the same size and the same sha256 metadata. Full backups, the segments of their delta
chains and the checkpoints taken inside them are all queued; a full backup always goes first,
then its checkpoints, then its segments in revision order, so the bucket never holds a segment or
a checkpoint whose full backup it lacks. Segments whose full backup is neither here nor in the
bucket are not copied (they restore nothing); neither are files whose chain cannot be named.

``plan`` is pure (plain data in, an ordered list out); ``scan_local`` and ``list_bucket`` are its
I/O edges, and ``same_bytes`` the one check that reads (a HEAD and a local digest, both cached
by the caller, so a daemon hashes each unchanged file once).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from etcd_agent.backup.archive import parse_name as parse_backup_name
from etcd_agent.backup.retention import BackupRef
from etcd_agent.backup.retention import plan as retention_plan
from etcd_agent.bucket import layout
from etcd_agent.bucket.digests import file_sha256 as file_sha256  # fetch and the copier take it from here
from etcd_agent.chain.segments import parse_name as parse_segment_name
from etcd_agent.config import Config

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.backup.catalog import Entry
    from etcd_agent.chain.chains import Scan

log = logging.getLogger(__name__)

# kinds in the order a chain's files are copied
_RANK = {layout.FULL: 0, layout.CHECKPOINT: 1, layout.SEGMENT: 2}


@dataclass(frozen=True)
class LocalFile:
    """A file here that belongs in the bucket."""

    kind: str  # layout.FULL | CHECKPOINT | SEGMENT
    path: str
    size: int
    since: float  # Unix s it appeared (its mtime): the age of a pending copy counts from here
    key: str  # the chain's key (layout); "" when it cannot be named
    order: int = 0  # within its chain: a segment's start revision, a checkpoint's time
    manifest: Mapping[str, Any] = field(default_factory=dict, compare=False)  # fulls and checkpoints

    @property
    def file(self) -> str:
        return os.path.basename(self.path)

    @property
    def name(self) -> str:
        """Its object name under the prefix."""
        if self.kind == layout.FULL:
            return layout.full_name(self.key, self.file)
        if self.kind == layout.CHECKPOINT:
            return layout.checkpoint_name(self.key, self.file)
        return layout.segment_name(self.key, self.file)


@dataclass(frozen=True)
class Listed:
    """An object as one listing shows it (no metadata: that needs a HEAD)."""

    size: int
    etag: str = ""


@dataclass(frozen=True)
class Plan:
    pending: Tuple[LocalFile, ...]  # in copy order
    unplaced: Tuple[str, ...] = ()  # paths not copied, each for a reason logged once
    why_unplaced: Tuple[str, ...] = ()

    @property
    def pending_bytes(self) -> int:
        return sum(f.size for f in self.pending)

    def oldest_since(self) -> Optional[float]:
        return min((f.since for f in self.pending), default=None)

    @property
    def pending_revisions(self) -> int:
        return revisions_of(self.pending)


def revisions_of(files: Iterable[LocalFile]) -> int:
    """The revisions the segments among ``files`` hold (by their names): what the bucket lacks of
    this host's chains, the off-host RPO counted in revisions."""
    total = 0
    for f in files:
        rng = parse_segment_name(f.file) if f.kind == layout.SEGMENT else None
        if rng is not None:
            total += max(0, rng[1] - rng[0] + 1)
    return total


# ---------------------------------------------------------------- pure


def _time(file: str) -> Optional[datetime]:
    parsed = parse_backup_name(file)
    return parsed[0] if parsed else None


def plan_fulls(local: Iterable[str], remote: Iterable[str], *, keep_last: int, keep_hourly: int,
               keep_daily: int) -> Set[str]:
    """The full backup file names the remote retention keeps among those here and those there:
    the same rule ``prune_remote`` applies, so a copy is never made only to be deleted."""
    names = {n for n in (*local, *remote) if _time(n) is not None}
    refs = [BackupRef(n, _time(n) or datetime.min, verified=True) for n in names]
    if not refs:
        return set()
    decisions = retention_plan(refs, keep_last=keep_last, keep_hourly=keep_hourly, keep_daily=keep_daily)
    return {d.name for d in decisions if d.keep}


def needs_check(files: Sequence[LocalFile], listing: Mapping[str, Listed]) -> List[LocalFile]:
    """The files whose object exists with the right size: only their sha256 can tell."""
    return [f for f in files if f.key and f.name in listing and listing[f.name].size == f.size]


def plan(files: Sequence[LocalFile], listing: Mapping[str, Listed], same: Set[str],
         keep_fulls: Set[str]) -> Plan:
    """What to copy, in order. ``same``: object names known to hold the local bytes (size and
    sha256 metadata checked); ``keep_fulls``: full backup file names the remote retention keeps."""
    unplaced: List[str] = []
    why: List[str] = []

    def skip(f: LocalFile, reason: str) -> None:
        unplaced.append(f.path)
        why.append(reason)

    def there(f: LocalFile) -> bool:
        return f.name in same and f.name in listing

    # the chains whose full backup is (or will be) in the bucket
    fulls_remote = {p.key for p in (layout.place(n) for n in listing) if p is not None and p.kind == layout.FULL
                    and p.key}
    chains: Dict[str, Optional[LocalFile]] = dict.fromkeys(fulls_remote)
    pending: List[LocalFile] = []
    for f in files:
        if f.kind != layout.FULL:
            continue
        if not f.key:
            skip(f, "its content digest is not known")
        elif f.file not in keep_fulls:
            continue  # the remote retention would delete its copy at once
        else:
            chains[f.key] = f
            if not there(f):
                pending.append(f)
    for f in files:
        if f.kind == layout.FULL:
            continue
        if not f.key:
            skip(f, "its chain's full backup is not known (not here, or an older chain without its digest)")
        elif f.key not in chains:
            continue  # its full backup is neither kept here for the bucket nor in it
        elif not there(f):
            pending.append(f)

    def newest_first(f: LocalFile) -> Tuple[float, str, int, int]:
        full = chains.get(f.key)
        when = _time(full.file) if full is not None else None
        stamp = when.timestamp() if when is not None else float("inf")  # a chain already there: now
        return (-stamp, f.key, _RANK[f.kind], f.order)

    pending.sort(key=newest_first)
    return Plan(tuple(pending), tuple(unplaced), tuple(why))


# ---------------------------------------------------------------- I/O edges


def list_bucket(cfg: Config) -> Dict[str, Listed]:
    """One listing of everything under the prefix: name -> size and ETag."""
    from etcd_agent.bucket.remote import list_objects

    return {name: Listed(size, etag) for name, size, etag in list_objects(cfg, "")}


@dataclass
class Caches:
    """What a daemon remembers between passes, only to spare work: a file's digest while its size
    and mtime stay the same, an object's sha256 metadata while its ETag stays the same."""

    local: Dict[Tuple[str, int, int], str] = field(default_factory=dict)
    remote: Dict[Tuple[str, str, int], Optional[str]] = field(default_factory=dict)
    # the catalog of the backup dir's archives while their names, sizes and mtimes (and the
    # manifest key) stay the same: a segment closing every few seconds does not re-read them
    catalog_key: object = None
    catalog: "List[Entry]" = field(default_factory=list)

    def local_sha(self, path: str) -> str:
        st = os.stat(path)
        k = (path, st.st_size, st.st_mtime_ns)
        if k not in self.local:
            if len(self.local) > 100000:
                self.local.clear()
            self.local[k] = file_sha256(path)
        return self.local[k]

    def known_sha(self, path: str) -> Optional[str]:
        """The digest hashed already while the file keeps its size and mtime, else None (no read)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return self.local.get((path, st.st_size, st.st_mtime_ns))

    def forget(self, path: str) -> None:
        """Every digest of ``path``: the file changed without its size or mtime telling."""
        for k in [k for k in self.local if k[0] == path]:
            del self.local[k]

    def landed(self, name: str) -> None:
        """What was read of object ``name``: a copy just landed there. Its ETag may be the one a
        copy cut before its sha256 was set had (the same parts; the metadata set by a copy onto
        itself keeps the ETag on Ceph RGW), whose HEAD found no sha256."""
        for k in [k for k in self.remote if k[0] == name]:
            del self.remote[k]


def same_bytes(cfg: Config, files: Sequence[LocalFile], listing: Mapping[str, Listed], caches: Caches) -> Set[str]:
    """The object names among ``needs_check(files)`` whose sha256 metadata is the local file's."""
    from etcd_agent.bucket.remote import head_sha256

    out: Set[str] = set()
    for f in needs_check(files, listing):
        obj = listing[f.name]
        rk = (f.name, obj.etag, obj.size)
        if rk not in caches.remote:
            caches.remote[rk] = head_sha256(cfg, f.name)
        try:
            if caches.remote[rk] is not None and caches.remote[rk] == caches.local_sha(f.path):
                out.add(f.name)
        except FileNotFoundError:
            continue  # pruned meanwhile: nothing to copy either
    return out


def _backups(cfg: Config, caches: Caches) -> "List[Entry]":
    """The good archives of the backup dir (``catalog``), read again only when they changed."""
    from etcd_agent.backup import catalog, keys

    directory = cfg.backup.dir
    key = keys.local_key(cfg).key
    seen = []
    for n in sorted(os.listdir(directory)):
        if n.startswith(".") or parse_segment_name(n) is not None:
            continue
        try:
            st = os.stat(os.path.join(directory, n), follow_symlinks=False)
        except FileNotFoundError:
            continue
        seen.append((n, st.st_size, st.st_mtime_ns))
    now = (tuple(seen), key)
    if now != caches.catalog_key:
        caches.catalog = [e for e in catalog.list_backups(directory, utc=cfg.backup.utc, cfg=cfg, key=key)
                          if e.complete]
        caches.catalog_key = now
    return caches.catalog


def scan_local(cfg: Config, caches: Caches) -> List[LocalFile]:
    """The full backups, checkpoints and segments of the backup dir, each with its chain's key.
    An archive whose snapshot digest is not known (rare) names its own chain by its own sha256."""
    from etcd_agent.chain import chains

    directory = cfg.backup.dir
    if not os.path.isdir(directory):
        return []
    from etcd_agent.backup.catalog import chain_checkpoints

    found = chains.scan(directory)
    entries = chain_checkpoints(_backups(cfg, caches), found)
    fulls, full_key = _fulls(entries, caches.local_sha)
    segments, chain_key = _segments(found, entries, full_key)
    checkpoints = [LocalFile(layout.CHECKPOINT, e.path, e.size, _mtime(e.path), chain_key.get(e.checkpoint_of, ""),
                             int(e.time.timestamp()), e.manifest or {}) for e in entries if e.checkpoint_of]
    return fulls + segments + checkpoints


def _fulls(entries: Sequence["Entry"], digest: Callable[[str], str]) -> Tuple[List[LocalFile], Dict[str, str]]:
    """The full backups (not checkpoints), and each one's chain key by name."""
    out: List[LocalFile] = []
    full_key: Dict[str, str] = {}  # full backup name -> key
    for e in entries:
        if e.checkpoint_of:
            continue
        key = e.snapshot_sha256 if e.snapshot_sha256 and layout.KEY_RE.match(e.snapshot_sha256) else ""
        if not key:
            try:
                key = digest(e.path)
            except OSError:
                continue
        full_key[e.name] = key
        out.append(LocalFile(layout.FULL, e.path, e.size, _mtime(e.path), key, 0, e.manifest or {}))
    return out, full_key


def _segments(scan: "Scan", entries: Sequence["Entry"], full_key: Mapping[str, str]
              ) -> Tuple[List[LocalFile], Dict[str, str]]:
    """Every chain's segments with the chain's key, and each chain id's key (for its checkpoints)."""
    out: List[LocalFile] = []
    chain_key: Dict[str, str] = {}  # chain id -> key
    for c in scan.chains:
        key = c.base_sha256 if layout.KEY_RE.match(c.base_sha256 or "") else ""
        if not key:  # an older chain: named by the local full backup it continues
            match = next((x for x in entries if not x.checkpoint_of and x.revision == c.base_revision
                          and c.continues(x.base)), None)
            key = full_key.get(match.name, "") if match is not None else ""
        if c.chain_id:
            chain_key[c.chain_id] = key
        for p in c.paths:
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            rng = parse_segment_name(os.path.basename(p))
            out.append(LocalFile(layout.SEGMENT, p, st.st_size, st.st_mtime, key, rng[0] if rng else 0))
    return out, chain_key


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
