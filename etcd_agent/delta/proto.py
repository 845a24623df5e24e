"""Protobuf wire codec of the etcd messages the delta feature uses (pure code, no grpc).

Field numbers are those of etcd's ``api/etcdserverpb/rpc.proto`` and ``api/mvccpb/kv.proto``.
Reading uses ``etcd_agent.etcd.wire`` (the one protobuf reader); decoding by field number avoids the stale etcd3 stubs (their
``WatchCreateRequest`` has no ``fragment``). Every decoder is bounded by the buffer it is given
and raises ``ValueError`` on malformed input; the transport turns that into our errors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from ..etcd.wire import iter_fields
from ..etcd.wire import signed as _signed
from .segments import DELETE, PUT, Event

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


# ---------------------------------------------------------------- primitives


def varint(value: int) -> bytes:
    value &= _U64 - 1  # int64 negatives as 10-byte two's complement
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def fint(num: int, value: int) -> bytes:
    """A varint field; proto3 default (0) is omitted."""
    return varint(num << 3) + varint(value) if value else b""


def fbytes(num: int, data: bytes) -> bytes:
    return varint((num << 3) | 2) + varint(len(data)) + data


def fbool(num: int, value: bool) -> bytes:
    return fint(num, 1 if value else 0)


# ---------------------------------------------------------------- common


@dataclass(frozen=True)
class Header:
    """ResponseHeader{cluster_id=1, member_id=2, revision=3, raft_term=4}."""

    cluster_id: int = 0
    member_id: int = 0
    revision: int = 0
    raft_term: int = 0


def decode_header(buf: bytes) -> Header:
    c = m = r = t = 0
    for num, wt, val in iter_fields(buf):
        if wt != 0:
            continue
        assert isinstance(val, int)
        if num == 1:
            c = val
        elif num == 2:
            m = val
        elif num == 3:
            r = _signed(val)
        elif num == 4:
            t = val
    return Header(c, m, r, t)


def header_of(buf: bytes) -> Header:
    """The header (field 1) of any etcd response."""
    for num, wt, val in iter_fields(buf):
        if num == 1 and wt == 2:
            assert isinstance(val, bytes)
            return decode_header(val)
    return Header()


# ---------------------------------------------------------------- KV


def decode_kv(buf: bytes, kind: int = PUT) -> Event:
    """mvccpb.KeyValue{key=1, create_revision=2, mod_revision=3, version=4, value=5, lease=6}."""
    key = value = b""
    create = mod = version = lease = 0
    for num, wt, val in iter_fields(buf):
        if num == 1 and wt == 2:
            key = val  # type: ignore[assignment]
        elif num == 5 and wt == 2:
            value = val  # type: ignore[assignment]
        elif wt == 0:
            assert isinstance(val, int)
            if num == 2:
                create = _signed(val)
            elif num == 3:
                mod = _signed(val)
            elif num == 4:
                version = _signed(val)
            elif num == 6:
                lease = _signed(val)
    if kind == DELETE:
        return Event(DELETE, key, b"", mod, 0, 0, 0)
    return Event(PUT, key, value, mod, create, version, lease)


def decode_event(buf: bytes) -> Event:
    """mvccpb.Event{type=1 (PUT=0, DELETE=1), kv=2, prev_kv=3}."""
    kind = PUT
    kv = b""
    for num, wt, val in iter_fields(buf):
        if num == 1 and wt == 0:
            assert isinstance(val, int)
            kind = val
        elif num == 2 and wt == 2:
            kv = val  # type: ignore[assignment]
    if kind not in (PUT, DELETE):
        raise ValueError(f"unknown event type {kind}")
    return decode_kv(kv, kind)


def encode_range(
    key: bytes,
    range_end: bytes = b"",
    *,
    limit: int = 0,
    revision: int = 0,
    serializable: bool = False,
    keys_only: bool = False,
    count_only: bool = False,
) -> bytes:
    """RangeRequest{key=1, range_end=2, limit=3, revision=4, serializable=7, keys_only=8, count_only=9}."""
    return (
        fbytes(1, key)
        + (fbytes(2, range_end) if range_end else b"")
        + fint(3, limit)
        + fint(4, revision)
        + fbool(7, serializable)
        + fbool(8, keys_only)
        + fbool(9, count_only)
    )


@dataclass(frozen=True)
class RangeResult:
    header: Header
    kvs: Tuple[Event, ...]
    more: bool
    count: int


def decode_range(buf: bytes) -> RangeResult:
    """RangeResponse{header=1, kvs=2, more=3, count=4}."""
    header = Header()
    kvs: List[Event] = []
    more = False
    count = 0
    for num, wt, val in iter_fields(buf):
        if num == 1 and wt == 2:
            header = decode_header(val)  # type: ignore[arg-type]
        elif num == 2 and wt == 2:
            kvs.append(decode_kv(val))  # type: ignore[arg-type]
        elif num == 3 and wt == 0:
            more = bool(val)
        elif num == 4 and wt == 0:
            count = val  # type: ignore[assignment]
    return RangeResult(header, tuple(kvs), more, count)


def op_put(key: bytes, value: bytes, lease: int = 0, *, ignore_value: bool = False) -> bytes:
    """RequestOp{request_put=2: PutRequest{key=1, value=2, lease=3, ignore_value=5}}."""
    put = fbytes(1, key) + (fbytes(2, value) if value else b"") + fint(3, lease) + fbool(5, ignore_value)
    return fbytes(2, put)


def op_delete(key: bytes) -> bytes:
    """RequestOp{request_delete_range=3: DeleteRangeRequest{key=1}} (exactly one key)."""
    return fbytes(3, fbytes(1, key))


def encode_txn(ops: Sequence[bytes]) -> bytes:
    """TxnRequest{success=2...}: no compares, so the success branch always runs."""
    return b"".join(fbytes(2, op) for op in ops)


# ---------------------------------------------------------------- lease


def encode_lease_grant(ttl: int, lease_id: int = 0) -> bytes:
    """LeaseGrantRequest{TTL=1, ID=2}."""
    return fint(1, ttl) + fint(2, lease_id)


@dataclass(frozen=True)
class LeaseTTL:
    """LeaseTimeToLiveResponse{header=1, ID=2, TTL=3, grantedTTL=4, keys=5}; ttl -1: no such lease."""

    lease_id: int
    ttl: int
    granted_ttl: int
    keys: Tuple[bytes, ...] = ()


def decode_lease_grant(buf: bytes) -> Tuple[int, int, str]:
    """LeaseGrantResponse{header=1, ID=2, TTL=3, error=4} -> (id, ttl, error)."""
    lid = ttl = 0
    err = ""
    for num, wt, val in iter_fields(buf):
        if num == 2 and wt == 0:
            lid = _signed(val)  # type: ignore[arg-type]
        elif num == 3 and wt == 0:
            ttl = _signed(val)  # type: ignore[arg-type]
        elif num == 4 and isinstance(val, bytes):
            err = val.decode("utf-8", "replace")
    return lid, ttl, err


def decode_lease_ttl(buf: bytes) -> LeaseTTL:
    lid = ttl = granted = 0
    keys: List[bytes] = []
    for num, wt, val in iter_fields(buf):
        if wt == 0:
            v = _signed(val)  # type: ignore[arg-type]
            if num == 2:
                lid = v
            elif num == 3:
                ttl = v
            elif num == 4:
                granted = v
        elif num == 5 and wt == 2:
            keys.append(val)  # type: ignore[arg-type]
    return LeaseTTL(lid, ttl, granted, tuple(keys))


def decode_lease_leases(buf: bytes) -> List[int]:
    """LeaseLeasesResponse{header=1, leases=2: LeaseStatus{ID=1}} -> lease ids."""
    out: List[int] = []
    for num, wt, val in iter_fields(buf):
        if num == 2 and wt == 2:
            for n2, w2, v2 in iter_fields(val):  # type: ignore[arg-type]
                if n2 == 1 and w2 == 0:
                    out.append(_signed(v2))  # type: ignore[arg-type]
    return out


def decode_keepalive(buf: bytes) -> Tuple[int, int]:
    """LeaseKeepAliveResponse{header=1, ID=2, TTL=3} -> (id, ttl)."""
    lid = ttl = 0
    for num, wt, val in iter_fields(buf):
        if num == 2 and wt == 0:
            lid = _signed(val)  # type: ignore[arg-type]
        elif num == 3 and wt == 0:
            ttl = _signed(val)  # type: ignore[arg-type]
    return lid, ttl


# ---------------------------------------------------------------- watch

def encode_watch_create(
    key: bytes,
    range_end: bytes,
    *,
    start_revision: int,
    progress_notify: bool = True,
    fragment: bool = True,
    prev_kv: bool = False,
) -> bytes:
    """WatchRequest{create_request=1: WatchCreateRequest{key=1, range_end=2, start_revision=3,
    progress_notify=4, prev_kv=6, fragment=8}}."""
    create = (
        fbytes(1, key)
        + fbytes(2, range_end)
        + fint(3, start_revision)
        + fbool(4, progress_notify)
        + fbool(6, prev_kv)
        + fbool(8, fragment)
    )
    return fbytes(1, create)


@dataclass(frozen=True)
class WatchMessage:
    """WatchResponse{header=1, watch_id=2, created=3, canceled=4, compact_revision=5,
    cancel_reason=6, fragment=7, events=11}."""

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


def decode_watch_response(buf: bytes) -> WatchMessage:
    header = Header()
    watch_id = compact = 0
    created = canceled = fragment = False
    reason = ""
    events: List[Event] = []
    for num, wt, val in iter_fields(buf):
        if wt == 2:
            assert isinstance(val, bytes)
            if num == 11:
                events.append(decode_event(val))
            elif num == 1:
                header = decode_header(val)
            elif num == 6:
                reason = val.decode("utf-8", "replace")
        elif wt == 0:
            assert isinstance(val, int)
            if num == 2:
                watch_id = _signed(val)
            elif num == 3:
                created = bool(val)
            elif num == 4:
                canceled = bool(val)
            elif num == 5:
                compact = _signed(val)
            elif num == 7:
                fragment = bool(val)
    return WatchMessage(header, watch_id, created, canceled, compact, reason, fragment, tuple(events))
