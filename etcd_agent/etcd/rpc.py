"""The gRPC transport of the delta feature: one endpoint, raw bytes in and out, our errors up.

Its channel comes from ``channel``, as ``client``'s do (the etcd3 stubs cannot express what
these calls need: ``fragment``, lease ids on Txn puts). Requests are generated messages
(``etcd_agent.etcd.pb``, built by ``proto``) serialized by their class; responses stay bytes
through gRPC and are decoded by ``proto``, bounded by ``max_message`` (a deserializer that raised
inside gRPC would come back as an INTERNAL status, its reason lost).

- ``EtcdRpc``: unary KV/Lease calls on one endpoint (Range, Txn, LeaseGrant/Revoke/TimeToLive/Leases)
- ``WatchStream``: the bidirectional Watch stream, read by a thread of its own that hands each
  response to a handler (or a bounded queue), so the caller only ever waits with a deadline
- ``KeepAliveStream``: LeaseKeepAlive for a set of leases (used while replaying)

Streams carry ``hasleader=true`` metadata: a member cut off from its leader cancels the stream
(etcd's require-leader), instead of keeping a watch open that silently receives nothing.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Generator,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
    cast,
)

from google.protobuf.message import Message

from etcd_agent.errors import EtcdError
from etcd_agent.etcd import channel, proto
from etcd_agent.etcd.client import map_grpc_error
from etcd_agent.etcd.pb import rpc_pb2
from etcd_agent.etcd.wire import serialize

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import TlsSection

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE = 256 * 1024 * 1024
_METADATA = (("hasleader", "true"),)


class StreamEnded(EtcdError):
    """A stream ended or failed; ``transient`` when reconnecting may help."""


def _ident(b: bytes) -> bytes:
    return b


class EtcdRpc:
    """Calls to one etcd endpoint."""

    def __init__(
        self,
        endpoint: str,
        *,
        tls: "Optional[TlsSection]" = None,
        timeout: float = 5.0,
        max_message: int = MAX_MESSAGE,
        single_threaded_streams: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.max_message = max_message
        opts = channel.options(max_message, max_send=max_message, keepalive=True,
                               single_threaded_streams=single_threaded_streams)
        self._channel = channel.open_channel(endpoint, tls, opts)
        self._stubs: Dict[str, Any] = {}

    def _unary(self, method: str, request: Message, timeout: Optional[float] = None) -> bytes:
        import grpc

        fn = self._stubs.get(method)
        if fn is None:
            fn = self._channel.unary_unary(method, request_serializer=serialize, response_deserializer=_ident)
            self._stubs[method] = fn
        try:
            return cast(bytes, fn(request, timeout=timeout or self.timeout))
        except grpc.RpcError as exc:
            raise map_grpc_error(exc, f"{method.rsplit('/', 1)[-1]} on {self.endpoint}") from None

    def _decode(self, what: str, fn: Callable[[bytes, int], T], raw: bytes) -> T:
        try:
            return fn(raw, self.max_message)
        except ValueError as exc:
            raise EtcdError(f"{what} on {self.endpoint}: malformed response ({exc})") from None

    # ------------------------------------------------------------ KV

    def range(self, key: bytes, range_end: bytes = b"", **kw: Any) -> proto.RangeResult:
        raw = self._unary("/etcdserverpb.KV/Range", proto.encode_range(key, range_end, **kw))
        return self._decode("Range", proto.decode_range, raw)

    def header(self, *, serializable: bool = True) -> proto.Header:
        """This member's current header (cluster id, revision) from a count-only Range.
        Serializable: the member's own view, answered even without a leader."""
        return self.range(b"\0", b"\0", count_only=True, serializable=serializable).header

    def txn(self, ops: Sequence[rpc_pb2.RequestOp], timeout: Optional[float] = None) -> proto.Header:
        """One transaction of the given ops (no compares); its header carries the new revision."""
        raw = self._unary("/etcdserverpb.KV/Txn", proto.encode_txn(ops), timeout)
        return self._decode("Txn", proto.decode_txn_header, raw)

    def compact(self, revision: int, *, physical: bool = False, timeout: Optional[float] = None) -> None:
        self._unary("/etcdserverpb.KV/Compact", rpc_pb2.CompactionRequest(revision=revision, physical=physical), timeout)

    def defragment(self, timeout: Optional[float] = None) -> None:
        """Maintenance.Defragment of this member: its db file rewritten with only the pages in use."""
        self._unary("/etcdserverpb.Maintenance/Defragment", rpc_pb2.DefragmentRequest(), timeout)

    def db_sizes(self) -> Tuple[int, int]:
        """Maintenance.Status of this member: (its db file's size, the bytes its pages in use hold)."""
        raw = self._unary("/etcdserverpb.Maintenance/Status", rpc_pb2.StatusRequest())
        return self._decode("Status", proto.decode_db_sizes, raw)

    # ------------------------------------------------------------ leases

    def lease_grant(self, ttl: int, lease_id: int = 0) -> Tuple[int, int]:
        raw = self._unary("/etcdserverpb.Lease/LeaseGrant", rpc_pb2.LeaseGrantRequest(TTL=ttl, ID=lease_id))
        lid, granted, err = self._decode("LeaseGrant", proto.decode_lease_grant, raw)
        if err:
            raise EtcdError(f"LeaseGrant on {self.endpoint}: {err}")
        return lid, granted

    def lease_revoke(self, lease_id: int) -> None:
        self._unary("/etcdserverpb.Lease/LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=lease_id))

    def lease_ttl(self, lease_id: int, *, keys: bool = False) -> proto.LeaseTTL:
        """LeaseTimeToLive; ``ttl == -1`` when the lease is gone (expired or revoked)."""
        raw = self._unary("/etcdserverpb.Lease/LeaseTimeToLive", rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id, keys=keys))
        return self._decode("LeaseTimeToLive", proto.decode_lease_ttl, raw)

    def lease_list(self) -> List[int]:
        raw = self._unary("/etcdserverpb.Lease/LeaseLeases", rpc_pb2.LeaseLeasesRequest())
        return self._decode("LeaseLeases", proto.decode_lease_leases, raw)

    # ------------------------------------------------------------ streams

    def watch(
        self,
        create_request: rpc_pb2.WatchRequest,
        *,
        queue_size: int = 4096,
        handler: Optional[Callable[[bytes], None]] = None,
    ) -> "WatchStream":
        return WatchStream(self._channel, self.endpoint, create_request, queue_size=queue_size, handler=handler)

    def watch_batch(self, create_request: rpc_pb2.WatchRequest, *, timeout: float) -> Generator[bytes, None, None]:
        """One Watch call read by the caller's own thread (no reader thread): its raw
        WatchResponses until the caller stops reading (the call is then canceled) or gRPC's
        deadline ``timeout`` passes (StreamEnded). A failed call is an EtcdError."""
        import grpc

        call = _watch_method(self._channel)(create_request, metadata=_METADATA, timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise StreamEnded(f"a watch batch from {self.endpoint} did not end within {timeout:g}s") from None
            raise map_grpc_error(exc, f"watch stream from {self.endpoint}") from None
        finally:
            call.cancel()

    def keepalive(self) -> "KeepAliveStream":
        return KeepAliveStream(self._channel, self.endpoint, self.max_message)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "EtcdRpc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_END = object()


class _Requests:
    """The request side of a bidi stream: an iterator gRPC pulls from, fed by ``send``."""

    def __init__(self) -> None:
        self._q: "queue.Queue[object]" = queue.Queue()

    def send(self, request: Message) -> None:
        self._q.put(request)

    def end(self) -> None:
        self._q.put(_END)

    def __iter__(self) -> Iterator[Message]:
        while True:
            item = self._q.get()
            if item is _END:
                return
            assert isinstance(item, Message)
            yield item


def _watch_method(channel: Any) -> Any:
    """etcd's Watch, called as a server-streaming RPC of raw responses (the create request, then
    the client half-closes; etcd keeps the stream open until it is canceled)."""
    return channel.unary_stream("/etcdserverpb.Watch/Watch", request_serializer=serialize, response_deserializer=_ident)


class WatchStream:
    """One Watch RPC, read by a thread of its own.

    Called as a server-streaming RPC: the create request, then the client half-closes (etcd's
    watch server keeps the stream open until it is canceled). That rules out progress requests,
    which the watcher does not need (it confirms coverage by revision).

    With a ``handler``, that thread calls ``handler(raw)`` for every WatchResponse (no second
    thread hop per message: at 500 responses/s the hop costs more CPU than decoding); an
    exception from the handler ends the stream and becomes ``failure``. Without one, responses
    go into a bounded queue for ``next(timeout)``. Either way ``done`` is set when the stream
    is over, ``failure`` says why (StreamEnded / EtcdError / the handler's exception).
    """

    def __init__(
        self,
        channel: Any,
        endpoint: str,
        create_request: rpc_pb2.WatchRequest,
        *,
        queue_size: int,
        handler: Optional[Callable[[bytes], None]] = None,
    ) -> None:
        self.endpoint = endpoint
        self._handler = handler
        self._call = _watch_method(channel)(create_request, metadata=_METADATA)
        # bounded: if the consumer falls behind, gRPC flow control pushes back on etcd, whose
        # watcher then becomes "unsynced" and catches up from history - nothing is dropped
        self._responses: "queue.Queue[Union[bytes, BaseException, object]]" = queue.Queue(maxsize=queue_size)
        self._closed = threading.Event()
        self.done = threading.Event()
        self.failure: Optional[BaseException] = None
        self._reader = threading.Thread(target=self._read, name=f"delta-watch-{endpoint}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        import grpc

        end: BaseException
        try:
            for raw in self._call:
                if self._handler is not None:
                    self._handler(raw)
                else:
                    self._put(raw)
            end = StreamEnded(f"watch stream from {self.endpoint} ended by the server")
        except grpc.RpcError as exc:
            if self._closed.is_set():
                end = StreamEnded("watch stream closed")
            else:
                end = map_grpc_error(exc, f"watch stream from {self.endpoint}")
        except BaseException as exc:  # the handler's verdict (ChainBroken ...) or a bug: reported
            end = exc
            self._call.cancel()
        self.failure = end
        if self._handler is None:
            self._put(end)
        self.done.set()

    def _put(self, item: object) -> None:
        while not self._closed.is_set():
            try:
                self._responses.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def next(self, timeout: float) -> Optional[bytes]:
        """(Queue mode) the next raw response, None on timeout; raises what ended the stream."""
        try:
            item = self._responses.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if isinstance(item, bytes):
            return item
        if isinstance(item, BaseException):
            raise item
        raise StreamEnded("watch stream closed")  # pragma: no cover

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        self._call.cancel()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)
            if self._reader.is_alive():  # pragma: no cover - gRPC cancel is prompt
                log.warning("watch reader thread did not stop within %.0fs", timeout)


class KeepAliveStream:
    """LeaseKeepAlive for leases the caller names; responses are drained by a reader thread."""

    def __init__(self, channel: Any, endpoint: str, max_message: int) -> None:
        self.endpoint = endpoint
        self._max_message = max_message
        self._requests = _Requests()
        fn = channel.stream_stream(
            "/etcdserverpb.Lease/LeaseKeepAlive", request_serializer=serialize, response_deserializer=_ident
        )
        self._call = fn(iter(self._requests), metadata=_METADATA)
        self._closed = threading.Event()
        self.error: Optional[EtcdError] = None
        self.expired: List[int] = []
        self._reader = threading.Thread(target=self._read, name=f"delta-keepalive-{endpoint}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        import grpc

        try:
            for raw in self._call:
                lid, ttl = proto.decode_keepalive(raw, self._max_message)
                if ttl <= 0:
                    self.expired.append(lid)
        except grpc.RpcError as exc:
            if not self._closed.is_set():
                self.error = map_grpc_error(exc, f"lease keep-alive on {self.endpoint}")
        except ValueError as exc:
            self.error = EtcdError(f"lease keep-alive on {self.endpoint}: malformed response ({exc})")

    def renew(self, lease_ids: Sequence[int]) -> None:
        for lid in lease_ids:
            self._requests.send(rpc_pb2.LeaseKeepAliveRequest(ID=lid))

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        self._requests.end()
        self._call.cancel()
        self._reader.join(timeout)
