"""The key space an etcd snapshot holds, read offline from its own bbolt db: bounded, pure Python.

What a member restored from the snapshot must serve, computed without etcd. The ``key`` bucket
holds every revision etcd kept (``main(8, BE) '_' sub(8, BE)``, plus ``'t'`` for a tombstone ->
``mvccpb.KeyValue``) in revision order, so one pass gives, for every key, its last entry: what it
holds now, or that it was deleted. From that pass:

- ``revision`` (the last entry), ``entries`` (revisions kept), ``live_keys``;
- ``digest``: a ``KeyspaceDigest`` over every live key with its create and mod revision, version
  and lease. It is order-independent (a sum of per-key hashes), so the drill computes the same
  value while paging through a restored member's keys, and the two are compared;
- the last record of each key asked for (``wanted``): size and sha256 of its value, or None
  when the snapshot does not hold the key.

Each put's KeyValue must name its own bucket revision as ``mod_revision`` (etcd writes them so):
an entry that does not is corruption. Work is bounded like ``bbolt``'s other walks: each page is
reached at most once (a bit per page of the db), the depth is limited, a value is read whole only
up to ``MAX_VALUE``. Memory is one small entry per live key (a 16-byte digest of the key -> its
hash), at most ``max_keys`` of them; etcd's own index of the restored member holds more per key.
"""
from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Tuple

from etcd_agent.errors import SnapshotFormatError
from etcd_agent.etcd import wire
from etcd_agent.etcd.bbolt import BUCKET_LEAF_FLAG, MAX_COUNT_PAGES, MAX_KEY, ReadAt, _Bucket, _Page, _Reader
from etcd_agent.etcd.pb import kv_pb2
from etcd_agent.etcd.snapdb import KEY_BUCKET, MAX_ROOT_BUCKETS
from etcd_agent.etcd.snapvalues import MAX_REVISION

MAX_VALUE = 256 * 1024 * 1024  # one KeyValue; etcd's --max-request-bytes is 1.5 MiB by default
WHOLE_PAGE = 1024 * 1024  # a leaf page up to this size is read in one go, bigger ones piecemeal
DEFAULT_MAX_KEYS = 20_000_000
_MOD = 1 << 256


def _u(v: int) -> int:
    """An int64 field as the unsigned 64 bits the digest packs."""
    return v & 0xFFFFFFFFFFFFFFFF


class KeyspaceDigest:
    """An order-independent digest of a set of keys at one revision: the sum (mod 2**256) of a
    blake2b hash of each key with its create revision, mod revision, version and lease. The mod
    revision names the put that wrote the value, so equal digests mean the same keys, each at the
    same write; the values themselves are compared for a sample only."""

    def __init__(self) -> None:
        self.total = 0
        self.count = 0

    @staticmethod
    def item(key: bytes, create: int, mod: int, version: int, lease: int) -> int:
        h = hashlib.blake2b(digest_size=32)
        h.update(struct.pack(">I", len(key)))
        h.update(key)
        h.update(struct.pack(">QQQQ", _u(create), _u(mod), _u(version), _u(lease)))
        return int.from_bytes(h.digest(), "big")

    def add(self, key: bytes, create: int, mod: int, version: int, lease: int) -> None:
        self.total = (self.total + self.item(key, create, mod, version, lease)) % _MOD
        self.count += 1

    def hexdigest(self) -> str:
        return f"{self.total:064x}"


@dataclass(frozen=True)
class KeyRecord:
    """One key as the store holds it at a revision (its value by size and sha256)."""

    key: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int
    value_size: int
    value_sha256: str

    def differs(self, other: "KeyRecord") -> Optional[str]:
        """What differs from ``other`` (one phrase), or None."""
        for what, a, b in (("create_revision", self.create_revision, other.create_revision),
                           ("mod_revision", self.mod_revision, other.mod_revision),
                           ("version", self.version, other.version), ("lease", self.lease, other.lease),
                           ("value size", self.value_size, other.value_size)):
            if a != b:
                return f"{what} {a} against {b}"
        if self.value_sha256 != other.value_sha256:
            return f"value sha256 {self.value_sha256[:16]}... against {other.value_sha256[:16]}..."
        return None


def record_of(key: bytes, value: bytes, create: int, mod: int, version: int, lease: int) -> KeyRecord:
    return KeyRecord(key, create, mod, version, lease, len(value), hashlib.sha256(value).hexdigest())


@dataclass(frozen=True)
class Keyspace:
    revision: int  # the last revision in the key bucket (0: empty)
    entries: int  # revisions kept (puts and tombstones)
    live_keys: int
    digest: str
    wanted: Dict[bytes, Optional[KeyRecord]]
    lease_entries: int  # entries of the ``lease`` bucket (leases granted and not revoked)


def decode_kv(buf: bytes) -> Tuple[bytes, int, int, int, bytes, int]:
    """(key, create_revision, mod_revision, version, value, lease) of one stored mvccpb.KeyValue
    (the caller has bounded ``buf`` by ``MAX_VALUE`` already; the bound here is the same)."""
    try:
        m = wire.parse(kv_pb2.KeyValue, buf, MAX_VALUE)
    except ValueError as exc:
        raise SnapshotFormatError(f"KeyValue: {exc}") from None
    return m.key, m.create_revision, m.mod_revision, m.version, m.value, m.lease


