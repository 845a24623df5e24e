"""Who an etcd v3 snapshot belongs to, read from its own bbolt database: bounded, pure Python.

An etcd v3 snapshot (``etcdctl snapshot save``, or the db file of a member's data dir) is a bbolt
database; a snapshot also carries a 32-byte sha256 of the database appended by the server
(``size % 512 == 32`` is etcd's own test for it, ``hasChecksum`` in etcdutl/snapshot). This module
reads only the few buckets that say whose data it is:

- ``members`` (key: member id in lower-case hex without padding, value: JSON of the whole
  ``membership.Member`` - ``{"id", "peerURLs", "isLearner", "name", "clientURLs"}``; the raft
  attributes and the attributes are flattened into one object in the backend, unlike the v2 store
  which keeps ``raftAttributes`` and ``attributes`` as two nodes). Same format in 3.4 and 3.5.
- ``members_removed`` (key: hex id, value ``"removed"``).
- ``cluster`` (``clusterVersion``: ``"3.5.0"``; 3.5 adds ``downgrade``: JSON
  ``{"target-version": "", "enabled": false}``).
- ``meta`` (``consistent_index`` and, since 3.5, ``term``: 8-byte big-endian; ``confState`` since
  3.5: JSON of raftpb.ConfState; ``scheduledCompactRev`` / ``finishedCompactRev``: 17-byte
  revisions; ``storageVersion`` since 3.6).
- ``key``: the MVCC revisions (17-byte keys ``main(8, BE) '_' sub(8, BE)``, 18 with a trailing
  ``'t'`` for a tombstone): the last one is the snapshot's revision, as ``snapshot status`` says.

How far the members bucket can be trusted: ids and peer URLs always; name, client URLs and
isLearner only where etcd rewrites an existing entry - 3.4 and 3.5.20+. 3.5.1-3.5.19 refuse to
overwrite (``unsafeSaveMemberToBackend`` returns ``errMemberAlreadyExist``), so there a member
keeps what AddMember wrote: no client URLs, a name only if it was bootstrapped, and a promoted
learner stays ``isLearner: true`` (``meta/confState`` is right). ``snapshot restore`` in 3.5
rewrites members (new ids, members_removed emptied) but leaves ``meta/confState`` naming the old
cluster's voters until the next membership change; 3.4's restore leaves the members bucket as it
was and the new members are added beside the old ones when they first publish.

The cluster ID is NOT stored in the database (3.4, 3.5 and 3.6): it lives in the WAL's metadata
record (``etcdserverpb.Metadata{NodeID, ClusterID}``). It can be recomputed from the member ids
while the membership is still the bootstrap one (``cluster_id_from``), and bootstrap member ids can
be recomputed from peer URLs and the cluster token (``member_id_from``): see those functions.

Every malformed input raises :class:`SnapshotFormatError` (a ``BackupCorrupt``) with a one-line
message; I/O errors of
the ``read_at`` callable propagate unchanged. Work and memory are bounded whatever the input: page
ids are checked against the high-water mark, tree depth, entries, key and value sizes and JSON
nesting are limited, pages are read piecemeal (element headers, then one key/value) so an overflow
page of any size is never loaded whole.
"""
from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from etcd_agent.errors import SnapshotFormatError
from etcd_agent.etcd.bbolt import (
    BUCKET_LEAF_FLAG,
    MAX_COUNT_PAGES,
    MAX_KEY,
    MAX_VALUE,
    BoltMeta,
    ReadAt,
    _Bucket,
    _Reader,
)
from etcd_agent.etcd.snapvalues import (
    ConfState,
    Downgrade,
    Member,
    Revision,
    _bool,
    _json,
    _member,
    _member_id,
    _revision,
    _text,
    _u64,
    _u64_list,
    bounded_json,
    cluster_id_from,
    member_id_from,
)

__all__ = [
    "ReadAt",
    "SnapshotFormatError",
    "BoltMeta",
    "read_meta",
    "bounded_json",
    "Revision",
    "Member",
    "ConfState",
    "Downgrade",
    "SnapshotIdentity",
    "parse_identity",
    "read_identity",
    "identity_from_bytes",
    "member_id_from",
    "cluster_id_from",
]

# --- limits of the identity walk (the page-level ones are bbolt's; the values' in snapvalues) ----
MAX_ROOT_BUCKETS = 256  # etcd has 10
MAX_MEMBERS = 1024
MAX_REMOVED = 10000  # grows by one per member ever removed, never shrinks
MAX_SMALL_ENTRIES = 1024  # meta, cluster
HASH_CHUNK = 1024 * 1024

