"""bbolt, read bounded: the page-level reader under ``snapdb`` (pure Python, no mmap).

The on-disk format of go.etcd.io/bbolt (``internal/common/page.go``, ``meta.go``): two meta pages,
then branch and leaf pages of a B+tree per bucket. ``_Reader`` reads pages piecemeal through a
``read_at(offset, n)`` callable: page ids are checked against the high-water mark, trees against a
depth limit, pages reached twice are refused, and no page (overflow pages included) is loaded
whole. Every malformed input is a ``SnapshotFormatError``. Split out of ``snapdb`` (the prototype
was one file) so each module stays readable; ``snapdb`` is the API.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Set, Tuple

from etcd_agent.errors import SnapshotFormatError

ReadAt = Callable[[int, int], bytes]
"""``read_at(offset, n)``: n bytes from ``offset`` (fewer only at the end of the file)."""

# --- bbolt format (go.etcd.io/bbolt internal/common/page.go, meta.go) ---------------------------
TRAILER = 32  # etcd's sha256 of the db, appended by the server to a snapshot
BOLT_MAGIC = 0xED0CDAED
BOLT_VERSION = 2
PAGE_HEADER = 16  # id u64, flags u16, count u16, overflow u32
ELEMENT = 16  # branch: pos u32, ksize u32, pgid u64; leaf: flags u32, pos u32, ksize u32, vsize u32
META_SIZE = 64  # magic, version, pageSize, flags, root{pgid, seq}, freelist, pgid(hwm), txid, checksum
BRANCH_FLAG, LEAF_FLAG, META_FLAG = 0x01, 0x02, 0x04
BUCKET_LEAF_FLAG = 0x01
BUCKET_HEADER = 16  # root pgid u64 (0 = inline bucket: a page follows), sequence u64
NO_FREELIST = 0xFFFFFFFFFFFFFFFF  # bbolt's PgidNoFreelist (NoFreelistSync)

# --- limits: generous for any real etcd, small enough that hostile input costs little ----------
MIN_PAGE_SIZE = 1024
MAX_PAGE_SIZE = 65536
MAX_DEPTH = 32  # a bbolt tree of 4 KiB pages is ~5 deep at 8 GiB
MAX_KEY = 256  # keys of the small buckets (member ids are <= 16 bytes, meta keys ~20)
MAX_VALUE = 64 * 1024  # one member / confState / downgrade value
MAX_BUCKET_VALUE = MAX_PAGE_SIZE  # a bucket header plus its inline page
MAX_VALUE_BYTES = 4 * 1024 * 1024  # all values read by one parse
MAX_SMALL_PAGES = 8192  # pages visited walking the small buckets of one parse
MAX_ELEMENTS_READ = 1024 * 1024  # bytes of one page's element array (count <= 65535 -> 1 MiB)
CURSOR_CHUNK = 256  # child ids a walk reads at once from a branch page (4 KiB)
MAX_COUNT_PAGES = 1 << 25  # count_entries keeps a bit per page: 4 MiB, 128 GiB of 4 KiB pages


# --- the reader --------------------------------------------------------------------------------
def _fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@dataclass(frozen=True)
class BoltMeta:
    """The winning bbolt meta page: bbolt's own choice (valid, highest txid)."""

    page_size: int
    root: int
    freelist: int
    high_water: int
    txid: int


@dataclass(frozen=True)
class _Page:
    """A bbolt page, read piecemeal: ``base`` is its offset in the file, or ``data`` holds an
    inline bucket's page; ``span`` is how many bytes it covers (overflow pages included)."""

    pgid: int  # 0 for an inline page
    base: int
    data: Optional[bytes]
    span: int
    flags: int
    count: int


@dataclass(frozen=True)
class _Entry:
    """A leaf element: its key (None when longer than the walk's key limit) and where its value is."""

    flags: int
    key: Optional[bytes]
    page: _Page
    value_at: int
    vsize: int


@dataclass(frozen=True)
class _Bucket:
    root: int  # 0: inline
    inline: Optional[bytes]  # the inline page


