"""etcd/snapdb on hand-built hostile bbolt databases: limits, loops, huge claims (pure).

Moved from the prototype (its real-etcd half is tests/integration/test_snapdb.py)."""
from __future__ import annotations

import json
import struct
import time
from typing import Any, Dict, Optional, Sequence, Tuple

import pytest

from etcd_agent.etcd import bbolt, snapdb
from etcd_agent.etcd.snapdb import SnapshotFormatError


def test_json_limits() -> None:
    with pytest.raises(SnapshotFormatError, match="nested"):
        snapdb._json(b"[" * 5000 + b"]" * 5000, "x")
    with pytest.raises(SnapshotFormatError, match="bytes"):
        snapdb._json(b'{"a":"' + b"x" * 70000 + b'"}', "x")
    with pytest.raises(SnapshotFormatError, match="bad JSON"):
        snapdb._json(b'{"a": NaN}', "x")
    with pytest.raises(SnapshotFormatError, match="bad JSON"):
        snapdb._json(b'{"a": 1, "a": 2}', "x")
    with pytest.raises(SnapshotFormatError, match="bad JSON"):
        snapdb._json(b'{"a": ' + b"9" * 5000 + b"}", "x")
    with pytest.raises(SnapshotFormatError, match="not an object"):
        snapdb._json(b"[1]", "x")
    with pytest.raises(SnapshotFormatError, match="not a member id"):
        snapdb._member(b"0x12", b"{}")
    with pytest.raises(SnapshotFormatError, match="differs"):
        snapdb._member(b"12", b'{"id": 19}')
    assert snapdb._member(b"1A", b'{"id": 26, "peerURLs": null}').peer_urls == ()


def test_derivations_match_etcd_formulas() -> None:
    # NewMember sorts the peer URLs before hashing; genID sorts the ids
    a = snapdb.member_id_from(["http://b:2380", "http://a:2380"], "t")
    assert a == snapdb.member_id_from(["http://a:2380", "http://b:2380"], "t")
    assert snapdb.cluster_id_from([3, 1, 2]) == snapdb.cluster_id_from([1, 2, 3])


