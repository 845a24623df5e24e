"""etcd's messages on the wire: the generated classes, parsed bounded, against hostile bytes; and
EtcdClient's calls against a real gRPC server on loopback that answers with chosen bytes."""
from concurrent import futures

import grpc
import pytest

from etcd_agent.errors import EtcdError
from etcd_agent.etcd import wire
from etcd_agent.etcd.client import MAX_RESPONSE, EtcdClient, prefix_end
from etcd_agent.etcd.pb import kv_pb2, rpc_pb2

TOO_LONG = b"\x08" + b"\xff" * 10 + b"\x01"  # an 11-byte varint


def nested_txn(depth: int) -> bytes:
    """A RequestOp holding a txn holding a RequestOp ... ``depth`` deep, built byte by byte."""
    raw = b""
    for _ in range(depth):
        op = b"\x22" + _len(raw) + raw  # RequestOp.request_txn = 4
        raw = b"\x12" + _len(op) + op  # TxnRequest.success = 2
    return raw


def _len(b: bytes) -> bytes:
    n, out = len(b), bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_status_with_the_fields_etcd3s_stubs_lack():
    st = rpc_pb2.StatusResponse(
        header=rpc_pb2.ResponseHeader(cluster_id=0xFFFF_FFFF_FFFF_FFF0, member_id=7, revision=42),
        version="3.5.16", dbSize=1 << 40, errors=["NOSPACE", "corrupt"], dbSizeInUse=123, isLearner=True,
    )
    back = wire.parse(rpc_pb2.StatusResponse, st.SerializeToString(), MAX_RESPONSE)
    assert back.header.cluster_id == 0xFFFF_FFFF_FFFF_FFF0  # uint64 ids stay unsigned
    assert (back.isLearner, back.dbSizeInUse, list(back.errors)) == (True, 123, ["NOSPACE", "corrupt"])


def test_negative_int64_and_unknown_fields():
    raw = rpc_pb2.WatchResponse(watch_id=-1, compact_revision=5).SerializeToString() + b"\xf8\x07\x01"  # field 127
    m = wire.parse(rpc_pb2.WatchResponse, raw, 1024)
    assert m.watch_id == -1 and m.compact_revision == 5


@pytest.mark.parametrize("raw, why", [
    (b"\x0a\x05ab", "a length past the end"),
    (b"\x08", "a varint cut short"),
    (b"\x08\xff", "a varint cut short"),
    (TOO_LONG, "an 11-byte varint"),
    (b"\x0b", "a group start (wire type 3) never ended"),
    (b"\x0e", "wire type 6"),
    (b"\x0f", "wire type 7"),
    (b"\x0d\x01\x02", "a fixed32 cut short"),
    (b"\x32\x02\xff\xfe", "cancel_reason (a string) not UTF-8"),
    (b"\x0a\x03\x0a\x05a", "a nested length past its parent's end"),
])
def test_malformed_is_value_error(raw, why):
    with pytest.raises(ValueError, match="not a WatchResponse"):
        wire.parse(rpc_pb2.WatchResponse, raw, 1024)


def test_nesting_is_bounded():
    assert wire.parse(rpc_pb2.TxnRequest, nested_txn(20), 1 << 20).success  # etcd's own depth is fine
    with pytest.raises(ValueError, match="not a TxnRequest"):
        wire.parse(rpc_pb2.TxnRequest, nested_txn(500), 1 << 20)  # past protobuf's recursion limit


def test_the_size_bound_comes_before_parsing():
    raw = kv_pb2.KeyValue(key=b"k", value=b"v" * 100).SerializeToString()
    assert wire.parse(kv_pb2.KeyValue, raw, len(raw)).value == b"v" * 100
    with pytest.raises(ValueError, match="exceeds the bound"):
        wire.parse(kv_pb2.KeyValue, raw, len(raw) - 1)


def test_prefix_end():
    assert prefix_end(b"a") == b"b"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"") == b"\0"


# ---------------------------------------------------------------- the client against a server


