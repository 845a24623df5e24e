"""The wire codec (pure)."""
import pytest

from etcd_agent.delta import proto
from etcd_agent.delta.segments import DELETE, PUT, Event


def kv(key, value=b"", create=0, mod=0, version=0, lease=0):
    return (proto.fbytes(1, key) + proto.fint(2, create) + proto.fint(3, mod) + proto.fint(4, version)
            + (proto.fbytes(5, value) if value else b"") + proto.fint(6, lease))


def test_watch_response_roundtrip():
    ev1 = proto.fint(1, 0) + proto.fbytes(2, kv(b"a", b"1", 5, 7, 2, 0x1234))
    ev2 = proto.fint(1, 1) + proto.fbytes(2, kv(b"b", mod=7))
    hdr = proto.fint(1, 11) + proto.fint(2, 22) + proto.fint(3, 7)
    raw = proto.fbytes(1, hdr) + proto.fint(2, -1) + proto.fint(7, 1) + proto.fbytes(11, ev1) + proto.fbytes(11, ev2)
    m = proto.decode_watch_response(raw)
    assert m.header.revision == 7 and m.header.cluster_id == 11
    assert m.watch_id == -1 and m.fragment and not m.created
    assert m.events == (Event(PUT, b"a", b"1", 7, 5, 2, 0x1234), Event(DELETE, b"b", b"", 7, 0, 0, 0))


def test_progress_and_compaction_shapes():
    m = proto.decode_watch_response(proto.fbytes(1, proto.fint(3, 9)) + proto.fint(2, -1))
    assert m.is_progress and m.header.revision == 9
    m = proto.decode_watch_response(proto.fint(4, 1) + proto.fint(5, 42))
    assert m.canceled and m.compact_revision == 42 and not m.is_progress


TOO_LONG = b"\x08" + b"\xff" * 10 + b"\x01"  # an 11-byte varint


@pytest.mark.parametrize("raw", [b"\x0a\x05ab", b"\x08", TOO_LONG, b"\x0b"])
def test_malformed_is_value_error(raw):
    with pytest.raises(ValueError):
        proto.decode_watch_response(raw)


def test_txn_encoding_roundtrip_through_fields():
    ops = [proto.op_put(b"k", b"v", 5), proto.op_delete(b"d")]
    fields = list(proto.iter_fields(proto.encode_txn(ops)))
    assert [f[0] for f in fields] == [2, 2]
    request_op = {n: v for n, _w, v in proto.iter_fields(fields[0][2])}
    put = {n: v for n, _w, v in proto.iter_fields(request_op[2])}
    assert put == {1: b"k", 2: b"v", 3: 5}
