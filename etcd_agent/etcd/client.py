"""The etcd client: the only module that imports etcd3; plain dataclasses out, our errors up.

Maintenance and cluster RPCs go through gRPC channels (built by ``channel``) kept per endpoint (so one dead member never
poisons calls to the others, and a restarted etcd is reconnected within a second: reconnect
backoff is capped low). Their messages are the classes generated from etcd's own rpc.proto
(``pb``; etcd3's stubs are stale: no learner fields), read bounded by ``wire``. KV and locks use
etcd3's client, built as a multi-endpoint client with a short retry window (a single-endpoint
etcd3 client refuses every call for 300 s after one failure).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Type, TypeVar

from google.protobuf.message import Message

from etcd_agent.errors import (
    BusyError,
    EtcdError,
    EtcdMemberNotFound,
    EtcdPeerExists,
    EtcdUnavailable,
    EtcdUnhealthyCluster,
    OperationFailed,
)
from etcd_agent.etcd import channel, wire
from etcd_agent.etcd.pb import rpc_pb2 as pb
from etcd_agent.waiting import SYSTEM_CLOCK, Clock, NotYet, poll

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config, TlsSection

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

# the largest response accepted: by gRPC (the channel's receive limit) and again before parsing
MAX_RESPONSE = 64 * 1024 * 1024
CHANNEL_OPTIONS = channel.options(MAX_RESPONSE)
# the snapshot download (see snapshot_chunks)
_SNAPSHOT_OPTIONS = channel.options(MAX_RESPONSE, single_threaded_streams=True, fixed_window=True)


@dataclass(frozen=True)
class MemberInfo:
    id: int
    name: str
    peer_urls: Tuple[str, ...]
    client_urls: Tuple[str, ...]
    is_learner: bool = False

    @property
    def started(self) -> bool:
        """Whether the member has run: it published its client URLs. Not its name: a member
        added by ``member add`` has none until it runs, but the members of a static bootstrap are
        listed by their ``--initial-cluster`` names before they ever ran (no client URLs), and one
        taken as started was "replaced" instead of starting in the forming cluster."""
        return bool(self.client_urls)

    @property
    def hex_id(self) -> str:
        return f"{self.id:x}"


def free_share(db_size: int, db_size_in_use: int) -> Optional[float]:
    """The share of a member's db file its free pages hold (``1 - in use / size``, from its
    Status); None when the two make no sense together (either not reported, or more in use than
    the file holds). The daemon's defragmentation and the replay's judge by it."""
    if db_size <= 0 or db_size_in_use <= 0 or db_size_in_use > db_size:
        return None
    return 1.0 - db_size_in_use / db_size


@dataclass(frozen=True)
class EndpointStatus:
    endpoint: str
    member_id: int
    cluster_id: int
    revision: int
    version: str
    db_size: int
    db_size_in_use: int
    leader: int
    is_learner: bool
    raft_term: int
    raft_index: int
    raft_applied_index: int
    errors: Tuple[str, ...]

    @property
    def is_leader(self) -> bool:
        return self.leader != 0 and self.leader == self.member_id


def map_grpc_error(exc: Exception, what: str) -> EtcdError:
    """Translate a grpc/etcd3 exception into the agent's own error."""
    import grpc

    code = exc.code() if isinstance(exc, grpc.RpcError) else None
    details = ""
    if isinstance(exc, grpc.RpcError):
        details = exc.details() or ""
    text = details or str(exc) or type(exc).__name__
    low = text.lower()
    if "unhealthy cluster" in low:
        return EtcdUnhealthyCluster(f"{what}: etcd refused: unhealthy cluster")
    if "peer urls already exists" in low or "peerurl exists" in low:
        return EtcdPeerExists(f"{what}: {text}")
    if "member not found" in low:
        return EtcdMemberNotFound(f"{what}: {text}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or type(exc).__name__ in (
        "ConnectionFailedError",
        "ConnectionTimeoutError",
    ):
        return EtcdUnavailable(f"{what}: etcd not reachable ({text.splitlines()[0] if text else code})")
    return EtcdError(f"{what}: {text}")


