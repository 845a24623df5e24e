"""`backup fetch`: a backup in the bucket, with its chain's segments and checkpoints, brought into
the local backup dir (a drill, a move to another site, the first step of a restore from the
bucket), resumable, all-or-nothing per object.

Each object streams into a private staging dir ``<backup dir>/.fetch/`` (0700; hidden, so the
catalog never lists a half-fetched file) as ``<file>.part``, its size and sha256 checked as it
streams against the object's sha256 metadata (``transfer.stream_object``, the code every download
uses). The ETag the copy began against is kept beside it (``<file>.etag``): a run killed halfway
leaves both, and the next run re-hashes the part and continues it with a Range GET (If-Match the
ETag); an object changed since starts over. Only a whole, checked file is renamed into the backup
dir, and never over a different file of the same name.

This module plans a fetch and moves one object; ``bucket.staging`` runs a plan's objects several
at once, checks the segments' names and links them in (``backup fetch``, ``restore --from-bucket``).

Names from the bucket are hostile: only what ``layout.place`` reads as a backup, a checkpoint or a
segment of ours (a plain file name: no "/", no "..") is fetched; anything else under the chain's
prefix refuses the whole fetch before a byte is written.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from etcd_agent.backup.catalog import DATE_SPEC_RE, STAMP_RE
from etcd_agent.backup.manifest import SNAPSHOT
from etcd_agent.bucket import layout, transfer
from etcd_agent.bucket.digests import READ_CHUNK, mismatches
from etcd_agent.chain.segments import parse_name as parse_segment_name
from etcd_agent.errors import AgentError, BackupCorrupt, BackupError, BusyError, RefusedError, UsageError
from etcd_agent.fs import ensure_private_dir, fsync_dir, open_regular, write_atomic

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.bucket.client import Bucket
    from etcd_agent.bucket.remote import RemoteObject
    from etcd_agent.config import Config

log = logging.getLogger(__name__)

STAGING = ".fetch"
_FOLDER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # what expand_prefix makes of a host name
_KIND_RANK = {layout.FULL: 0, layout.CHECKPOINT: 1, layout.SEGMENT: 2}


@dataclass(frozen=True)
class Wanted:
    """One object to fetch."""

    name: str  # under the prefix
    file: str  # the local file name
    kind: str  # layout.FULL | CHECKPOINT | SEGMENT
    size: int

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "file": self.file, "kind": self.kind, "size": self.size}


@dataclass(frozen=True)
class Fetched:
    wanted: Wanted
    how: str  # fetched | resumed | already here
    resumed_at: int = 0
    # its leg of a staging run (``staging.stage_all``): seconds from the run's start, and its own
    # length; what shows which object held the others up
    began: Optional[float] = None
    seconds: Optional[float] = None

    def to_json(self) -> Dict[str, Any]:
        legs = {k: round(v, 3) for k, v in (("began", self.began), ("seconds", self.seconds)) if v is not None}
        return {**self.wanted.to_json(), "how": self.how, "resumed_at": self.resumed_at, **legs}


def local_file(name: str) -> Tuple[str, str]:
    """(local file name, kind) of bucket object ``name``; BackupCorrupt for a name that is not a
    backup, a checkpoint or a segment of ours (``../x``, an absolute path, anything else)."""
    placed = layout.place(name)
    if placed is None or "/" in placed.file or placed.file.startswith(".") or "\x00" in placed.file:
        raise BackupCorrupt(f"{name!r} in the bucket is not a backup, a checkpoint or a segment of ours: nothing "
                            "is fetched from under a prefix that holds it")
    return placed.file, placed.kind


def select(objs: Sequence["RemoteObject"], spec: str, *, now: Optional[datetime] = None) -> "RemoteObject":
    """``spec`` (latest, a file name, a date(-time) prefix, as ``restore --from``) among the full
    backups ``list_remote`` found (newest first); a copy under chains/ before a legacy one. A
    backup dated ahead of ``now`` (the catalog's zone; a clock that once jumped) is never chosen
    by ``latest`` or a date, and refused by name, as the local catalog refuses it."""
    spec = spec.strip()
    if not objs:
        raise UsageError("backup fetch: the bucket holds no full backup")
    ahead = {id(o): _ahead(o, now) for o in objs}
    named = [o for o in objs if o.name == spec]
    if named:
        pick = sorted(named, key=lambda o: not o.chain)[0]
        if ahead[id(pick)]:
            raise RefusedError(f"{pick.name} in the bucket is not usable: {ahead[id(pick)]}; nothing fetched")
        return pick
    usable = [o for o in objs if not ahead[id(o)]]
    if not usable:
        raise UsageError(f"every full backup in the bucket is dated in the future ({_stamp(objs[0].name)} ... "
                         f"{_stamp(objs[-1].name)}; now {now}): none is trusted as latest")
    if spec == "latest":
        return usable[0]
    if "/" in spec or not DATE_SPEC_RE.match(spec):
        raise UsageError(f"backup fetch {spec!r}: not a backup in the bucket, a date(-time) prefix like 2019-08-07 or "
                         "2019-08-07-13, or latest")
    matches = [o for o in usable if _stamp(o.name) == spec or _stamp(o.name).startswith(spec + "-")]
    if not matches:
        raise UsageError(f"backup fetch {spec}: no backup from {spec} in the bucket (its backups range from "
                         f"{_stamp(objs[-1].name)} to {_stamp(objs[0].name)})")
    return matches[0]


def _ahead(o: "RemoteObject", now: Optional[datetime]) -> str:
    from etcd_agent.backup.catalog import CLOCK_MARGIN

    if now is not None and o.time > now + CLOCK_MARGIN:
        return f"dated in the future by its name ({o.time.isoformat()}; now {now.isoformat(timespec='seconds')})"
    return ""


def _not_after(objs: Sequence["RemoteObject"], when: Optional[datetime],
               revision: Optional[int]) -> List["RemoteObject"]:
    """The full backups taken at or before ``when`` / at or below ``revision`` (the revision of
    the object's metadata only narrows the choice; the restore reads it from the content)."""
    out = []
    for o in objs:
        rev = str(o.metadata.get("revision", ""))
        if when is not None and o.time > when:
            continue
        if revision is not None and rev.isdigit() and int(rev) > revision:
            continue
        out.append(o)
    if not out:
        raise UsageError("the bucket holds no full backup from before the target"
                         + (f" (its oldest is {_stamp(objs[-1].name)})" if objs else ""))
    return out


REACH_CANDIDATES = 10  # the newest full backups whose chains are listed to choose ``latest``


def catalog_time(cfg: "Config", when: datetime) -> datetime:
    """An aware ``when`` as the catalog names backups: naive, in UTC or local time ([backup] utc)."""
    return (when.astimezone(timezone.utc) if cfg.backup.utc else when.astimezone()).replace(tzinfo=None)


def _reaching(cfg: "Config", objs: Sequence["RemoteObject"], reach_to: int,
              now: datetime) -> List["RemoteObject"]:
    """``objs`` with the one ``latest`` should be put first: of the newest ``REACH_CANDIDATES``
    (not dated ahead), the newest whose chain's segments in the bucket reach ``reach_to`` by
    their names, or (-1) the one reaching furthest; unchanged when none does. Names only narrow
    the choice; the restore checks the chain from its content."""
    from etcd_agent.bucket import remote

    best: Optional[Tuple[int, datetime]] = None
    pick: Optional["RemoteObject"] = None
    for o in [o for o in objs if not _ahead(o, now) and o.chain][:REACH_CANDIDATES]:
        rev = str(o.metadata.get("revision", ""))
        base = int(rev) if rev.isdigit() else None
        names = remote.list_names(bound(cfg, o.folder), layout.chain_dir(o.chain))
        r = layout.reach(names, base)
        reached = r.revision if r.revision is not None else (base if base is not None else -1)
        if reach_to >= 0:
            if reached >= reach_to and (base is None or base <= reach_to):
                pick = o
                break
            continue
        if best is None or (reached, o.time) > best:
            best, pick = (reached, o.time), o
    if pick is None:
        return list(objs)
    return [pick] + [o for o in objs if o is not pick]


def here_first(cfg: "Config", objs: Sequence["RemoteObject"]) -> List["RemoteObject"]:
    """``objs`` in their order, except that of backups sharing one name (masters' folders hold
    backups of the same second under the same name), one whose name a different backup holds in
    the backup dir goes last: the fetch never overwrites a different file (it would refuse),
    while another master's copy of that second, at the same place in the order, serves the same
    restore. A name only one copy has is never moved (the fetch refuses it, said)."""
    from etcd_agent.backup.catalog import entry_for

    names = collections.Counter(o.name for o in objs)

    def taken(o: "RemoteObject") -> bool:
        path = os.path.join(cfg.backup.dir, o.name)
        if names[o.name] < 2 or not os.path.lexists(path):
            return False
        try:
            e = entry_for(path, utc=cfg.backup.utc)
        except (OSError, AgentError):
            return True
        # its checked sha256, else its manifest's word: an order only, the fetch compares the bytes
        claimed = ((e.manifest or {}).get("files") or {}).get(SNAPSHOT) or {}
        here = e.snapshot_sha256 or (claimed.get("sha256") if isinstance(claimed, dict) else None)
        return not o.chain or here != o.chain

    return sorted(objs, key=taken)


def _stamp(name: str) -> str:
    m = STAMP_RE.match(name)
    return "-".join(x for x in m.groups() if x) if m else name


def order(items: Sequence[Wanted]) -> List[Wanted]:
    """The full backup first, then its checkpoints, then its segments in revision order."""
    def key(w: Wanted) -> Tuple[int, int, str]:
        rng = parse_segment_name(w.file) if w.kind == layout.SEGMENT else None
        return _KIND_RANK[w.kind], rng[0] if rng else 0, w.file

    return sorted(items, key=key)


def plan(cfg: "Config", spec: str, *, not_after: Optional[datetime] = None,
         max_revision: Optional[int] = None, reach_to: Optional[int] = None) -> Tuple["RemoteObject", List[Wanted]]:
    """The chosen full backup and every object to fetch for it, in order; listing only.
    ``latest`` with ``not_after`` (a time in the catalog's zone) or ``max_revision`` (a point in
    time's target): the newest full backup at or before it. ``reach_to`` (a point in time:
    its revision, or -1 for newest): ``latest`` is the newest whose chain in the bucket reaches
    it (for newest: the one that reaches furthest) - a newer full backup at the same revision
    may have no chain at all."""
    from etcd_agent.bucket import remote

    objs = sorted((replace(o, folder=folder) for folder, bound_cfg in host_folders(cfg)
                   for o in remote.list_remote(bound_cfg)), key=lambda o: (o.time, o.name), reverse=True)
    objs = here_first(cfg, objs)  # of one name in two masters' folders, not the one a different file here holds
    if not any(o.name == spec.strip() for o in objs):  # latest, a date: not what no check can vouch for
        objs = _checkable(objs)
    now = catalog_time(cfg, datetime.now(timezone.utc))  # once: what is dated ahead is judged alike
    if spec.strip() == "latest" and (not_after is not None or max_revision is not None):
        objs = _not_after(objs, not_after, max_revision)
    if spec.strip() == "latest" and reach_to is not None:
        objs = _reaching(cfg, objs, reach_to, now)
    full = select(objs, spec, now=now)
    cfg = bound(cfg, full.folder)  # its chain is in the same master's folder
    name = layout.full_name(full.chain, full.name) if full.chain else full.name
    items = [Wanted(name, full.name, layout.FULL, full.size)]
    if full.chain:
        under = layout.chain_dir(full.chain)
        for obj_name, size, _etag in remote.list_objects(cfg, under):
            if obj_name == name:
                continue
            file, kind = local_file(obj_name)
            items.append(Wanted(obj_name, file, kind, size))
    else:
        rev = str(full.metadata.get("revision", ""))
        if rev.isdigit():  # a legacy copy: its segments under delta-<revision>/
            for obj_name, size, _etag in remote.list_objects(cfg, f"delta-{int(rev):016d}/"):
                file, kind = local_file(obj_name)
                items.append(Wanted(obj_name, file, kind, size))
    for w in items:
        if w.size > remote.MAX_OBJECT_BYTES:
            raise BackupCorrupt(f"{w.name} in the bucket claims {w.size} bytes, more than any backup "
                                f"({remote.MAX_OBJECT_BYTES} bytes): nothing fetched")
    return full, order(items)


def _checkable(objs: Sequence["RemoteObject"]) -> List["RemoteObject"]:
    """``objs`` but those without sha256 metadata (said): an upload cut before its sha256 was set
    (``remote._set_sha256``), which the fetch would refuse; all of them when none carries one
    (the fetch then says why)."""
    out = [o for o in objs if o.sha256 is not None]
    for o in objs:
        if o.sha256 is None and out:
            log.warning("%s in the bucket carries no sha256 metadata (an upload cut before it was set, or not one "
                        "of ours): passed over", o.key)
    return out or list(objs)


def host_folders(cfg: "Config") -> List[Tuple[str, "Config"]]:
    """(folder, the config bound to it) of every master that copied to the bucket. With ``{host}``
    a whole segment of ``[backup.remote] prefix`` (the default), each master copies into a folder
    named after its host name; a restore on new hosts - maybe named otherwise - looks through
    every folder found there (names of plain characters only; anything else is not ours). Any
    other prefix: this host's own, as for every other command."""
    from etcd_agent.bucket import remote
    from etcd_agent.bucket.client import expand_prefix

    r = cfg.backup.remote
    parts = r.prefix.split("/")
    if "{host}" not in parts:
        return [("", cfg)]
    above = "/".join(parts[:parts.index("{host}")])
    above = expand_prefix(above + "/", cfg.cluster.name) if above else ""
    found = sorted({f for f in remote.list_folders(cfg, above) if _FOLDER_RE.match(f)})
    return [(f, bound(cfg, f)) for f in found] or [("", cfg)]


def bound(cfg: "Config", folder: str) -> "Config":
    """``cfg`` with its prefix's ``{host}`` pinned to ``folder`` ("" unchanged)."""
    if not folder:
        return cfg
    r = cfg.backup.remote
    return replace(cfg, backup=replace(cfg.backup, remote=replace(r, prefix=r.prefix.replace("{host}", folder))))


@contextlib.contextmanager
def staging_locked(directory: str) -> Iterator[str]:
    """The staging dir (0700, made if missing), held by this fetch alone: two fetches writing the
    same part would each check the bytes they streamed, not the file the other truncated."""
    ensure_private_dir(directory)
    staging = os.path.join(directory, STAGING)
    ensure_private_dir(staging)
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BusyError(f"another `backup fetch` is writing into {directory}: wait for it to end") from None
        try:
            yield staging
        finally:
            with contextlib.suppress(OSError):  # gone when no part is kept to be continued
                os.rmdir(staging)
    finally:
        os.close(fd)


def fetch_one(b: "Bucket", w: Wanted, directory: str, *,
              progress: Optional[Callable[[int, int], None]] = None) -> Fetched:
    """One object into ``directory``: staged, checked, renamed; resumed from a kept part.
    ``progress(done bytes, total bytes)`` as it streams (``transfer.stream_object``)."""
    staged = stage_one(b, w, directory, progress=progress)
    return publish(b, staged, directory)


@dataclass(frozen=True)
class Staged:
    """An object whose bytes were checked against its sha256 metadata: in its part file in the
    staging dir (``part``), or already in the backup dir with the same bytes (``part`` None)."""

    fetched: Fetched
    obj: "RemoteObject"
    part: Optional[str]
    bytes_read: int = 0  # what this run took from the bucket

    @property
    def file(self) -> str:
        return self.fetched.wanted.file


def stage_one(b: "Bucket", w: Wanted, directory: str, *,
              progress: Optional[Callable[[int, int], None]] = None) -> Staged:
    """One object streamed into its part in the staging dir and checked whole; nothing is written
    outside the staging dir. A part a killed run left is continued; a whole one is re-hashed."""
    from etcd_agent.bucket import remote

    file, _kind = local_file(w.name)
    obj = remote.checkable(b, w.name)  # HEAD: sha256 metadata present, size bounded
    target = os.path.join(directory, file)
    staging = os.path.join(directory, STAGING)  # made and held by staging_locked
    part, etag_file = os.path.join(staging, file + ".part"), os.path.join(staging, file + ".etag")
    if os.path.lexists(target):
        how = _already_here(b, obj, target)
        _discard(part, etag_file)  # a part of a run killed between the link and its clean-up
        return Staged(Fetched(w, how), obj, None)
    offset, sha = _resume_from(part, etag_file, obj)
    try:
        free = shutil.disk_usage(staging).free
        if obj.size - offset > free:
            raise BackupError(f"{b.where(w.name)} holds {obj.size} bytes, more than the {free} free in {staging}")
        if not offset:
            write_atomic(etag_file, (obj.etag or "-").encode())
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "r+b") as fh:
            fh.truncate(offset)  # a part longer than what was hashed would not be continued
            fh.seek(offset)
            size, digest = transfer.stream_object(b, obj, fh, offset=offset, sha=sha, progress=progress)
            fh.flush()
            os.fsync(fh.fileno())
    except BackupCorrupt:  # more bytes than claimed: nothing of it is worth continuing
        _discard(part, etag_file)
        raise
    except OSError as exc:
        raise BackupError(f"cannot write {part}: {exc.strerror or exc}") from exc
    problems = mismatches(obj.size, obj.sha256 or "", size, digest)
    if problems:  # a bad copy is not kept to be continued
        _discard(part, etag_file)
        raise BackupCorrupt(f"{b.where(w.name)} failed its checksum on fetch: nothing of it kept", details=problems)
    how = "resumed" if offset else "fetched"
    return Staged(Fetched(w, how, offset), obj, part, size - offset)


def publish(b: "Bucket", staged: Staged, directory: str) -> Fetched:
    """A staged object's part linked into ``directory`` under its own name (never over a
    different file of that name), its part and ETag file removed."""
    if staged.part is None:
        return staged.fetched
    file = staged.file
    target = os.path.join(directory, file)
    etag_file = staged.part[:-len(".part")] + ".etag"
    try:
        os.link(staged.part, target)  # fails rather than replace a file that appeared meanwhile
    except FileExistsError:
        _discard(staged.part, etag_file)
        return Fetched(staged.fetched.wanted, _already_here(b, staged.obj, target))
    except OSError as exc:
        raise BackupError(f"cannot write {target}: {exc.strerror or exc}") from exc
    fsync_dir(directory)
    _discard(staged.part, etag_file)
    f = staged.fetched
    log.info("%s %s to %s (%d bytes, sha256 ok%s)", f.how, b.where(f.wanted.name), target, staged.obj.size,
             f", continued at byte {f.resumed_at}" if f.resumed_at else "")
    return f


def _resume_from(part: str, etag_file: str, obj: "RemoteObject") -> Tuple[int, "hashlib._Hash"]:
    """Bytes of a kept part to continue from, and their digest; (0, fresh) to start over."""
    sha = hashlib.sha256()
    try:
        with open_regular(etag_file, limit=256) as fh:
            kept_etag = fh.read(256).decode("ascii", "replace").strip()
        with open_regular(part) as fh:
            size = 0
            for chunk in iter(lambda: fh.read(READ_CHUNK), b""):
                size += len(chunk)
                if size > obj.size:
                    break
                sha.update(chunk)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("not continuing %s: %s", part, exc.strerror or exc)
        _discard(part, etag_file)
        return 0, hashlib.sha256()
    if kept_etag != (obj.etag or "-") or size > obj.size:
        log.info("%s was begun on another version of %s: starting over", part, obj.key)
        _discard(part, etag_file)
        return 0, hashlib.sha256()
    return size, sha


def _already_here(b: "Bucket", obj: "RemoteObject", target: str) -> str:
    """A file of that name is here: the same bytes are fine, anything else is never overwritten."""
    from etcd_agent.bucket.queue import file_sha256

    try:
        same = os.path.isfile(target) and not os.path.islink(target) and \
            os.path.getsize(target) == obj.size and file_sha256(target) == obj.sha256
    except OSError as exc:
        raise BackupError(f"cannot read {target}: {exc.strerror or exc}") from exc
    if not same:
        raise RefusedError(f"{target} exists and differs from {b.where(obj.name)}: it is not overwritten; move it "
                           "away to fetch the copy")
    return "already here"


def discard_part(part: str) -> None:
    """A staged part and its ETag file removed (bytes that failed a check are not continued)."""
    _discard(part, part[:-len(".part")] + ".etag")


def _discard(*paths: str) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