def _revision_key(raw: bytes) -> Tuple[int, int, bool]:
    if len(raw) not in (17, 18) or raw[8:9] != b"_" or (len(raw) == 18 and raw[17:] != b"t"):
        raise SnapshotFormatError(f"bucket 'key': {raw[:20].hex()} is not a revision")
    main = int.from_bytes(raw[:8], "big")
    sub = int.from_bytes(raw[9:17], "big")
    if main > MAX_REVISION or sub > MAX_REVISION:
        raise SnapshotFormatError(f"bucket 'key': revision {main}.{sub} overflows int64")
    return main, sub, len(raw) == 18


def scan(
    read_at: ReadAt,
    size: int,
    wanted: Iterable[bytes] = (),
    *,
    max_keys: int = DEFAULT_MAX_KEYS,
    check: Optional[Callable[[], None]] = None,
) -> Keyspace:
    """One pass over the key bucket of the snapshot (or db) of ``size`` bytes. ``check()`` is
    called every few pages (a deadline, a cancel: it raises to stop). Every malformed input is a
    SnapshotFormatError."""
    r = _Reader(read_at, size)
    try:
        return _scan(r, set(wanted), max_keys, check)
    except (struct.error, IndexError, OverflowError) as exc:  # pragma: no cover - a safety net
        raise SnapshotFormatError(f"unexpected structure ({type(exc).__name__}: {exc})") from None


def _scan(r: _Reader, wanted: "set[bytes]", max_keys: int, check: Optional[Callable[[], None]]) -> Keyspace:
    r.load_meta()
    buckets: Dict[bytes, _Bucket] = {}
    for e in r.walk(_Bucket(r.meta.root, None), MAX_ROOT_BUCKETS, MAX_KEY, "root bucket"):
        if e.key is not None and e.key in (KEY_BUCKET, b"lease"):
            buckets[e.key] = r.bucket_of(e, f"bucket {e.key.decode()!r}")
    if KEY_BUCKET not in buckets:
        raise SnapshotFormatError("not an etcd database: no 'key' bucket")
    if r.meta.high_water > MAX_COUNT_PAGES:
        raise SnapshotFormatError(f"database of {r.meta.high_water} pages is too large to scan")
    seen = bytearray((r.meta.high_water + 7) // 8)

    def mark(page: _Page) -> None:
        if not page.pgid:
            return
        byte, bit = divmod(page.pgid, 8)
        if seen[byte] & (1 << bit):
            raise SnapshotFormatError(f"page {page.pgid} is reached twice")
        seen[byte] |= 1 << bit

    lease_entries = r.count(buckets[b"lease"], seen, "bucket 'lease'") if b"lease" in buckets else 0
    live: Dict[bytes, int] = {}
    found: Dict[bytes, Optional[KeyRecord]] = dict.fromkeys(wanted)
    last = (0, -1)
    entries = 0
    what = "bucket 'key'"
    for n, leaf in enumerate(r.leaves(buckets[KEY_BUCKET], what, mark)):
        if check is not None and n % 64 == 0:
            check()
        if leaf.data is None and leaf.span <= WHOLE_PAGE:  # one read per page, not per element
            leaf = _Page(leaf.pgid, leaf.base, r.read(leaf.base, leaf.span, what), leaf.span, leaf.flags, leaf.count)
        raw = r.elements(leaf, 0, leaf.count, what)
        for i in range(leaf.count):
            e = r.leaf_entry(leaf, raw, i, i, MAX_KEY, what)
            if e.key is None or e.flags & BUCKET_LEAF_FLAG:
                raise SnapshotFormatError(f"{what}: entry {entries} is not a revision")
            main, sub, tomb = _revision_key(e.key)
            if (main, sub) <= last:
                raise SnapshotFormatError(f"{what}: revision {main}.{sub} after {last[0]}.{last[1]}")
            last = (main, sub)
            entries += 1
            if e.vsize > MAX_VALUE:
                raise SnapshotFormatError(f"{what}: revision {main} holds a {e.vsize}-byte value (limit {MAX_VALUE})")
            key, create, mod, version, value, lease = decode_kv(r.bytes_of(e.page, e.value_at, e.vsize, what))
            if not key:
                raise SnapshotFormatError(f"{what}: revision {main}.{sub} holds no key")
            kd = hashlib.blake2b(key, digest_size=16).digest()
            if tomb:
                live.pop(kd, None)
                if key in found:
                    found[key] = None
                continue
            if mod != main or not 0 < create <= mod or version < 1:
                raise SnapshotFormatError(
                    f"{what}: revision {main} holds a KeyValue of mod_revision {mod}, create_revision {create}, "
                    f"version {version}: not the put stored there"
                )
            live[kd] = KeyspaceDigest.item(key, create, mod, version, lease)
            if len(live) > max_keys:
                raise SnapshotFormatError(f"{what}: more than {max_keys} live keys to compare")
            if key in found:
                found[key] = record_of(key, value, create, mod, version, lease)
    total = 0
    for h in live.values():
        total = (total + h) % _MOD
    return Keyspace(revision=last[0], entries=entries, live_keys=len(live), digest=f"{total:064x}",
                    wanted=found, lease_entries=lease_entries)


def scan_file(path: str, wanted: Iterable[bytes] = (), **kw: object) -> Keyspace:
    """``scan`` of a file on disk (a snapshot, or a member's ``member/snap/db``)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size

        def read_at(offset: int, n: int) -> bytes:
            return os.pread(fd, n, offset)

        return scan(read_at, size, wanted, **kw)  # type: ignore[arg-type]
    finally:
        os.close(fd)
