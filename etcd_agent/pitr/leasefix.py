"""The replay's leases on its scratch etcd: kept alive until the snapshot is saved
(``LeaseKeeper``), granted again as the chain names them, and the lease rule (``leases``, pure)
applied at the target: the keys of leases expired by then dropped, the keys of leases with less
TTL left moved to a lease with what was left."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Dict, List, Sequence, Set, Tuple

from etcd_agent.chain.errors import ReplayError
from etcd_agent.chain.segments import LeaseRecord
from etcd_agent.errors import EtcdError
from etcd_agent.etcd import proto
from etcd_agent.etcd.pb.rpc_pb2 import RequestOp
from etcd_agent.etcd.rpc import EtcdRpc, KeepAliveStream
from etcd_agent.pitr.leases import lease_fates
from etcd_agent.pitr.replay import LeaseOutcome
from etcd_agent.pitr.txns import send

log = logging.getLogger(__name__)

FIXUP_CHUNK = 10000  # ops in one transaction of the lease rule's fix-ups


class LeaseKeeper:
    """Keeps every lease of the scratch store alive until the snapshot is saved: each is renewed
    when a third of its TTL has passed (checked every 0.25 s)."""

    def __init__(self, rpc: EtcdRpc) -> None:
        self._ka: KeepAliveStream = rpc.keepalive()
        self._ttl: Dict[int, int] = {}
        self._renewed: Dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delta-lease-keeper", daemon=True)
        self._thread.start()

    def hold(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            self._ttl[lease_id] = max(1, ttl)
            self._renewed[lease_id] = time.monotonic()

    def release(self, lease_id: int) -> None:
        with self._lock:
            self._ttl.pop(lease_id, None)
            self._renewed.pop(lease_id, None)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                due = [lid for lid, ttl in self._ttl.items() if now - self._renewed[lid] >= ttl / 3.0]
                for lid in due:
                    self._renewed[lid] = now
            if due:
                self._ka.renew(due)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ka.close()


def grant(rpc: EtcdRpc, lease_id: int, ttl: int) -> None:
    """Lease ``lease_id`` granted again (on the throwaway member or the restored cluster), with ``ttl``."""
    try:
        rpc.lease_grant(ttl, lease_id)
    except EtcdError as exc:
        raise ReplayError(
            f"granting lease {lease_id:x} (TTL {ttl}s) failed: {exc.message}"
        ) from None


def apply_lease_rule(
    rpc: EtcdRpc,
    present: Dict[int, int],
    snapshot_leases: Set[int],
    records: Sequence[LeaseRecord],
    at_ms: int,
    min_ttl: int,
    keeper: LeaseKeeper,
    chunk: int = FIXUP_CHUNK,
) -> Tuple[LeaseOutcome, List[int]]:
    """Drop the keys of leases expired at ``at_ms``; move keys of snapshot leases whose TTL is
    longer than what they had left to a lease with the remaining TTL. Returns fix-up revisions."""
    fates = lease_fates(sorted(present), records, at_ms, min_ttl=min_ttl)
    moves = _LeaseMoves()
    for lid, fate in fates.items():
        if not fate.alive:
            moves.drop(rpc, lid)
        elif lid in snapshot_leases and fate.ttl is not None and fate.ttl < present[lid]:
            moves.reattach(rpc, lid, fate.ttl, keeper)
    fixups = _write_fixups(rpc, moves.ops, chunk)
    for lid in moves.revoke:  # keyless now: revoking them writes no revision
        keeper.release(lid)
        rpc.lease_revoke(lid)
    outcome = LeaseOutcome(
        alive=sum(1 for f in fates.values() if f.alive),
        expired=sum(1 for f in fates.values() if not f.alive),
        unknown=sum(1 for f in fates.values() if f.ttl is None and f.alive),
        keys_dropped=moves.dropped,
        keys_reattached=moves.reattached,
        fates=tuple(fates.values()),
    )
    if moves.dropped or moves.reattached:
        log.info("lease rule: %d key(s) of expired leases dropped, %d moved to their remaining TTL (revision %s)",
                 moves.dropped, moves.reattached, ", ".join(str(r) for r in fixups))
    return outcome, fixups


@dataclasses.dataclass
class _LeaseMoves:
    """What the lease rule changes: the fix-up ops to write, the leases to revoke after them."""

    ops: List[RequestOp] = dataclasses.field(default_factory=list)
    revoke: List[int] = dataclasses.field(default_factory=list)
    dropped: int = 0
    reattached: int = 0

    def drop(self, rpc: EtcdRpc, lid: int) -> None:
        """Lease ``lid`` expired by the target: its keys deleted, the lease revoked."""
        keys = rpc.lease_ttl(lid, keys=True).keys
        self.ops.extend(proto.op_delete(k) for k in keys)
        self.dropped += len(keys)
        self.revoke.append(lid)

    def reattach(self, rpc: EtcdRpc, lid: int, ttl: int, keeper: LeaseKeeper) -> None:
        """Lease ``lid`` had only ``ttl`` seconds left: its keys moved to a new lease of that TTL
        (kept alive by ``keeper`` until the restore), the old one revoked."""
        keys = rpc.lease_ttl(lid, keys=True).keys
        if keys:
            new_id, _ttl = rpc.lease_grant(ttl)
            keeper.hold(new_id, ttl)
            self.ops.extend(proto.op_put(k, b"", new_id, ignore_value=True) for k in keys)
            self.reattached += len(keys)
        self.revoke.append(lid)


def _write_fixups(rpc: EtcdRpc, ops: List[RequestOp], chunk: int) -> List[int]:
    """The lease rule's ops written in transactions of ``chunk`` (split further when the etcd
    refuses one for its size); their revisions."""
    fixups: List[int] = []
    for i in range(0, len(ops), chunk):
        fixups += send(rpc, ops[i : i + chunk], "applying the lease rule", timeout=120.0)
    return fixups