# --- hand-built hostile databases (a sparse bbolt writer) ----------------------------------------
class Bolt:
    """Writes bbolt pages into a sparse map; ``source()`` serves them through ``read_at`` (zeros
    elsewhere), counting what is read, so a "database" can claim terabytes without existing."""

    def __init__(self, ps: int = 4096) -> None:
        self.ps = ps
        self.pages: Dict[int, bytes] = {}

    @staticmethod
    def leaf_bytes(pgid: int, items: Sequence[Tuple[int, bytes, bytes]], overflow: int = 0,
                   count: Optional[int] = None) -> bytes:
        n = len(items)
        elems, body = b"", b""
        for i, (fl, k, v) in enumerate(items):
            pos = 16 + 16 * n + len(body) - (16 + 16 * i)  # from the element to its key
            elems += struct.pack("<IIII", fl, pos, len(k), len(v))
            body += k + v
        return struct.pack("<QHHI", pgid, 0x02, n if count is None else count, overflow) + elems + body

    def leaf(self, pgid: int, items: Sequence[Tuple[int, bytes, bytes]], overflow: int = 0,
             count: Optional[int] = None) -> None:
        self.pages[pgid] = self.leaf_bytes(pgid, items, overflow, count)

    def branch(self, pgid: int, children: Sequence[Tuple[bytes, int]], overflow: int = 0) -> None:
        n = len(children)
        elems, body = b"", b""
        for i, (k, child) in enumerate(children):
            pos = 16 + 16 * n + len(body) - (16 + 16 * i)
            elems += struct.pack("<IIQ", pos, len(k), child)
            body += k
        self.pages[pgid] = struct.pack("<QHHI", pgid, 0x01, n, overflow) + elems + body

    @staticmethod
    def ref(pgid: int) -> bytes:
        return struct.pack("<QQ", pgid, 0)

    @classmethod
    def inline(cls, items: Sequence[Tuple[int, bytes, bytes]]) -> bytes:
        return struct.pack("<QQ", 0, 0) + cls.leaf_bytes(0, items)

    def source(self, hwm: int, root: int, txid: int = 7) -> Tuple[snapdb.ReadAt, int, Dict[str, int]]:
        for i in (0, 1):
            body = struct.pack("<IIIIQQQQQ", 0xED0CDAED, 2, self.ps, 0, root, 0, 2**64 - 1, hwm, txid - i)
            body += struct.pack("<Q", bbolt._fnv64a(body))
            self.pages[i] = struct.pack("<QHHI", i, 0x04, 0, 0) + body
        stats = {"reads": 0, "bytes": 0, "max": 0}
        ps = self.ps
        short = {p: d for p, d in self.pages.items() if len(d) <= ps}
        long = [(p * ps, d) for p, d in self.pages.items() if len(d) > ps]  # overflowing: few

        def read_at(off: int, n: int) -> bytes:
            stats["reads"] += 1
            stats["bytes"] += n
            stats["max"] = max(stats["max"], n)
            out = bytearray(n)
            cands = [(p * ps, short[p]) for p in range(off // ps, (off + n - 1) // ps + 1) if p in short]
            for start, data in cands + long:
                lo, hi = max(off, start), min(off + n, start + len(data))
                if lo < hi:
                    out[lo - off : hi - off] = data[lo - start : hi - start]
            return bytes(out)

        return read_at, hwm * self.ps + 32, stats


def _member_json(mid: int, url: str, **extra: Any) -> bytes:
    return json.dumps({"id": mid, "peerURLs": [url], **extra}).encode()


def _etcd_like(b: Bolt, members_value: bytes, key_value: bytes = Bolt.inline([])) -> None:
    """Root leaf at page 3 with etcd's required buckets; members given by the caller."""
    meta = Bolt.inline([(0, b"consistent_index", (9).to_bytes(8, "big"))])
    b.leaf(3, [(1, b"key", key_value), (1, b"members", members_value), (1, b"meta", meta)])


def test_built_db_reads_right() -> None:
    """Every value format, a key bucket on a branch page, a members bucket on its own page."""
    b = Bolt()
    r1, r2 = snapdb.member_id_from(["http://a:1"], "t"), snapdb.member_id_from(["http://b:1"], "t")
    def rev(m: int, s: int, t: bytes = b"") -> bytes:
        return m.to_bytes(8, "big") + b"_" + s.to_bytes(8, "big") + t

    b.leaf(4, [(0, b"%x" % r1, _member_json(r1, "http://a:1", name="a", clientURLs=["http://a:2"])),
               (0, b"%x" % r2, _member_json(r2, "http://b:1", isLearner=True))])
    b.leaf(5, [(0, rev(2, 0), b"x"), (0, rev(3, 0), b"y")])
    b.leaf(6, [(0, rev(4, 0), b"z"), (0, rev(9, 1, b"t"), b"")])
    b.branch(7, [(rev(2, 0), 5), (rev(4, 0), 6)])
    meta = Bolt.inline([
        (0, b"confState", b'{"voters":[%d],"learners":[%d]}' % (r1, r2)),
        (0, b"consistent_index", (42).to_bytes(8, "big")),
        (0, b"finishedCompactRev", rev(3, 0)),
        (0, b"scheduledCompactRev", rev(4, 0)),
        (0, b"storageVersion", b"3.6"),
        (0, b"term", (5).to_bytes(8, "big")),
    ])
    cluster_b = Bolt.inline([(0, b"clusterVersion", b"3.5.0"),
                             (0, b"downgrade", b'{"target-version":"3.4.0","enabled":true}')])
    removed = Bolt.inline([(0, b"abc", b"removed")])
    b.leaf(3, [(1, b"cluster", cluster_b), (1, b"key", Bolt.ref(7)), (1, b"members", Bolt.ref(4)),
               (1, b"members_removed", removed), (1, b"meta", meta)])
    read_at, size, _ = b.source(hwm=8, root=3)
    got = snapdb.parse_identity(read_at, size, count_entries=True)
    want = {r1: snapdb.Member(r1, "a", ("http://a:1",), ("http://a:2",), False),
            r2: snapdb.Member(r2, "", ("http://b:1",), (), True)}
    assert got.members == tuple(want[k] for k in sorted(want))
    assert all(m.is_bootstrap_member_of("t") for m in got.members)
    assert got.removed_member_ids == (0xABC,)
    assert got.cluster_version == "3.5.0" and got.downgrade == snapdb.Downgrade("3.4.0", True)
    assert (got.consistent_index, got.term, got.storage_version) == (42, 5, "3.6")
    assert got.conf_state == snapdb.ConfState((r1,), (r2,), (), (), False)
    assert (got.finished_compact_revision, got.scheduled_compact_revision) == (3, 4)
    assert got.first_revision == snapdb.Revision(2, 0)
    assert got.last_revision == snapdb.Revision(9, 1, tombstone=True)
    assert dict(got.bucket_entries or ()) == {"cluster": 2, "key": 4, "members": 2, "members_removed": 1, "meta": 6}


def _expect(b: Bolt, hwm: int, match: str, count: bool = True, max_read: int = 64 * 1024) -> Dict[str, int]:
    read_at, size, stats = b.source(hwm=hwm, root=3)
    t = time.monotonic()
    with pytest.raises(SnapshotFormatError, match=match):
        snapdb.parse_identity(read_at, size, count_entries=count)
    assert time.monotonic() - t < 1.0
    assert stats["max"] <= max_read, stats
    return stats


def test_built_exponential_dag_is_refused() -> None:
    """30 branch pages each pointing twice at the next: 2^30 paths, one visit each page at most."""
    b = Bolt()
    for p in range(10, 40):
        b.branch(p, [(b"a", p + 1), (b"b", p + 1)])
    b.leaf(40, [(0, b"1", _member_json(1, "http://x"))])
    _etcd_like(b, Bolt.ref(10))
    stats = _expect(b, 41, "reached twice|deeper", count=False)
    assert stats["reads"] < 200
    # the same shape under the key bucket, counted
    b = Bolt()
    for p in range(10, 40):
        b.branch(p, [(b"a", p + 1), (b"b", p + 1)])
    b.leaf(40, [(0, b"\0" * 8 + b"_" + b"\0" * 8, b"")])
    _etcd_like(b, Bolt.inline([]), key_value=Bolt.ref(10))
    stats = _expect(b, 41, "reached twice|deeper")
    assert stats["reads"] < 200


def test_built_loops_end() -> None:
    b = Bolt()
    b.branch(10, [(b"a", 10)])  # a page that is its own child
    _etcd_like(b, Bolt.inline([]), key_value=Bolt.ref(10))
    _expect(b, 11, "deeper than 32 levels", count=False)
    _expect(b, 11, "deeper|reached twice", count=True)
    b = Bolt()
    for p in range(10, 50):  # a chain 40 deep
        b.branch(p, [(b"a", p + 1)])
    _etcd_like(b, Bolt.ref(10))
    _expect(b, 51, "deeper than 32 levels", count=False)


def test_built_limits() -> None:
    # too many members: refused from the page header, before the elements are read
    b = Bolt()
    b.leaf(10, [(0, b"%x" % (i + 1), b"{}") for i in range(2000)], overflow=20)
    _etcd_like(b, Bolt.ref(10))
    _expect(b, 40, "more than 1024 entries", count=False)
    # a 70 KB member value
    b = Bolt()
    b.leaf(10, [(0, b"1", b'{"name":"' + b"x" * 70000 + b'"}')], overflow=20)
    _etcd_like(b, Bolt.ref(10))
    _expect(b, 40, "limit 65536", count=False)
    # deep JSON
    b = Bolt()
    _etcd_like(b, Bolt.inline([(0, b"1", b'{"x":' + b"[" * 100 + b"]" * 100 + b"}")]))
    _expect(b, 11, "nested deeper", count=False)
    # a member value that is not a member
    for bad, what in ((b'{"id": "1"}', "differs"), (b'{"peerURLs": "http://x"}', "list of strings"),
                      (b'{"isLearner": 1}', "boolean"), (b"\xff", "UTF-8"), (b'{"name": 5}', "string")):
        b = Bolt()
        _etcd_like(b, Bolt.inline([(0, b"1", bad)]))
        _expect(b, 11, what, count=False)
    # keys that are not member ids
    for key in (b"0x1", b" 1", b"1_0", b"", b"0", b"1" * 17):
        b = Bolt()
        _etcd_like(b, Bolt.inline([(0, key, b"{}")]))
        _expect(b, 11, "member id", count=False)
    # a key bucket whose last key is not a revision
    b = Bolt()
    _etcd_like(b, Bolt.inline([]), key_value=Bolt.inline([(0, b"short", b"")]))
    _expect(b, 11, "not a revision", count=False)
    # no meta bucket: not etcd's
    b = Bolt()
    b.leaf(3, [(1, b"key", Bolt.inline([]))])
    _expect(b, 11, "no 'meta' bucket", count=False)


def test_built_huge_claims_stay_cheap() -> None:
    """A leaf claiming 65535 elements over 300 overflow pages, in a "database" of 2^30 pages
    (4 TiB): the identity reads kilobytes; counting refuses rather than allocate 128 MiB."""
    b = Bolt()
    rev = (5).to_bytes(8, "big") + b"_" + bytes(8)
    # elements 0 and 65534 (the ones read) point at one key after the element array
    n = 65535
    arr = bytearray(16 * n)
    for i in (0, n - 1):
        struct.pack_into("<IIII", arr, 16 * i, 0, 16 + 16 * n - (16 + 16 * i), 17, 0)
    b.pages[10] = struct.pack("<QHHI", 10, 0x02, n, 300) + bytes(arr) + rev
    _etcd_like(b, Bolt.inline([]), key_value=Bolt.ref(10))
    read_at, size, stats = b.source(hwm=1 << 30, root=3)
    got = snapdb.parse_identity(read_at, size)
    assert got.last_revision == snapdb.Revision(5, 0) and got.high_water == 1 << 30
    assert stats["bytes"] < 64 * 1024 and stats["max"] <= 4096
    with pytest.raises(SnapshotFormatError, match="too large to count"):
        snapdb.parse_identity(read_at, size, count_entries=True)
    # within the counting limit the bitmap is 2 MiB and the big leaf costs one header read
    read_at, size, stats = b.source(hwm=1 << 24, root=3)
    got = snapdb.parse_identity(read_at, size, count_entries=True)
    assert got.key_revisions == 65535 and stats["max"] <= 4096


def test_built_wide_branch_uses_little_memory() -> None:
    """A branch of 20000 children (on overflow pages): walked with a 4 KiB window of child ids."""
    import tracemalloc

    b = Bolt()
    def rev(i: int) -> bytes:
        return i.to_bytes(8, "big") + b"_" + bytes(8)

    n = 20000
    b.branch(10, [(rev(i + 1), 1000 + i) for i in range(n)], overflow=(16 + 33 * n) // 4096 + 1)
    for i in range(n):
        b.pages[1000 + i] = Bolt.leaf_bytes(1000 + i, [(0, rev(i + 1), b"")])  # past its overflow
    _etcd_like(b, Bolt.inline([]), key_value=Bolt.ref(10))
    read_at, size, stats = b.source(hwm=1000 + n, root=3)
    tracemalloc.start()
    try:
        got = snapdb.parse_identity(read_at, size, count_entries=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.key_revisions == n and got.last_revision == snapdb.Revision(n, 0)
    assert stats["max"] <= 4096
    assert peak < 1024 * 1024, peak
