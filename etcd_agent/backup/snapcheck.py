"""Integrity of an etcd snapshot, checked while it streams past: no second read, no temp copy.

An etcd v3 snapshot is a bbolt database followed by a 32-byte sha256 of everything before it
(etcd's server appends it; ``etcdctl snapshot restore`` checks it). While the bytes stream into
the archive we hash them, keep the first pages, and at the end check:

- the trailer: etcd's own sha256 of the data equals ours (end-to-end: etcd's memory -> our file);
- the two bbolt meta pages: magic, version, page size, FNV-64a checksum;
- the size: bbolt's high-water mark x page size + 32 == bytes received (nothing lost or added).

Then ``last_revision()`` reads a handful of pages (the rightmost path of the ``key`` bucket) from
the written file to find the snapshot's revision. This is what ``etcdctl snapshot status`` would
tell, except its full key count and crc hash (which need every page read once more); ``backup
verify`` runs the real ``snapshot status`` on an extracted copy when that cost is acceptable.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from ..errors import BackupCorrupt

TRAILER = 32
BOLT_MAGIC = 0xED0CDAED
BOLT_VERSION = 2
PAGE_HEADER = 16
META_FLAG, BRANCH_FLAG, LEAF_FLAG = 0x04, 0x01, 0x02
BUCKET_LEAF_FLAG = 0x01
MAX_PAGE = 65536
# etcd's MVCC bucket: keys are revisions (8-byte main, '_', 8-byte sub)
KEY_BUCKET = b"key"


@dataclass(frozen=True)
class SnapshotFacts:
    size: int
    sha256: str
    page_size: int
    txid: int
    high_water: int  # pages in the bbolt file
    root_pgid: int


def _fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def parse_meta(page: bytes) -> Tuple[int, int, int, int]:
    """(page_size, root_pgid, high_water, txid) of a bbolt meta page; ValueError if invalid."""
    if len(page) < PAGE_HEADER + 64:
        raise ValueError("meta page too short")
    _pgid, flags, _count, _overflow = struct.unpack_from("<QHHI", page, 0)
    if not flags & META_FLAG:
        raise ValueError(f"page flags {flags:#x} are not a meta page")
    meta = page[PAGE_HEADER : PAGE_HEADER + 64]
    magic, version, page_size, _mflags, root, _seq, _freelist, hwm, txid, checksum = struct.unpack(
        "<IIIIQQQQQQ", meta
    )
    if magic != BOLT_MAGIC:
        raise ValueError(f"bad bbolt magic {magic:#x}")
    if version != BOLT_VERSION:
        raise ValueError(f"unsupported bbolt version {version}")
    if checksum != _fnv64a(meta[:56]):
        raise ValueError("meta page checksum mismatch")
    if page_size < 512 or page_size > MAX_PAGE or page_size & (page_size - 1):
        raise ValueError(f"implausible page size {page_size}")
    return page_size, root, hwm, txid


class StreamCheck:
    """Feed it the snapshot bytes in order; ``finish()`` says whether they form a sound snapshot."""

    def __init__(self) -> None:
        self.size = 0
        self._sha = hashlib.sha256()
        self._body = hashlib.sha256()  # everything but the last 32 bytes seen so far
        self._tail = b""
        self._head = bytearray()

    def update(self, chunk: bytes) -> None:
        if not chunk:
            return
        self.size += len(chunk)
        self._sha.update(chunk)
        if len(self._head) < 2 * MAX_PAGE:
            self._head += chunk[: 2 * MAX_PAGE - len(self._head)]
        if len(chunk) >= TRAILER:
            if self._tail:
                self._body.update(self._tail)
            self._body.update(memoryview(chunk)[:-TRAILER])
            self._tail = bytes(chunk[-TRAILER:])
        else:
            data = self._tail + chunk
            self._body.update(data[:-TRAILER] if len(data) > TRAILER else b"")
            self._tail = data[-TRAILER:]

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def finish(self, what: str = "snapshot") -> SnapshotFacts:
        """The facts, or BackupCorrupt naming exactly what is wrong."""
        if self.size == 0:
            raise BackupCorrupt(f"{what}: empty (etcd sent no data)")
        if self.size % 512 != TRAILER:
            raise BackupCorrupt(
                f"{what}: {self.size} bytes is not a bbolt db plus etcd's 32-byte sha256 trailer "
                "(incomplete stream?)"
            )
        if self._body.digest() != self._tail:
            raise BackupCorrupt(f"{what}: sha256 trailer does not match the data (corrupted in transit or on disk)")
        head = bytes(self._head)
        metas = []
        problems = []
        for i in (0, 1):
            try:
                ps = struct.unpack_from("<I", head, PAGE_HEADER + 8)[0] if i else 0
                off = i * ps
                metas.append(parse_meta(head[off : off + PAGE_HEADER + 64]))
            except (ValueError, struct.error) as exc:
                problems.append(f"meta page {i}: {exc}")
        if not metas:
            raise BackupCorrupt(f"{what}: not a bbolt database ({'; '.join(problems)})")
        page_size, root, hwm, txid = max(metas, key=lambda m: m[3])
        if hwm * page_size != self.size - TRAILER:
            raise BackupCorrupt(
                f"{what}: bbolt says {hwm} pages of {page_size} bytes = {hwm * page_size} bytes, "
                f"but {self.size - TRAILER} arrived"
            )
        return SnapshotFacts(self.size, self.sha256, page_size, txid, hwm, root)


ReadAt = Callable[[int, int], bytes]


def last_revision(read_at: ReadAt, facts: SnapshotFacts) -> Optional[int]:
    """The highest MVCC revision in the snapshot (None if it holds no keys).

    ``read_at(offset, n)`` reads from the snapshot's first byte (offset 0 = page 0).
    """
    ps = facts.page_size

    def page(pgid: int) -> bytes:
        if not 0 < pgid < facts.high_water:
            raise BackupCorrupt(f"snapshot: page id {pgid} outside the db (high water {facts.high_water})")
        head = read_at(pgid * ps, PAGE_HEADER)
        overflow = struct.unpack_from("<I", head, 12)[0]
        return read_at(pgid * ps, (overflow + 1) * ps)

    # find the "key" bucket among the root bucket's entries
    buf = page(facts.root_pgid)
    value = _lookup(buf, KEY_BUCKET, page)
    if value is None:
        return None
    sub_root = struct.unpack_from("<Q", value, 0)[0]
    buf = value[16:] if sub_root == 0 else page(sub_root)  # inline bucket: the page follows
    for _ in range(64):  # descend the rightmost path
        _id, flags, count, _ov = struct.unpack_from("<QHHI", buf, 0)
        if count == 0:
            return None
        last = PAGE_HEADER + (count - 1) * 16
        if flags & BRANCH_FLAG:
            _pos, _ksize, child = struct.unpack_from("<IIQ", buf, last)
            buf = page(child)
        elif flags & LEAF_FLAG:
            _f, pos, ksize, _vsize = struct.unpack_from("<IIII", buf, last)
            key = buf[last + pos : last + pos + ksize]
            return int.from_bytes(key[:8], "big") if len(key) >= 8 else None
        else:
            raise BackupCorrupt(f"snapshot: unexpected page flags {flags:#x} in the key bucket")
    raise BackupCorrupt("snapshot: key bucket tree deeper than 64 levels")


def _lookup(buf: bytes, name: bytes, page: Callable[[int], bytes]) -> Optional[bytes]:
    """The value of bucket ``name`` in the tree rooted at page ``buf``."""
    for _ in range(64):
        _id, flags, count, _ov = struct.unpack_from("<QHHI", buf, 0)
        if flags & BRANCH_FLAG:
            child = None
            for i in range(count):
                at = PAGE_HEADER + i * 16
                pos, ksize, pgid = struct.unpack_from("<IIQ", buf, at)
                if i == 0 or bytes(buf[at + pos : at + pos + ksize]) <= name:
                    child = pgid
                else:
                    break
            if child is None:
                return None
            buf = page(child)
        elif flags & LEAF_FLAG:
            for i in range(count):
                at = PAGE_HEADER + i * 16
                eflags, pos, ksize, vsize = struct.unpack_from("<IIII", buf, at)
                if bytes(buf[at + pos : at + pos + ksize]) == name and eflags & BUCKET_LEAF_FLAG:
                    return bytes(buf[at + pos + ksize : at + pos + ksize + vsize])
            return None
        else:
            raise BackupCorrupt(f"snapshot: unexpected page flags {flags:#x} in the root bucket")
    raise BackupCorrupt("snapshot: root bucket tree deeper than 64 levels")