class Answers(grpc.GenericRpcHandler):
    """A gRPC server's handler answering each method with the bytes set for it, recording requests."""

    def __init__(self):
        self.replies = {}
        self.requests = {}

    def service(self, details):
        method = details.method
        if method not in self.replies:
            return None

        def unary(request, context):
            self.requests[method] = request
            return self.replies[method]

        def stream(request, context):
            self.requests[method] = request
            yield from self.replies[method]

        reply = self.replies[method]
        if isinstance(reply, list):
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)


@pytest.fixture
def served():
    answers = Answers()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[answers])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = EtcdClient([f"http://127.0.0.1:{port}"], timeout=5.0)
    try:
        yield answers, client
    finally:
        client.close()
        server.stop(0)


def test_members_and_status_from_etcds_bytes(served):
    answers, client = served
    members = rpc_pb2.MemberListResponse(members=[
        rpc_pb2.Member(ID=1, name="m1", peerURLs=["https://a:2380"], clientURLs=["https://a:2379"]),
        rpc_pb2.Member(ID=0xFFFF_FFFF_FFFF_FFFF, peerURLs=["https://b:2380"], isLearner=True),
    ])
    answers.replies["/etcdserverpb.Cluster/MemberList"] = members.SerializeToString()
    got = client.members()
    assert [(m.id, m.name, m.is_learner, m.started) for m in got] == [
        (1, "m1", False, True), (0xFFFF_FFFF_FFFF_FFFF, "", True, False)]
    answers.replies["/etcdserverpb.Maintenance/Status"] = rpc_pb2.StatusResponse(
        header=rpc_pb2.ResponseHeader(member_id=9), leader=9, errors=["x"], isLearner=True).SerializeToString()
    st = client.status(client.endpoints[0])
    assert st.is_leader and st.is_learner and st.errors == ("x",)


def test_requests_are_etcds_messages(served):
    answers, client = served
    answers.replies["/etcdserverpb.Cluster/MemberAdd"] = rpc_pb2.MemberAddResponse(
        member=rpc_pb2.Member(ID=5, peerURLs=["https://c:2380"], isLearner=True)).SerializeToString()
    info = client.add_member(["https://c:2380"], learner=True)
    assert info.id == 5 and info.is_learner
    sent = rpc_pb2.MemberAddRequest.FromString(answers.requests["/etcdserverpb.Cluster/MemberAdd"])
    assert list(sent.peerURLs) == ["https://c:2380"] and sent.isLearner
    answers.replies["/etcdserverpb.Maintenance/Alarm"] = rpc_pb2.AlarmResponse(alarms=[
        rpc_pb2.AlarmMember(memberID=3, alarm=rpc_pb2.NOSPACE),
        rpc_pb2.AlarmMember(memberID=4, alarm=7)]).SerializeToString()  # a type newer than this etcd
    assert client.alarms() == [(3, "NOSPACE"), (4, "7")]
    client.disarm(3, "NOSPACE")
    sent_alarm = rpc_pb2.AlarmRequest.FromString(answers.requests["/etcdserverpb.Maintenance/Alarm"])
    assert (sent_alarm.action, sent_alarm.memberID, sent_alarm.alarm) == (rpc_pb2.AlarmRequest.DEACTIVATE, 3,
                                                                          rpc_pb2.NOSPACE)


@pytest.mark.parametrize("raw", [b"\x0a\x05ab", TOO_LONG, b"\x12\x02\xff\xfe"])  # version not UTF-8
def test_a_malformed_answer_is_an_etcd_error(served, raw):
    answers, client = served
    answers.replies["/etcdserverpb.Maintenance/Status"] = raw
    with pytest.raises(EtcdError, match="Status on .*: malformed response: not a StatusResponse"):
        client.status(client.endpoints[0])


def test_snapshot_chunks_are_the_blobs(served):
    answers, client = served
    blobs = [bytes(range(256)) * 128, b"tail"]
    answers.replies["/etcdserverpb.Maintenance/Snapshot"] = [
        rpc_pb2.SnapshotResponse(remaining_bytes=n, blob=b).SerializeToString() for n, b in enumerate(blobs)]
    assert [bytes(c) for c in client.snapshot_chunks(client.endpoints[0])] == blobs
    answers.replies["/etcdserverpb.Maintenance/Snapshot"] = [b"\x1a\x05ab"]
    with pytest.raises(EtcdError, match="malformed response"):
        list(client.snapshot_chunks(client.endpoints[0]))
