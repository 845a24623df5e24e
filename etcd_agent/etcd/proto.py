"""The etcd messages of the delta feature: requests built and responses read as the delta's values.

The messages are the classes generated from etcd's own rpc.proto and kv.proto
(``etcd_agent.etcd.pb``, v3.5.16); responses are parsed by ``etcd.wire.parse``, bounded by the
caller's size limit, and every decoder raises ``ValueError`` on malformed input (the transport
turns that into our errors). What this module adds is the shape the delta works in: a watch
response as a ``WatchMessage`` of ``segments.Event`` values, the one check protobuf cannot make
(an event type etcd does not define), and requests with the agent's defaults. No grpc.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from etcd_agent.chain.segments import DELETE, PUT, Event
from etcd_agent.etcd.pb import kv_pb2, rpc_pb2
from etcd_agent.etcd.wire import parse

# ---------------------------------------------------------------- common


@dataclass(frozen=True)
class Header:
    """The ResponseHeader of every etcd response."""

    cluster_id: int = 0
    member_id: int = 0
    revision: int = 0
    raft_term: int = 0


def header_from(h: rpc_pb2.ResponseHeader) -> Header:
    return Header(h.cluster_id, h.member_id, h.revision, h.raft_term)


# ---------------------------------------------------------------- KV


def event_of(kv: kv_pb2.KeyValue, kind: int = PUT) -> Event:
    """A KeyValue as the segment's event (a delete keeps only its key and revision)."""
    if kind == DELETE:
        return Event(DELETE, kv.key, b"", kv.mod_revision, 0, 0, 0)
    return Event(PUT, kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.version, kv.lease)


def decode_event(ev: kv_pb2.Event) -> Event:
    # proto3 enums are open: a type this etcd does not define parses as its number
    if ev.type not in (PUT, DELETE):
        raise ValueError(f"unknown event type {ev.type}")
    return event_of(ev.kv, ev.type)


def encode_range(
    key: bytes,
    range_end: bytes = b"",
    *,
    limit: int = 0,
    revision: int = 0,
    serializable: bool = False,
    keys_only: bool = False,
    count_only: bool = False,
) -> rpc_pb2.RangeRequest:
    return rpc_pb2.RangeRequest(
        key=key, range_end=range_end, limit=limit, revision=revision, serializable=serializable,
        keys_only=keys_only, count_only=count_only,
    )


@dataclass(frozen=True)
class RangeResult:
    header: Header
    kvs: Tuple[Event, ...]
    more: bool
    count: int


def decode_range(buf: bytes, limit: int) -> RangeResult:
    m = parse(rpc_pb2.RangeResponse, buf, limit)
    return RangeResult(header_from(m.header), tuple(event_of(kv) for kv in m.kvs), m.more, m.count)


def op_put(key: bytes, value: bytes, lease: int = 0, *, ignore_value: bool = False) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(
        request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease, ignore_value=ignore_value)
    )


def op_delete(key: bytes) -> rpc_pb2.RequestOp:
    """A delete of exactly ``key`` (no range end)."""
    return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key))


def encode_txn(ops: Sequence[rpc_pb2.RequestOp]) -> rpc_pb2.TxnRequest:
    """No compares, so the success branch always runs."""
    return rpc_pb2.TxnRequest(success=ops)


def decode_txn_header(buf: bytes, limit: int) -> Header:
    """The header of a TxnResponse: its revision is the transaction's."""
    return header_from(parse(rpc_pb2.TxnResponse, buf, limit).header)


# ---------------------------------------------------------------- lease


@dataclass(frozen=True)
class LeaseTTL:
    """A LeaseTimeToLiveResponse; ttl -1: no such lease."""

    lease_id: int
    ttl: int
    granted_ttl: int
    keys: Tuple[bytes, ...] = ()


def decode_lease_grant(buf: bytes, limit: int) -> Tuple[int, int, str]:
    """-> (id, ttl, error)."""
    m = parse(rpc_pb2.LeaseGrantResponse, buf, limit)
    return m.ID, m.TTL, m.error


def decode_lease_ttl(buf: bytes, limit: int) -> LeaseTTL:
    m = parse(rpc_pb2.LeaseTimeToLiveResponse, buf, limit)
    return LeaseTTL(m.ID, m.TTL, m.grantedTTL, tuple(m.keys))


def decode_lease_leases(buf: bytes, limit: int) -> List[int]:
    """-> lease ids."""
    return [s.ID for s in parse(rpc_pb2.LeaseLeasesResponse, buf, limit).leases]


def decode_keepalive(buf: bytes, limit: int) -> Tuple[int, int]:
    """-> (id, ttl)."""
    m = parse(rpc_pb2.LeaseKeepAliveResponse, buf, limit)
    return m.ID, m.TTL


def decode_db_sizes(buf: bytes, limit: int) -> Tuple[int, int]:
    """A StatusResponse's (dbSize, dbSizeInUse): the db file's bytes and those its pages in use hold."""
    m = parse(rpc_pb2.StatusResponse, buf, limit)
    return m.dbSize, m.dbSizeInUse


# ---------------------------------------------------------------- watch


def encode_watch_create(
    key: bytes,
    range_end: bytes,
    *,
    start_revision: int,
    progress_notify: bool = True,
    fragment: bool = True,
    prev_kv: bool = False,
) -> rpc_pb2.WatchRequest:
    create = rpc_pb2.WatchCreateRequest(
        key=key, range_end=range_end, start_revision=start_revision, progress_notify=progress_notify,
        prev_kv=prev_kv, fragment=fragment,
    )
    return rpc_pb2.WatchRequest(create_request=create)


@dataclass(frozen=True)
class WatchMessage:
    """A WatchResponse, its events as the segment's."""

    header: Header
    watch_id: int
    created: bool
    canceled: bool
    compact_revision: int
    cancel_reason: str
    fragment: bool
    events: Tuple[Event, ...]

    @property
    def is_progress(self) -> bool:
        """An empty response that is neither a create nor a cancel: a progress notification."""
        return not self.events and not self.created and not self.canceled and not self.fragment


def decode_watch_response(buf: bytes, limit: int) -> WatchMessage:
    m = parse(rpc_pb2.WatchResponse, buf, limit)
    return WatchMessage(
        header_from(m.header), m.watch_id, m.created, m.canceled, m.compact_revision, m.cancel_reason, m.fragment,
        tuple(decode_event(ev) for ev in m.events),
    )