class _Reader:
    def __init__(self, read_at: ReadAt, size: int) -> None:
        self._read_at = read_at
        self.size = size
        self.db_len = size
        self.meta = BoltMeta(0, 0, 0, 0, 0)
        self.small_pages = 0
        self.value_bytes = 0

    # raw access
    def read(self, offset: int, n: int, what: str) -> bytes:
        if n < 0 or offset < 0 or offset + n > self.db_len:
            raise SnapshotFormatError(f"{what}: bytes {offset}..{offset + n} lie outside the database")
        if n == 0:
            return b""
        data = self._read_at(offset, n)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("read_at must return bytes")
        if len(data) != n:
            raise SnapshotFormatError(f"{what}: file ends at byte {offset + len(data)}, {n} bytes wanted at {offset}")
        return bytes(data)

    def trailer(self) -> bytes:
        """etcd's sha256 after the database (only called when there is one)."""
        data = self._read_at(self.db_len, TRAILER)
        if len(data) != TRAILER:
            raise SnapshotFormatError(f"file ends inside the sha256 trailer at byte {self.db_len + len(data)}")
        return bytes(data)

    # meta pages
    def load_meta(self) -> None:
        if self.size < TRAILER:
            raise SnapshotFormatError(f"{self.size} bytes is too small for an etcd snapshot")
        # Where the db ends: etcd's own rule for "has a sha256 trailer" (hasChecksum).
        if self.size % 512 == TRAILER:
            self.db_len = self.size - TRAILER
        metas: List[BoltMeta] = []
        problems: List[str] = []
        m0 = self._try_meta(0, 0, problems)
        if m0 is not None:
            metas.append(m0)
            sizes: Tuple[int, ...] = (m0.page_size,)
        else:
            # meta 0 unreadable: look for meta 1 at each legal page size, as bbolt does
            sizes = tuple(1 << s for s in range(10, 17))
        for ps in sizes:
            m1 = self._try_meta(1, ps, problems)
            if m1 is not None and m1.page_size == ps:
                metas.append(m1)
                break
        if not metas:
            raise SnapshotFormatError(f"not a bbolt database ({'; '.join(problems[:2])})")
        # bbolt's db.meta(): the valid meta page with the higher txid wins
        meta = max(metas, key=lambda m: m.txid)
        ps = meta.page_size
        if meta.high_water < 4 or meta.high_water > self.db_len // ps:
            raise SnapshotFormatError(
                f"bbolt high-water mark {meta.high_water} x page size {ps} does not fit in {self.db_len} bytes"
            )
        if self.db_len != self.size and meta.high_water * ps != self.db_len:
            raise SnapshotFormatError(
                f"bbolt says {meta.high_water} pages of {ps} bytes but {self.db_len} bytes precede the trailer"
            )
        if not 2 <= meta.root < meta.high_water:
            raise SnapshotFormatError(f"root page {meta.root} outside the db (high water {meta.high_water})")
        if meta.freelist != NO_FREELIST and not 2 <= meta.freelist < meta.high_water:
            raise SnapshotFormatError(f"freelist page {meta.freelist} outside the db (high water {meta.high_water})")
        self.meta = meta

    def _try_meta(self, index: int, offset: int, problems: List[str]) -> Optional[BoltMeta]:
        if offset + PAGE_HEADER + META_SIZE > self.db_len:
            problems.append(f"meta page {index}: beyond the end of the file")
            return None
        page = self.read(offset, PAGE_HEADER + META_SIZE, f"meta page {index}")
        pgid, flags, _count, _overflow = struct.unpack_from("<QHHI", page, 0)
        body = page[PAGE_HEADER:]
        magic, version, page_size, _mflags, root, _seq, freelist, hwm, txid, checksum = struct.unpack(
            "<IIIIQQQQQQ", body
        )
        if magic != BOLT_MAGIC:
            problems.append(f"meta page {index}: bad magic {magic:#x}")
        elif version != BOLT_VERSION:
            problems.append(f"meta page {index}: unsupported bbolt version {version}")
        elif checksum != _fnv64a(body[:56]):
            problems.append(f"meta page {index}: checksum mismatch")
        elif flags != META_FLAG or pgid != index:
            problems.append(f"meta page {index}: header says page {pgid} flags {flags:#x}")
        elif page_size < MIN_PAGE_SIZE or page_size > MAX_PAGE_SIZE or page_size & (page_size - 1):
            problems.append(f"meta page {index}: implausible page size {page_size}")
        else:
            return BoltMeta(page_size, root, freelist, hwm, txid)
        return None

    # pages
    def page(self, pgid: int, what: str) -> _Page:
        hwm = self.meta.high_water
        if not 2 <= pgid < hwm:
            raise SnapshotFormatError(f"{what}: page id {pgid} outside the db (high water {hwm})")
        ps = self.meta.page_size
        head = self.read(pgid * ps, PAGE_HEADER, what)
        hid, flags, count, overflow = struct.unpack("<QHHI", head)
        if hid != pgid:
            raise SnapshotFormatError(f"{what}: page {pgid} says it is page {hid}")
        if pgid + overflow >= hwm:
            raise SnapshotFormatError(f"{what}: page {pgid} overflows {overflow} pages past the high water {hwm}")
        return self._checked(_Page(pgid, pgid * ps, None, (overflow + 1) * ps, flags, count), what)

    def inline_page(self, data: bytes, what: str) -> _Page:
        if len(data) < PAGE_HEADER:
            raise SnapshotFormatError(f"{what}: inline bucket of {len(data)} bytes has no page")
        _id, flags, count, _overflow = struct.unpack_from("<QHHI", data, 0)
        page = self._checked(_Page(0, 0, data, len(data), flags, count), what)
        if flags != LEAF_FLAG:
            raise SnapshotFormatError(f"{what}: inline bucket page is not a leaf (flags {flags:#x})")
        return page

    @staticmethod
    def _checked(page: _Page, what: str) -> _Page:
        which = f"page {page.pgid}" if page.pgid else "inline page"
        if page.flags not in (BRANCH_FLAG, LEAF_FLAG):
            raise SnapshotFormatError(f"{what}: {which} has flags {page.flags:#x}, not a branch or leaf")
        if PAGE_HEADER + page.count * ELEMENT > page.span:
            raise SnapshotFormatError(f"{what}: {which} claims {page.count} elements, more than it holds")
        return page

    def bytes_of(self, page: _Page, offset: int, n: int, what: str) -> bytes:
        if offset < 0 or n < 0 or offset + n > page.span:
            raise SnapshotFormatError(f"{what}: data at {offset}+{n} runs past page {page.pgid} ({page.span} bytes)")
        if page.data is not None:
            return page.data[offset : offset + n]
        return self.read(page.base + offset, n, what)

    def elements(self, page: _Page, first: int, n: int, what: str) -> bytes:
        """The raw element headers ``first .. first+n-1`` of a page."""
        if n * ELEMENT > MAX_ELEMENTS_READ:
            raise SnapshotFormatError(f"{what}: page {page.pgid} has too many elements ({page.count})")
        return self.bytes_of(page, PAGE_HEADER + first * ELEMENT, n * ELEMENT, what)

    @staticmethod
    def branch_child(raw: bytes, i: int) -> int:
        """The child page id of branch element ``i`` of ``raw`` (checked when it is read)."""
        _pos, _ksize, child = struct.unpack_from("<IIQ", raw, i * ELEMENT)
        return int(child)

    def leaf_entry(self, page: _Page, raw: bytes, i: int, index: int, key_limit: int, what: str) -> _Entry:
        """Element ``index`` of a leaf whose headers from ``index - i`` on are in ``raw``."""
        flags, pos, ksize, vsize = struct.unpack_from("<IIII", raw, i * ELEMENT)
        at = PAGE_HEADER + index * ELEMENT + pos  # pos counts from the element itself
        if at < PAGE_HEADER + page.count * ELEMENT or at + ksize + vsize > page.span:
            raise SnapshotFormatError(
                f"{what}: leaf element {index} of page {page.pgid} points outside its page"
            )
        key = self.bytes_of(page, at, ksize, what) if ksize <= key_limit else None
        return _Entry(flags, key, page, at + ksize, vsize)

    def value(self, entry: _Entry, limit: int, what: str) -> bytes:
        if entry.vsize > limit:
            raise SnapshotFormatError(f"{what}: value of {entry.vsize} bytes (limit {limit})")
        self.value_bytes += entry.vsize
        if self.value_bytes > MAX_VALUE_BYTES:
            raise SnapshotFormatError(f"{what}: more than {MAX_VALUE_BYTES} bytes of values to read")
        return self.bytes_of(entry.page, entry.value_at, entry.vsize, what)

    # buckets
    def bucket_root(self, bucket: _Bucket, what: str) -> _Page:
        if bucket.inline is not None:
            return self.inline_page(bucket.inline, what)
        return self.page(bucket.root, what)

    def bucket_of(self, entry: _Entry, what: str) -> _Bucket:
        if not entry.flags & BUCKET_LEAF_FLAG:
            raise SnapshotFormatError(f"{what}: entry is not a bucket")
        raw = self.value(entry, MAX_BUCKET_VALUE, what)
        if len(raw) < BUCKET_HEADER:
            raise SnapshotFormatError(f"{what}: bucket header of {len(raw)} bytes")
        root = struct.unpack_from("<Q", raw, 0)[0]
        if root == 0:
            return _Bucket(0, raw[BUCKET_HEADER:])
        if len(raw) != BUCKET_HEADER:
            raise SnapshotFormatError(f"{what}: bucket on page {root} has {len(raw) - BUCKET_HEADER} stray bytes")
        return _Bucket(int(root), None)

    def leaves(self, bucket: _Bucket, what: str, mark: Callable[[_Page], None]) -> Iterator[_Page]:
        """The leaf pages of a bucket's tree in key order. Depth-first with one cursor per level
        that reads child ids CURSOR_CHUNK at a time, so memory is bounded by the depth limit
        whatever the fan-out; ``mark`` sees every page first (budgets, pages reached twice)."""
        root = self.bucket_root(bucket, what)
        mark(root)
        if root.flags == LEAF_FLAG:
            yield root  # may be empty: an empty bucket
            return
        if root.count == 0:
            raise SnapshotFormatError(f"{what}: empty branch page {root.pgid}")
        stack = [_Cursor(root)]
        while stack:
            cur = stack[-1]
            if cur.index >= cur.page.count:
                stack.pop()
                continue
            child = self.page(self.next_child(cur, what), what)
            mark(child)
            if child.count == 0:
                raise SnapshotFormatError(f"{what}: empty page {child.pgid} below the bucket root")
            if child.flags == LEAF_FLAG:
                yield child
            elif len(stack) + 1 >= MAX_DEPTH:
                raise SnapshotFormatError(f"{what}: tree deeper than {MAX_DEPTH} levels")
            else:
                stack.append(_Cursor(child))

    def next_child(self, cur: _Cursor, what: str) -> int:
        i = cur.index
        if not cur.first <= i < cur.first + len(cur.chunk) // ELEMENT:
            cur.first = i
            cur.chunk = self.elements(cur.page, i, min(CURSOR_CHUNK, cur.page.count - i), what)
        cur.index += 1
        return self.branch_child(cur.chunk, i - cur.first)

    def walk(self, bucket: _Bucket, max_entries: int, key_limit: int, what: str) -> Iterator[_Entry]:
        """Every leaf entry of a (small) bucket, in key order; bounded in entries, pages and depth,
        and a page reached twice is refused (a loop or a shared subtree is corruption)."""
        seen: Set[int] = set()

        def mark(page: _Page) -> None:
            if not page.pgid:
                return
            if page.pgid in seen:
                raise SnapshotFormatError(f"{what}: page {page.pgid} is reached twice")
            seen.add(page.pgid)
            self.small_pages += 1
            if self.small_pages > MAX_SMALL_PAGES:
                raise SnapshotFormatError(f"{what}: more than {MAX_SMALL_PAGES} pages to walk")

        entries = 0
        for leaf in self.leaves(bucket, what, mark):
            entries += leaf.count
            if entries > max_entries:  # checked before the elements are read
                raise SnapshotFormatError(f"{what}: more than {max_entries} entries")
            raw = self.elements(leaf, 0, leaf.count, what)
            for i in range(leaf.count):
                yield self.leaf_entry(leaf, raw, i, i, key_limit, what)

    def edge(self, bucket: _Bucket, last: bool, what: str) -> Optional[_Entry]:
        """The first or last entry of a bucket of any size: one path down, a few small reads
        (a loop in the tree ends at the depth limit)."""
        page = self.bucket_root(bucket, what)
        for depth in range(MAX_DEPTH):
            if page.count == 0:
                if depth == 0 and page.flags == LEAF_FLAG:
                    return None
                raise SnapshotFormatError(f"{what}: empty page {page.pgid} below the bucket root")
            i = page.count - 1 if last else 0
            raw = self.elements(page, i, 1, what)
            if page.flags == BRANCH_FLAG:
                page = self.page(self.branch_child(raw, 0), what)
                continue
            return self.leaf_entry(page, raw, 0, i, MAX_KEY, what)
        raise SnapshotFormatError(f"{what}: tree deeper than {MAX_DEPTH} levels")

    def count(self, bucket: _Bucket, seen: bytearray, what: str) -> int:
        """Leaf entries of a bucket of any size, from page headers: every branch page's child ids
        and 16 bytes of every leaf page are read. Each page at most once (``seen`` has a bit per
        page of the db), so at most the high-water mark of pages whatever the input."""

        def mark(page: _Page) -> None:
            if not page.pgid:
                return
            byte, bit = divmod(page.pgid, 8)
            if seen[byte] & (1 << bit):
                raise SnapshotFormatError(f"{what}: page {page.pgid} is reached twice")
            seen[byte] |= 1 << bit

        return sum(leaf.count for leaf in self.leaves(bucket, what, mark))


class _Cursor:
    """Where a depth-first walk is in one branch page, with a chunk of its child ids."""

    __slots__ = ("page", "index", "first", "chunk")

    def __init__(self, page: _Page) -> None:
        self.page = page
        self.index = 0
        self.first = 0
        self.chunk = b""
