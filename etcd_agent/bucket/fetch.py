"""`backup fetch`: a backup in the bucket, with its chain's segments and checkpoints, brought into
the local backup dir (a drill, a move to another site, the first step of a restore from the
bucket), resumable, all-or-nothing per object.

Each object streams into a private staging dir ``<backup dir>/.fetch/`` (0700; hidden, so the
catalog never lists a half-fetched file) as ``<file>.part``, its size and sha256 checked as it
streams against the object's sha256 metadata (``remote.stream_object``, the code every download
uses). The ETag the copy began against is kept beside it (``<file>.etag``): a run killed halfway
leaves both, and the next run re-hashes the part and continues it with a Range GET (If-Match the
ETag); an object changed since starts over. Only a whole, checked file is renamed into the backup
dir, and never over a different file of the same name.

Names from the bucket are hostile: only what ``layout.place`` reads as a backup, a checkpoint or a
segment of ours (a plain file name: no "/", no "..") is fetched; anything else under the chain's
prefix refuses the whole fetch before a byte is written.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Sequence, Tuple

from etcd_agent.backup.catalog import DATE_SPEC_RE, STAMP_RE
from etcd_agent.bucket import layout
from etcd_agent.bucket.digests import READ_CHUNK, mismatches
from etcd_agent.chain.segments import parse_name as parse_segment_name
from etcd_agent.errors import BackupCorrupt, BackupError, BusyError, RefusedError, UsageError
from etcd_agent.fs import ensure_private_dir, fsync_dir, open_regular, write_atomic

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.bucket.client import Bucket
    from etcd_agent.bucket.remote import RemoteObject
    from etcd_agent.config import Config

log = logging.getLogger(__name__)

STAGING = ".fetch"
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

    def to_json(self) -> Dict[str, Any]:
        return {**self.wanted.to_json(), "how": self.how, "resumed_at": self.resumed_at}


def local_file(name: str) -> Tuple[str, str]:
    """(local file name, kind) of bucket object ``name``; BackupCorrupt for a name that is not a
    backup, a checkpoint or a segment of ours (``../x``, an absolute path, anything else)."""
    placed = layout.place(name)
    if placed is None or "/" in placed.file or placed.file.startswith(".") or "\x00" in placed.file:
        raise BackupCorrupt(f"{name!r} in the bucket is not a backup, a checkpoint or a segment of ours: nothing "
                            "is fetched from under a prefix that holds it")
    return placed.file, placed.kind


def select(objs: Sequence["RemoteObject"], spec: str) -> "RemoteObject":
    """``spec`` (latest, a file name, a date(-time) prefix, as ``restore --from``) among the full
    backups ``list_remote`` found (newest first); a copy under chains/ before a legacy one."""
    spec = spec.strip()
    if not objs:
        raise UsageError("backup fetch: the bucket holds no full backup")
    if spec == "latest":
        return objs[0]
    named = [o for o in objs if o.name == spec]
    if named:
        return sorted(named, key=lambda o: not o.chain)[0]
    if "/" in spec or not DATE_SPEC_RE.match(spec):
        raise UsageError(f"backup fetch {spec!r}: not a backup in the bucket, a date(-time) prefix like 2019-08-07 or "
                         "2019-08-07-13, or latest")
    matches = [o for o in objs if _stamp(o.name) == spec or _stamp(o.name).startswith(spec + "-")]
    if not matches:
        raise UsageError(f"backup fetch {spec}: no backup from {spec} in the bucket (its backups range from "
                         f"{_stamp(objs[-1].name)} to {_stamp(objs[0].name)})")
    return matches[0]


def _stamp(name: str) -> str:
    m = STAMP_RE.match(name)
    return "-".join(x for x in m.groups() if x) if m else name


def order(items: Sequence[Wanted]) -> List[Wanted]:
    """The full backup first, then its checkpoints, then its segments in revision order."""
    def key(w: Wanted) -> Tuple[int, int, str]:
        rng = parse_segment_name(w.file) if w.kind == layout.SEGMENT else None
        return _KIND_RANK[w.kind], rng[0] if rng else 0, w.file

    return sorted(items, key=key)


def plan(cfg: "Config", spec: str) -> Tuple["RemoteObject", List[Wanted]]:
    """The chosen full backup and every object to fetch for it, in order; listing only."""
    from etcd_agent.bucket import remote

    full = select(remote.list_remote(cfg), spec)
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


def fetch_all(cfg: "Config", items: Sequence[Wanted], *,
              progress: Any = None) -> List[Fetched]:
    """Fetch ``items`` in order into the backup dir; stops at the first failure (BackupError)."""
    from etcd_agent.bucket.client import Bucket

    b = Bucket(cfg)
    out: List[Fetched] = []
    with staging_locked(cfg.backup.dir):
        for w in items:
            done = fetch_one(b, w, cfg.backup.dir)
            if progress is not None:
                progress(done)
            out.append(done)
    return out


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


def fetch_one(b: "Bucket", w: Wanted, directory: str, *, progress: Any = None) -> Fetched:
    """One object into ``directory``: staged, checked, renamed; resumed from a kept part.
    ``progress(done bytes, total bytes)`` as it streams (``remote.stream_object``)."""
    from etcd_agent.bucket import remote

    file, _kind = local_file(w.name)
    obj = remote.checkable(b, w.name)  # HEAD: sha256 metadata present, size bounded
    target = os.path.join(directory, file)
    staging = os.path.join(directory, STAGING)  # made and held by staging_locked
    part, etag_file = os.path.join(staging, file + ".part"), os.path.join(staging, file + ".etag")
    if os.path.lexists(target):
        how = _already_here(b, obj, target)
        _discard(part, etag_file)  # a part of a run killed between the link and its clean-up
        return Fetched(w, how)
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
            size, digest = remote.stream_object(b, obj, fh, offset=offset, sha=sha, progress=progress)
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
    try:
        os.link(part, target)  # fails rather than replace a file that appeared meanwhile
    except FileExistsError:
        _discard(part, etag_file)
        return Fetched(w, _already_here(b, obj, target))
    except OSError as exc:
        raise BackupError(f"cannot write {target}: {exc.strerror or exc}") from exc
    fsync_dir(directory)
    _discard(part, etag_file)
    how = "resumed" if offset else "fetched"
    log.info("%s %s to %s (%d bytes, sha256 ok%s)", how, b.where(w.name), target, size,
             f", continued at byte {offset}" if offset else "")
    return Fetched(w, how, offset)


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


def _discard(*paths: str) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
