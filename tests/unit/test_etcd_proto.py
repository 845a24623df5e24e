"""The delta's messages (pure): etcd's generated classes read into segment events, bounded."""
import pytest

from etcd_agent.chain.segments import DELETE, PUT, Event
from etcd_agent.etcd import proto
from etcd_agent.etcd.pb import kv_pb2, rpc_pb2

LIMIT = 1 << 20


def test_watch_response_roundtrip():
    raw = rpc_pb2.WatchResponse(
        header=rpc_pb2.ResponseHeader(cluster_id=11, member_id=22, revision=7), watch_id=-1, fragment=True,
        events=[
            kv_pb2.Event(type=kv_pb2.Event.PUT, kv=kv_pb2.KeyValue(key=b"a", value=b"1", create_revision=5,
                                                                    mod_revision=7, version=2, lease=0x1234)),
            # a delete's KeyValue carries the key and revision only; anything else is not kept
            kv_pb2.Event(type=kv_pb2.Event.DELETE, kv=kv_pb2.KeyValue(key=b"b", mod_revision=7, value=b"x")),
        ],
    ).SerializeToString()
    m = proto.decode_watch_response(raw, LIMIT)
    assert m.header.revision == 7 and m.header.cluster_id == 11
    assert m.watch_id == -1 and m.fragment and not m.created
    assert m.events == (Event(PUT, b"a", b"1", 7, 5, 2, 0x1234), Event(DELETE, b"b", b"", 7, 0, 0, 0))


def test_progress_and_compaction_shapes():
    raw = rpc_pb2.WatchResponse(header=rpc_pb2.ResponseHeader(revision=9), watch_id=-1).SerializeToString()
    m = proto.decode_watch_response(raw, LIMIT)
    assert m.is_progress and m.header.revision == 9
    m = proto.decode_watch_response(rpc_pb2.WatchResponse(canceled=True, compact_revision=42).SerializeToString(), LIMIT)
    assert m.canceled and m.compact_revision == 42 and not m.is_progress


TOO_LONG = b"\x08" + b"\xff" * 10 + b"\x01"  # an 11-byte varint


@pytest.mark.parametrize("raw", [b"\x0a\x05ab", b"\x08", TOO_LONG, b"\x0b"])
def test_malformed_is_value_error(raw):
    with pytest.raises(ValueError):
        proto.decode_watch_response(raw, LIMIT)


def test_an_event_type_etcd_does_not_define_is_refused():
    raw = rpc_pb2.WatchResponse(events=[kv_pb2.Event(type=2, kv=kv_pb2.KeyValue(key=b"a"))]).SerializeToString()
    with pytest.raises(ValueError, match="unknown event type 2"):
        proto.decode_watch_response(raw, LIMIT)


def test_a_response_past_the_bound_is_refused_unparsed():
    raw = rpc_pb2.WatchResponse(events=[kv_pb2.Event(kv=kv_pb2.KeyValue(key=b"k", value=b"v" * 1000))])
    data = raw.SerializeToString()
    assert proto.decode_watch_response(data, len(data)).events[0].value == b"v" * 1000
    with pytest.raises(ValueError, match="exceeds the bound"):
        proto.decode_watch_response(data, len(data) - 1)


def test_txn_encoding_is_etcds_message():
    ops = [proto.op_put(b"k", b"v", 5), proto.op_delete(b"d"), proto.op_put(b"i", b"", 9, ignore_value=True)]
    txn = rpc_pb2.TxnRequest.FromString(proto.encode_txn(ops).SerializeToString())
    assert not txn.compare and not txn.failure and len(txn.success) == 3
    put, delete, keep = txn.success
    assert (put.request_put.key, put.request_put.value, put.request_put.lease) == (b"k", b"v", 5)
    assert delete.WhichOneof("request") == "request_delete_range" and delete.request_delete_range.key == b"d"
    assert not delete.request_delete_range.range_end  # exactly one key
    assert keep.request_put.ignore_value and keep.request_put.lease == 9


def test_watch_create_asks_for_fragments_and_progress():
    req = proto.encode_watch_create(b"\0", b"\0", start_revision=12)
    back = rpc_pb2.WatchRequest.FromString(req.SerializeToString()).create_request
    assert (back.key, back.range_end, back.start_revision) == (b"\0", b"\0", 12)
    assert back.progress_notify and back.fragment and not back.prev_kv