class EtcdClient:
    """Talks to one cluster through a list of client URLs."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        tls: "Optional[TlsSection]" = None,
        timeout: float = 5.0,
    ) -> None:
        if not endpoints:
            raise EtcdError("no etcd endpoints given")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._tls = tls
        self._channels: Dict[str, Any] = {}
        self._kvc: Any = None
        self._lock = threading.Lock()
        self._preferred = 0

    @classmethod
    def from_config(
        cls, cfg: "Config", endpoints: Optional[Sequence[str]] = None, timeout: float = 5.0
    ) -> "EtcdClient":
        return cls(endpoints or cfg.client_urls, tls=cfg.tls, timeout=timeout)

    # ------------------------------------------------------------ plumbing

    def _channel(self, endpoint: str) -> Any:
        with self._lock:
            ch = self._channels.get(endpoint)
            if ch is None:
                ch = channel.open_channel(endpoint, self._tls, CHANNEL_OPTIONS)
                self._channels[endpoint] = ch
            return ch

    def _call(
        self, endpoint: str, method: str, request: Message, response: Type[M], timeout: Optional[float] = None
    ) -> M:
        """One unary call: ``request`` serialized by its generated class, the answer read as a
        ``response``, bounded; a malformed answer is an EtcdError, like any other failed call."""
        import grpc

        # the response stays bytes through gRPC: a deserializer's exception would come back as
        # an INTERNAL RpcError, its reason lost
        fn = self._channel(endpoint).unary_unary(
            method, request_serializer=wire.serialize, response_deserializer=None
        )
        what = f"{method.rsplit('/', 1)[-1]} on {endpoint}"
        try:
            raw = fn(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise map_grpc_error(exc, what) from None
        try:
            return wire.parse(response, raw, MAX_RESPONSE)
        except ValueError as exc:
            raise EtcdError(f"{what}: malformed response: {exc}") from None

    def _call_any(
        self, method: str, request: Message, response: Type[M], timeout: Optional[float] = None
    ) -> M:
        """Call on the first endpoint that answers; membership errors are not retried elsewhere."""
        last: Optional[EtcdError] = None
        n = len(self.endpoints)
        for i in range(n):
            ep = self.endpoints[(self._preferred + i) % n]
            try:
                out = self._call(ep, method, request, response, timeout)
                self._preferred = (self._preferred + i) % n
                return out
            except EtcdUnavailable as exc:
                last = exc
        assert last is not None
        raise EtcdUnavailable(f"no etcd endpoint answered ({', '.join(self.endpoints)}): {last.message}")

    # ------------------------------------------------------------ cluster

    def members(self, endpoint: Optional[str] = None) -> List[MemberInfo]:
        """The member list as etcd sees it (from ``endpoint``, or any that answers)."""
        method, req = "/etcdserverpb.Cluster/MemberList", pb.MemberListRequest()
        res = self._call(endpoint, method, req, pb.MemberListResponse) if endpoint else self._call_any(
            method, req, pb.MemberListResponse)
        return [_member(m) for m in res.members]

    def add_member(self, peer_urls: Sequence[str], *, learner: bool = False) -> MemberInfo:
        req = pb.MemberAddRequest(peerURLs=peer_urls, isLearner=learner)
        info = _member(self._call_any("/etcdserverpb.Cluster/MemberAdd", req, pb.MemberAddResponse).member)
        log.info("added member %s with peer URLs %s%s", info.hex_id, ",".join(peer_urls), " as learner" if learner else "")
        return info

    def remove_member(self, member_id: int) -> None:
        self._call_any("/etcdserverpb.Cluster/MemberRemove", pb.MemberRemoveRequest(ID=member_id),
                       pb.MemberRemoveResponse)
        log.info("removed member %x", member_id)

    def promote_member(self, member_id: int) -> None:
        self._call_any("/etcdserverpb.Cluster/MemberPromote", pb.MemberPromoteRequest(ID=member_id),
                       pb.MemberPromoteResponse)
        log.info("promoted learner %x", member_id)

    # ------------------------------------------------------------ maintenance

    def status(self, endpoint: str, timeout: Optional[float] = None) -> EndpointStatus:
        st = self._call(endpoint, "/etcdserverpb.Maintenance/Status", pb.StatusRequest(), pb.StatusResponse, timeout)
        return EndpointStatus(
            endpoint=endpoint,
            member_id=st.header.member_id,
            cluster_id=st.header.cluster_id,
            revision=st.header.revision,
            version=st.version,
            db_size=st.dbSize,
            leader=st.leader,
            raft_index=st.raftIndex,
            raft_term=st.raftTerm,
            raft_applied_index=st.raftAppliedIndex,
            errors=tuple(st.errors),
            db_size_in_use=st.dbSizeInUse,
            is_learner=st.isLearner,
        )

    def healthy(self, endpoint: str, timeout: Optional[float] = None) -> Tuple[bool, str]:
        """Health as ``etcdctl endpoint health`` judges it: a linearizable read goes through raft."""
        why, _st = self.health(endpoint, timeout)
        return not why, why

    def health(self, endpoint: str, timeout: Optional[float] = None) -> Tuple[str, Optional[EndpointStatus]]:
        """``healthy`` with the status it read on the way: ("", status) when healthy, else (why,
        the status when one was read)."""
        # RangeRequest{key: "health"}; a linearizable read needs a leader and a quorum.
        try:
            self._call(endpoint, "/etcdserverpb.KV/Range", pb.RangeRequest(key=b"health"), pb.RangeResponse, timeout)
        except EtcdError as exc:
            if "permission denied" not in exc.message:
                return exc.message, None
        try:
            st = self.status(endpoint, timeout)
        except EtcdError as exc:
            return exc.message, None
        return "; ".join(st.errors), st

    def snapshot_chunks(self, endpoint: str, timeout: float = 3600.0) -> Iterator[memoryview]:
        """Stream the backend database of ``endpoint`` (Maintenance.Snapshot), chunk by chunk, each
        a view of its message's blob. (The generated parse copies the blob out of the message: at
        32 KiB a chunk it still costs less CPU than the hand-written field walk that avoided the copy.)"""
        import grpc

        # A channel of its own, tuned for one long download of 32 KiB messages (etcd's fixed chunk):
        # the stream is read in the calling thread (gRPC's default hands every message over from a
        # thread of its own: ~40% more CPU per MB here), and the receive window is fixed at 1 MiB
        # instead of growing with BDP probing, which let gRPC buffer tens of MB ahead of a busy
        # reader (the agent's peak RSS).
        ch = channel.open_channel(endpoint, self._tls, _SNAPSHOT_OPTIONS)
        try:
            fn = ch.unary_stream("/etcdserverpb.Maintenance/Snapshot", request_serializer=wire.serialize,
                                 response_deserializer=None)
            for raw in fn(pb.SnapshotRequest(), timeout=timeout):
                yield memoryview(wire.parse(pb.SnapshotResponse, raw, MAX_RESPONSE).blob)
        except grpc.RpcError as exc:
            raise map_grpc_error(exc, f"snapshot from {endpoint}") from None
        except ValueError as exc:
            raise EtcdError(f"snapshot from {endpoint}: malformed response: {exc}") from None
        finally:
            ch.close()

    def defragment(self, endpoint: str, timeout: float = 600.0) -> None:
        self._call(endpoint, "/etcdserverpb.Maintenance/Defragment", pb.DefragmentRequest(), pb.DefragmentResponse,
                   timeout)

    def move_leader(self, leader_endpoint: str, target_id: int, timeout: Optional[float] = None) -> None:
        """Hand leadership to ``target_id``; must go to the leader."""
        self._call(leader_endpoint, "/etcdserverpb.Maintenance/MoveLeader", pb.MoveLeaderRequest(targetID=target_id),
                   pb.MoveLeaderResponse, timeout)
        log.info("leadership moved to %x", target_id)

    def alarms(self, endpoint: Optional[str] = None) -> List[Tuple[int, str]]:
        """Active alarms as (member id, "NOSPACE" | "CORRUPT" | ...) (AlarmRequest{action=GET})."""
        method, req = "/etcdserverpb.Maintenance/Alarm", pb.AlarmRequest(action=pb.AlarmRequest.GET)
        res = self._call(endpoint, method, req, pb.AlarmResponse) if endpoint else self._call_any(
            method, req, pb.AlarmResponse)
        # an alarm type newer than this list (proto3 enums are open) is shown by its number
        return [(am.memberID, ALARM_NAMES.get(am.alarm, str(am.alarm))) for am in res.alarms]

    def disarm(self, member_id: int, alarm: str) -> None:
        """Deactivate one alarm (AlarmRequest{action=DEACTIVATE, memberID, alarm})."""
        req = pb.AlarmRequest(action=pb.AlarmRequest.DEACTIVATE, memberID=member_id, alarm=pb.AlarmType.Value(alarm))
        self._call_any("/etcdserverpb.Maintenance/Alarm", req, pb.AlarmResponse)
        log.info("disarmed %s alarm of member %x", alarm, member_id)

    def compact(self, revision: int, *, physical: bool = True, timeout: Optional[float] = None) -> None:
        """Compact the keyspace up to ``revision``."""
        req = pb.CompactionRequest(revision=revision, physical=physical)
        self._call_any("/etcdserverpb.KV/Compact", req, pb.CompactionResponse, timeout)
        log.info("compacted to revision %d", revision)

    # ------------------------------------------------------------ kv and locks

    def _kv_client(self) -> Any:
        if self._kvc is None:
            from etcd3.client import Endpoint, MultiEndpointEtcd3Client  # type: ignore[import-untyped]  # no stubs

            eps = []
            for url in self.endpoints:
                host, port, secure = channel.parse_endpoint(url)
                creds = channel.credentials(self._tls) if secure else None
                eps.append(Endpoint(host, port, secure=secure, creds=creds, time_retry=0.5))
            self._kvc = MultiEndpointEtcd3Client(eps, timeout=self.timeout, failover=True)
        return self._kvc

    def _kv(self, what: str, fn: str, *args: Any, **kw: Any) -> Any:
        # etcd3's multi-endpoint client marks a dead endpoint failed and raises; the next call
        # goes to another one. So an unavailable error is retried once per endpoint.
        for attempt in range(len(self.endpoints)):
            try:
                return getattr(self._kv_client(), fn)(*args, **kw)
            except Exception as exc:  # etcd3 raises its own and grpc errors
                err = exc if isinstance(exc, EtcdError) else map_grpc_error(exc, what)
                if not isinstance(err, EtcdUnavailable) or attempt == len(self.endpoints) - 1:
                    raise err from None
        raise AssertionError("unreachable")

    def put(self, key: str, value: bytes) -> None:
        self._kv(f"put {key}", "put", key, value)

    def put_if_absent(self, key: str, value: bytes) -> bool:
        """Create ``key`` only if it does not exist yet (one transaction on create_revision == 0);
        True when this call created it, False when it was already there."""
        return bool(self._kv(f"create {key}", "put_if_not_exists", key, value))

    def get(self, key: str) -> Optional[bytes]:
        value, _meta = self._kv(f"get {key}", "get", key)
        return value  # type: ignore[no-any-return]

    def count_prefix(self, prefix: str, endpoint: Optional[str] = None) -> int:
        """How many keys start with ``prefix`` ("" = all keys), counted by etcd (count_only)."""
        key = prefix.encode() or b"\0"
        req = pb.RangeRequest(key=key, range_end=prefix_end(prefix.encode()), count_only=True)
        method = "/etcdserverpb.KV/Range"
        res = self._call(endpoint, method, req, pb.RangeResponse) if endpoint else self._call_any(
            method, req, pb.RangeResponse)
        return res.count

    def keys(self, prefix: str, limit: int = 10000) -> List[str]:
        """The keys under ``prefix`` (keys_only, at most ``limit``: a bound, not a page)."""
        req = pb.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix.encode()), limit=limit, keys_only=True)
        res = self._call_any("/etcdserverpb.KV/Range", req, pb.RangeResponse)
        return [kv.key.decode("utf-8", "replace") for kv in res.kvs]

    def delete(self, key: str) -> int:
        """Delete exactly ``key``; how many keys went (0 or 1)."""
        res = self._call_any("/etcdserverpb.KV/DeleteRange", pb.DeleteRangeRequest(key=key.encode()),
                             pb.DeleteRangeResponse)
        return res.deleted

    @contextlib.contextmanager
    def locked(self, name: str, ttl: int, timeout: Optional[float] = None) -> Iterator[None]:
        """Hold etcd lock ``name`` (lease ``ttl`` seconds) around the body; BusyError when another
        holder keeps it past ``timeout``, EtcdError when etcd cannot be asked."""
        lock = self._kv(f"lock {name}", "lock", name, ttl)
        acquired = False
        for attempt in range(len(self.endpoints)):
            try:
                acquired = lock.acquire(timeout=timeout)
                break
            except Exception as exc:
                err = map_grpc_error(exc, f"acquire lock {name}")
                if not isinstance(err, EtcdUnavailable) or attempt == len(self.endpoints) - 1:
                    raise err from None
        if not acquired:
            raise BusyError(f"lock {name} is held by another agent (waited {timeout}s)")
        try:
            yield
        finally:
            self._release(lock, name)

    def _release(self, lock: Any, name: str, deadline: float = 15.0, clock: Clock = SYSTEM_CLOCK) -> None:
        """Release ``lock``, retrying across endpoints: a membership change just made (a member
        removed, a leader elected) can fail the first attempt, and a lock left to expire blocks
        every agent's next membership change for the whole lease. Revoking the lease frees it too."""

        def release() -> bool:
            last = ""
            for how in (lock.release, lambda: lock.lease.revoke()):
                try:
                    how()
                    return True
                except Exception as exc:  # etcd3 raises its own and grpc errors
                    last = str(exc) or type(exc).__name__
            raise NotYet(last)

        try:
            poll(release, timeout=deadline, what=f"release of lock {name}", interval=0.3, clock=clock)
        except OperationFailed as exc:
            log.warning("releasing lock %s failed (its lease will expire): %s", name, exc.message)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
        if self._kvc is not None:
            try:
                self._kvc.close()
            except Exception:  # closing a dead channel
                pass
            self._kvc = None

    def __enter__(self) -> "EtcdClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# the names operators see, from etcd's AlarmType (its numbers are rpc.proto's)
ALARM_NAMES = {v: k for k, v in pb.AlarmType.items()}


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix`` (b"\\0": all keys)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


def _member(m: pb.Member) -> MemberInfo:
    return MemberInfo(id=m.ID, name=m.name, peer_urls=tuple(m.peerURLs), client_urls=tuple(m.clientURLs),
                      is_learner=m.isLearner)