KEY_BUCKET = b"key"
META_BUCKET = b"meta"
CLUSTER_BUCKET = b"cluster"
MEMBERS_BUCKET = b"members"
MEMBERS_REMOVED_BUCKET = b"members_removed"


# --- result ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SnapshotIdentity:
    """What a snapshot's database says about whose it is. ``None``: the key is absent."""

    size: int  # bytes given, trailer included
    page_size: int
    txid: int  # bbolt transaction id of the chosen meta page
    high_water: int  # pages in the database
    has_trailer: bool  # etcd's 32-byte sha256 follows the database
    trailer_sha256: Optional[str]  # hex
    trailer_verified: Optional[bool]  # None: not checked (verify_trailer=False)
    buckets: Tuple[str, ...]  # top-level bucket names, in bbolt (byte) order
    members: Tuple[Member, ...]  # sorted by id
    removed_member_ids: Tuple[int, ...]  # sorted
    cluster_version: Optional[str]
    downgrade: Optional[Downgrade]
    consistent_index: Optional[int]
    term: Optional[int]  # etcd 3.5+
    conf_state: Optional[ConfState]  # etcd 3.5+
    storage_version: Optional[str]  # etcd 3.6+
    scheduled_compact_revision: Optional[int]
    finished_compact_revision: Optional[int]
    first_revision: Optional[Revision]  # lowest key of the key bucket
    last_revision: Optional[Revision]  # highest: the snapshot's revision
    bucket_entries: Optional[Tuple[Tuple[str, int], ...]]  # only with count_entries=True

    @property
    def revision(self) -> int:
        """The snapshot's revision as ``snapshot status`` reports it (0 with no keys)."""
        return self.last_revision.main if self.last_revision else 0

    @property
    def compact_revision(self) -> int:
        """The revision etcd will treat as compacted after loading this db (0: never compacted);
        a scheduled but unfinished compaction is redone by etcd at start."""
        return self.finished_compact_revision or 0

    @property
    def key_revisions(self) -> Optional[int]:
        """Entries of the key bucket (one per put/delete kept), if counted."""
        if self.bucket_entries is None:
            return None
        return dict(self.bucket_entries).get("key", 0)

    @property
    def total_entries(self) -> Optional[int]:
        """Entries of all buckets: ``snapshot status``'s ``totalKey``, if counted."""
        if self.bucket_entries is None:
            return None
        return sum(n for _, n in self.bucket_entries)

    @property
    def member_ids(self) -> Tuple[int, ...]:
        return tuple(m.id for m in self.members)

    @property
    def computed_cluster_id(self) -> Optional[int]:
        """``cluster_id_from(member_ids)``: the real cluster id only while the membership is the one
        the cluster was bootstrapped (or restored) with - see :func:`cluster_id_from`."""
        return cluster_id_from(self.member_ids) if self.members else None


