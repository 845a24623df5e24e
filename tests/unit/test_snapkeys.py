"""etcd/snapkeys: the key space a snapshot holds, read offline (real snapshots and hand-built dbs)."""
from __future__ import annotations

import os
import time

import pytest

from etcd_agent.etcd import snapdb, snapkeys
from etcd_agent.etcd.pb import kv_pb2
from etcd_agent.etcd.snapdb import SnapshotFormatError
from etcd_agent.etcd.snapkeys import KeyspaceDigest, record_of
from tests.unit.test_snapdb import Bolt

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


def rev(m: int, s: int = 0, tomb: bool = False) -> bytes:
    return m.to_bytes(8, "big") + b"_" + s.to_bytes(8, "big") + (b"t" if tomb else b"")


def kv(key: bytes, create: int, mod: int, version: int, value: bytes = b"", lease: int = 0) -> bytes:
    return kv_pb2.KeyValue(key=key, create_revision=create, mod_revision=mod, version=version, value=value,
                           lease=lease).SerializeToString()


def test_real_snapshot_matches_its_identity() -> None:
    path = os.path.join(DATA, "snap-a.db")
    ident = snapdb.read_identity(path, count_entries=True)
    ks = snapkeys.scan_file(path, [b"/registry/secrets/default/s", b"k", b"absent"])
    assert ks.revision == ident.revision
    assert ks.entries == dict(ident.bucket_entries or ())["key"]
    assert ks.live_keys == 2  # make_snapshots.py puts k and one secret
    secret = ks.wanted[b"/registry/secrets/default/s"]
    assert secret is not None and secret.value_size == 100 and secret.value_sha256 == record_of(
        b"", b"x" * 100, 0, 0, 0, 0).value_sha256
    assert ks.wanted[b"k"] is not None and ks.wanted[b"absent"] is None


def _db(items, lease_items=()):
    """A db whose key bucket is a branch over two leaves of ``items`` (revision key, value)."""
    b = Bolt()
    half = len(items) // 2
    b.leaf(5, items[:half])
    b.leaf(6, items[half:])
    b.branch(7, [(items[0][1], 5), (items[half][1], 6)])
    meta = Bolt.inline([(0, b"consistent_index", (9).to_bytes(8, "big"))])
    b.leaf(3, [(1, b"key", Bolt.ref(7)), (1, b"lease", Bolt.inline(list(lease_items))), (1, b"meta", meta)])
    return b.source(hwm=8, root=3)


def test_built_history_gives_the_live_set_and_the_wanted_records() -> None:
    items = [
        (0, rev(2), kv(b"a", 2, 2, 1, b"one")),
        (0, rev(3), kv(b"b", 3, 3, 1, b"two", lease=7)),
        (0, rev(4), kv(b"a", 2, 4, 2, b"ONE")),
        (0, rev(5, 0, tomb=True), kv(b"b", 0, 0, 0)),
        (0, rev(6), kv(b"c", 6, 6, 1, b"three")),
        (0, rev(6, 1), kv(b"d", 6, 6, 1, b"four")),
    ]
    read_at, size, _ = _db(items, [(0, (7).to_bytes(8, "big"), b"lease")])
    ks = snapkeys.scan(read_at, size, [b"a", b"b", b"d"])
    assert (ks.revision, ks.entries, ks.live_keys, ks.lease_entries) == (6, 6, 3, 1)
    want = KeyspaceDigest()
    # the API side adds in key order, the scan in revision order: the digest does not care
    for args in ((b"d", 6, 6, 1, 0), (b"c", 6, 6, 1, 0), (b"a", 2, 4, 2, 0)):
        want.add(*args)
    assert ks.digest == want.hexdigest() and want.count == ks.live_keys
    assert ks.wanted[b"a"] == record_of(b"a", b"ONE", 2, 4, 2, 0)
    assert ks.wanted[b"b"] is None  # deleted at 5
    assert ks.wanted[b"d"] == record_of(b"d", b"four", 6, 6, 1, 0)


def test_a_different_write_changes_the_digest() -> None:
    a, b = KeyspaceDigest(), KeyspaceDigest()
    a.add(b"k", 2, 5, 3, 0)
    b.add(b"k", 2, 6, 3, 0)
    assert a.hexdigest() != b.hexdigest()
    assert record_of(b"k", b"v", 2, 5, 3, 0).differs(record_of(b"k", b"w", 2, 5, 3, 0)).startswith("value sha256")
    assert record_of(b"k", b"v", 2, 5, 3, 0).differs(record_of(b"k", b"v", 2, 5, 4, 0)) == "version 3 against 4"


@pytest.mark.parametrize("items, match", [
    # the KeyValue stored at revision 3 claims to be the write of revision 9
    ([(0, rev(2), kv(b"a", 2, 2, 1, b"x")), (0, rev(3), kv(b"a", 2, 9, 2, b"y"))], "not the put stored there"),
    ([(0, rev(3), kv(b"a", 3, 3, 1)), (0, rev(2), kv(b"b", 2, 2, 1))], "after"),
    ([(0, rev(2), kv(b"", 2, 2, 1)), (0, rev(3), kv(b"b", 3, 3, 1))], "holds no key"),
    ([(0, b"not-a-revision-key", kv(b"a", 2, 2, 1)), (0, rev(3), kv(b"b", 3, 3, 1))], "not a revision"),
    ([(0, rev(2), b"\x0a\xff\xff\xff\x0f"), (0, rev(3), kv(b"b", 3, 3, 1))], "not a KeyValue"),
])
def test_corrupt_entries_are_refused(items, match) -> None:
    read_at, size, _ = _db(items)
    with pytest.raises(SnapshotFormatError, match=match):
        snapkeys.scan(read_at, size)


def test_a_shared_page_and_a_loop_are_refused_quickly() -> None:
    b = Bolt()
    for p in range(10, 40):  # 2^30 paths through 30 pages
        b.branch(p, [(b"a", p + 1), (b"b", p + 1)])
    b.leaf(40, [(0, rev(2), kv(b"a", 2, 2, 1))])
    b.leaf(3, [(1, b"key", Bolt.ref(10)), (1, b"meta", Bolt.inline([]))])
    read_at, size, stats = b.source(hwm=41, root=3)
    t = time.monotonic()
    with pytest.raises(SnapshotFormatError, match="reached twice|deeper"):
        snapkeys.scan(read_at, size)
    assert time.monotonic() - t < 1.0 and stats["reads"] < 200


def test_the_live_key_limit_and_the_check_hook() -> None:
    items = [(0, rev(i), kv(b"k%d" % i, i, i, 1)) for i in range(2, 12)]
    read_at, size, _ = _db(items)
    with pytest.raises(SnapshotFormatError, match="more than 5 live keys"):
        snapkeys.scan(read_at, size, max_keys=5)

    class Stop(Exception):
        pass

    def check() -> None:
        raise Stop()

    with pytest.raises(Stop):
        snapkeys.scan(read_at, size, check=check)
