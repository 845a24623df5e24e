"""Integrity of an etcd snapshot, checked while it streams past: no second read, no temp copy.

An etcd v3 snapshot is a bbolt database followed by a 32-byte sha256 of everything before it
(etcd's server appends it; ``etcdctl snapshot restore`` checks it). While the bytes stream by we
hash them once (one sha256 state gives both etcd's trailer check and the file's sha256 for the
manifest) and keep the first pages, and:

- as soon as the first pages are in (at most 64 KiB + 80 bytes), the bbolt meta pages are checked
  (magic, version, page size, FNV-64a checksum, high-water mark against the declared size), so a
  member that is not a database at all is refused after a few KB, not after all of it;
- at the end: etcd's own sha256 of the data equals ours (end-to-end: etcd's memory -> our file),
  and bbolt's high-water mark x page size + 32 == bytes received (nothing lost or added).

The bbolt format itself is read by ``etcd/snapdb`` (one parser): this module only feeds it the
head of the stream. The snapshot's revision and members are read afterwards from the file with
``snapdb.parse_identity`` (a handful of pages).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Union

from etcd_agent.errors import BackupCorrupt, SnapshotFormatError
from etcd_agent.etcd.bbolt import MAX_PAGE_SIZE, META_SIZE, PAGE_HEADER, TRAILER, BoltMeta
from etcd_agent.etcd.snapdb import read_meta

# bytes of the stream needed to find both meta pages whatever the page size
HEAD = MAX_PAGE_SIZE + PAGE_HEADER + META_SIZE
Chunk = Union[bytes, bytearray, memoryview]
# stands for "size not known yet" when checking the head of a stream of unknown length
_UNKNOWN = 1 << 62


@dataclass(frozen=True)
class SnapshotFacts:
    """What the stream (or the file) proved about a snapshot."""

    size: int  # bytes, trailer included
    sha256: Optional[str]  # our own hash of all of it (None: not hashed)
    page_size: int
    txid: int
    high_water: int  # pages in the bbolt file
    root_pgid: int
    trailer_checked: bool  # etcd's sha256 trailer was compared with our hash of the data (and matched)

    def lines(self) -> str:
        """One line for a report: what was proven."""
        trailer = "etcd sha256 trailer ok" if self.trailer_checked else "etcd sha256 trailer not checked"
        return (f"{trailer}, bbolt meta ok, size {self.size} = {self.high_water} pages x {self.page_size} "
                "+ 32-byte trailer")


def _meta_of(head: bytes, size: int, what: str) -> BoltMeta:
    def read_at(off: int, n: int) -> bytes:
        return head[off : off + n]

    try:
        return read_meta(read_at, size)
    except SnapshotFormatError as exc:
        raise BackupCorrupt(f"{what}: not an etcd snapshot ({exc.message})") from None


def check_size(size: int, what: str = "snapshot") -> None:
    """etcd's rule for a snapshot with its trailer: a whole number of 512-byte blocks plus 32."""
    if size == 0:
        raise BackupCorrupt(f"{what}: empty (no data)")
    if size % 512 != TRAILER:
        raise BackupCorrupt(
            f"{what}: {size} bytes is not a bbolt db plus etcd's 32-byte sha256 trailer (incomplete stream?)"
        )


class StreamCheck:
    """Feed it the snapshot bytes in order; ``finish()`` says whether they form a sound snapshot.

    ``declared``: the size the container says the snapshot has (a tar header), when known: the
    meta pages are then checked against it as soon as they arrive, and ``meta_ok`` turns true;
    a reader holds its writes back until then. ``what`` names the snapshot in errors."""

    def __init__(self, declared: Optional[int] = None, what: str = "snapshot") -> None:
        self.size = 0
        self.declared = declared
        self.what = what
        self.meta: Optional[BoltMeta] = None
        # One pass serves both hashes: etcd's trailer is the sha256 of everything but the last 32
        # bytes, and the file's sha256 (the manifest's) is that state fed the last 32 bytes too.
        self._body = hashlib.sha256()  # everything but the last 32 bytes seen so far
        self._tail = b""
        self._head = bytearray()

    @property
    def meta_ok(self) -> bool:
        return self.meta is not None

    def update(self, chunk: Chunk) -> None:
        n = len(chunk)
        if not n:
            return
        self.size += n
        if self.declared is not None and self.size > self.declared:
            raise BackupCorrupt(f"{self.what}: more data than the {self.declared} bytes declared")
        if len(self._head) < HEAD:
            self._head += chunk[: HEAD - len(self._head)]
            if self.meta is None and len(self._head) >= min(HEAD, self.declared or HEAD):
                self.meta = _meta_of(bytes(self._head), self.declared or _UNKNOWN, self.what)
        if n >= TRAILER:
            if self._tail:
                self._body.update(self._tail)
            self._body.update(memoryview(chunk)[:-TRAILER])
            self._tail = bytes(chunk[-TRAILER:])
        else:
            data = self._tail + bytes(chunk)
            if len(data) > TRAILER:
                self._body.update(data[:-TRAILER])
            self._tail = data[-TRAILER:]

    @property
    def sha256(self) -> str:
        """Of every byte so far (the trailer included)."""
        whole = self._body.copy()
        whole.update(self._tail)
        return whole.hexdigest()

    def finish(self) -> SnapshotFacts:
        """The facts, or BackupCorrupt naming exactly what is wrong."""
        what = self.what
        if self.declared is not None and self.size != self.declared:
            raise BackupCorrupt(f"{what}: {self.size} bytes arrived, {self.declared} declared (truncated)")
        check_size(self.size, what)
        if self._body.digest() != self._tail:
            raise BackupCorrupt(f"{what}: sha256 trailer does not match the data (corrupted in transit or on disk)")
        meta = _meta_of(bytes(self._head), self.size, what)
        self.meta = meta
        return SnapshotFacts(self.size, self.sha256, meta.page_size, meta.txid, meta.high_water, meta.root, True)