# --- entry points ------------------------------------------------------------------------------
def read_meta(read_at: ReadAt, size: int) -> BoltMeta:
    """The bbolt meta of a snapshot (or db) of ``size`` bytes, from its first pages only: meta 0 at
    offset 0, meta 1 one page further (at most 64 KiB + 80 bytes are read). The checks are those
    of :func:`parse_identity`: magic, version, checksum, page size, and that the high-water mark
    fits ``size`` (exactly, when etcd's 32-byte trailer follows). Used while a snapshot streams in,
    to refuse a non-database after its first pages instead of after all of it."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TypeError("size must be a non-negative int")
    r = _Reader(read_at, size)
    try:
        r.load_meta()
    except (struct.error, IndexError, OverflowError) as exc:  # pragma: no cover - a safety net
        raise SnapshotFormatError(f"unexpected structure ({type(exc).__name__}: {exc})") from None
    return r.meta


def parse_identity(
    read_at: ReadAt,
    size: int,
    *,
    count_entries: bool = False,
    verify_trailer: bool = False,
) -> SnapshotIdentity:
    """Read the identity of the etcd snapshot (or bbolt db file) of ``size`` bytes that
    ``read_at(offset, n)`` reads.

    Reads a few pages (the root bucket, ``members``, ``members_removed``, ``cluster``, ``meta`` and
    two paths down ``key``). ``count_entries`` also counts every bucket's entries from page
    headers (every branch page plus 16 bytes of each leaf page: ~0.1 s per 100 MB);
    ``verify_trailer`` requires etcd's sha256 trailer and hashes the whole database against it
    (leave it off for a member's own ``member/snap/db``, which has none). Raises
    :class:`SnapshotFormatError` for any malformed input.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TypeError("size must be a non-negative int")
    r = _Reader(read_at, size)
    try:
        return _parse(r, count_entries, verify_trailer)
    except (struct.error, IndexError, OverflowError) as exc:  # pragma: no cover - a safety net
        raise SnapshotFormatError(f"unexpected structure ({type(exc).__name__}: {exc})") from None


@dataclass
class _Meta:
    """What the ``meta`` bucket says (None: the key is absent)."""

    consistent_index: Optional[int] = None
    term: Optional[int] = None
    scheduled: Optional[int] = None
    finished: Optional[int] = None
    conf: Optional[ConfState] = None
    storage_version: Optional[str] = None


def _parse(r: _Reader, count_entries: bool, verify_trailer: bool) -> SnapshotIdentity:
    r.load_meta()
    trailer, verified = _trailer(r, verify_trailer)
    buckets = _root_buckets(r)
    members = _members(r, buckets.get(MEMBERS_BUCKET))
    removed = _removed(r, buckets.get(MEMBERS_REMOVED_BUCKET))
    cluster_version, downgrade = _cluster(r, buckets.get(CLUSTER_BUCKET))
    meta = _meta(r, buckets[META_BUCKET])
    first, last = _key_range(r, buckets[KEY_BUCKET])
    return SnapshotIdentity(
        size=r.size,
        page_size=r.meta.page_size,
        txid=r.meta.txid,
        high_water=r.meta.high_water,
        has_trailer=trailer is not None,
        trailer_sha256=trailer,
        trailer_verified=verified,
        buckets=tuple(_name(n) for n in buckets),
        members=tuple(sorted(members, key=lambda m: m.id)),
        removed_member_ids=tuple(sorted(removed)),
        cluster_version=cluster_version,
        downgrade=downgrade,
        consistent_index=meta.consistent_index,
        term=meta.term,
        conf_state=meta.conf,
        storage_version=meta.storage_version,
        scheduled_compact_revision=meta.scheduled,
        finished_compact_revision=meta.finished,
        first_revision=first,
        last_revision=last,
        bucket_entries=_counts(r, buckets) if count_entries else None,
    )


def _trailer(r: _Reader, verify: bool) -> Tuple[Optional[str], Optional[bool]]:
    """etcd's sha256 trailer (hex) if there is one, and whether it matched (None: not checked)."""
    if verify and r.db_len == r.size:
        raise SnapshotFormatError(
            f"no sha256 trailer: {r.size} bytes is not a bbolt database plus etcd's 32 bytes"
        )
    if r.db_len == r.size:
        return None, None
    trailer = r.trailer().hex()
    if not verify:
        return trailer, None
    h = hashlib.sha256()
    for off in range(0, r.db_len, HASH_CHUNK):
        h.update(r.read(off, min(HASH_CHUNK, r.db_len - off), "sha256"))
    if h.hexdigest() != trailer:
        raise SnapshotFormatError("sha256 trailer does not match the database (corrupted)")
    return trailer, True


def _root_buckets(r: _Reader) -> Dict[bytes, _Bucket]:
    buckets: Dict[bytes, _Bucket] = {}
    for e in r.walk(_Bucket(r.meta.root, None), MAX_ROOT_BUCKETS, MAX_KEY, "root bucket"):
        if e.key is None:
            raise SnapshotFormatError(f"root bucket: bucket name longer than {MAX_KEY} bytes")
        buckets[e.key] = r.bucket_of(e, _label(e.key))
    for required in (KEY_BUCKET, META_BUCKET):
        # etcd's MVCC store creates both before anything else: without them it is not etcd's
        if required not in buckets:
            raise SnapshotFormatError(f"not an etcd database: no {required.decode()!r} bucket")
    return buckets


def _members(r: _Reader, bucket: Optional[_Bucket]) -> List[Member]:
    out: List[Member] = []
    for e in r.walk(bucket, MAX_MEMBERS, MAX_KEY, "members") if bucket is not None else ():
        if e.flags & BUCKET_LEAF_FLAG:
            raise SnapshotFormatError("members: nested bucket")
        out.append(_member(e.key, r.value(e, MAX_VALUE, "members")))
    return out


def _removed(r: _Reader, bucket: Optional[_Bucket]) -> List[int]:
    out: List[int] = []
    for e in r.walk(bucket, MAX_REMOVED, MAX_KEY, "members_removed") if bucket is not None else ():
        if e.flags & BUCKET_LEAF_FLAG:
            raise SnapshotFormatError("members_removed: nested bucket")
        # the value is the word "removed": not read, the key is the fact
        out.append(_member_id(e.key, "members_removed"))
    return out


def _cluster(r: _Reader, bucket: Optional[_Bucket]) -> Tuple[Optional[str], Optional[Downgrade]]:
    version: Optional[str] = None
    downgrade: Optional[Downgrade] = None
    for e in r.walk(bucket, MAX_SMALL_ENTRIES, MAX_KEY, "cluster") if bucket is not None else ():
        if e.key == b"clusterVersion":
            version = _text(r.value(e, 64, "cluster/clusterVersion"), "cluster/clusterVersion")
        elif e.key == b"downgrade":
            obj = _json(r.value(e, MAX_VALUE, "cluster/downgrade"), "cluster/downgrade")
            target = obj.get("target-version", "")
            if not isinstance(target, str) or len(target) > 64:
                raise SnapshotFormatError("cluster/downgrade: target-version is not a short string")
            downgrade = Downgrade(target, _bool(obj, "enabled", "cluster/downgrade"))
    return version, downgrade


def _conf_state(raw: bytes) -> ConfState:
    obj = _json(raw, "meta/confState")
    return ConfState(
        voters=_u64_list(obj, "voters", "meta/confState"),
        learners=_u64_list(obj, "learners", "meta/confState"),
        voters_outgoing=_u64_list(obj, "voters_outgoing", "meta/confState"),
        learners_next=_u64_list(obj, "learners_next", "meta/confState"),
        auto_leave=_bool(obj, "auto_leave", "meta/confState"),
    )


def _meta(r: _Reader, bucket: _Bucket) -> _Meta:
    m = _Meta()
    for e in r.walk(bucket, MAX_SMALL_ENTRIES, MAX_KEY, "meta"):
        k = e.key
        if k == b"consistent_index":
            m.consistent_index = _u64(r.value(e, 8, "meta/consistent_index"), "meta/consistent_index")
        elif k == b"term":
            m.term = _u64(r.value(e, 8, "meta/term"), "meta/term")
        elif k == b"scheduledCompactRev":
            m.scheduled = _revision(r.value(e, 17, "meta/scheduledCompactRev"), "meta/scheduledCompactRev").main
        elif k == b"finishedCompactRev":
            m.finished = _revision(r.value(e, 17, "meta/finishedCompactRev"), "meta/finishedCompactRev").main
        elif k == b"confState":
            m.conf = _conf_state(r.value(e, MAX_VALUE, "meta/confState"))
        elif k == b"storageVersion":
            raw = r.value(e, 64, "meta/storageVersion")
            m.storage_version = _text(raw, "meta/storageVersion") if raw else ""
    return m


def _key_range(r: _Reader, kb: _Bucket) -> Tuple[Optional[Revision], Optional[Revision]]:
    lo = r.edge(kb, False, _label(KEY_BUCKET))
    hi = r.edge(kb, True, _label(KEY_BUCKET))
    if lo is None or hi is None:
        return None, None
    if lo.flags & BUCKET_LEAF_FLAG or hi.flags & BUCKET_LEAF_FLAG or lo.key is None or hi.key is None:
        raise SnapshotFormatError("bucket 'key': entry is not a revision")
    first, last = _revision(lo.key, "bucket 'key'"), _revision(hi.key, "bucket 'key'")
    if (first.main, first.sub) > (last.main, last.sub):
        raise SnapshotFormatError("bucket 'key': first revision is above the last")
    return first, last


def _counts(r: _Reader, buckets: Dict[bytes, _Bucket]) -> Tuple[Tuple[str, int], ...]:
    # one bit per page of the db, to visit each at most once
    if r.meta.high_water > MAX_COUNT_PAGES:
        raise SnapshotFormatError(
            f"database of {r.meta.high_water} pages is too large to count entries (limit {MAX_COUNT_PAGES})"
        )
    seen = bytearray((r.meta.high_water + 7) // 8)
    return tuple((_name(name), r.count(b, seen, _label(name))) for name, b in buckets.items())


def _name(name: bytes) -> str:
    return name.decode("utf-8", "backslashreplace")


def _label(name: bytes) -> str:
    """A bucket as error messages name it: printable, short, one line."""
    return f"bucket {_name(name[:40])!r}"


def read_identity(path: str, *, count_entries: bool = False, verify_trailer: bool = False) -> SnapshotIdentity:
    """:func:`parse_identity` of a file on disk (a snapshot, or a member's ``member/snap/db``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size

        def read_at(offset: int, n: int) -> bytes:
            return os.pread(fd, n, offset)

        return parse_identity(read_at, size, count_entries=count_entries, verify_trailer=verify_trailer)
    finally:
        os.close(fd)


def identity_from_bytes(
    data: bytes, *, count_entries: bool = False, verify_trailer: bool = False
) -> SnapshotIdentity:
    """:func:`parse_identity` of bytes already in memory."""
    view = memoryview(data)

    def read_at(offset: int, n: int) -> bytes:
        return bytes(view[offset : offset + n])

    return parse_identity(read_at, len(data), count_entries=count_entries, verify_trailer=verify_trailer)
