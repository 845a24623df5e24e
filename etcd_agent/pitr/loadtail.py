"""The replay's last leg: the chain's folded key space written into an etcd, as transactions
built from it (``Batches``: deletes first, then puts in create order; the first ones built ahead
in the fold's thread) and sent (``load``), with the leases the chain's puts name granted first and
the lease rule applied after (``write_tail``).

Two etcds receive it: the throwaway loopback member of a replay (``SCRATCH``: its own limits,
one large transaction after another) and the restored cluster itself while its apiservers are
still fenced (``CLUSTER``: within etcd's default ``--max-txn-ops`` and ``--max-request-bytes``,
a few transactions in flight so that Raft's fsyncs are shared). A transaction the etcd refuses as
too large or as too many operations is split in halves until it is accepted (a member configured
below etcd's defaults), down to one operation: one alone refused is the load's failure."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

from etcd_agent.chain.segments import LeaseRecord, ms_to_datetime
from etcd_agent.etcd import proto
from etcd_agent.etcd.pb.rpc_pb2 import RequestOp
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.pitr import keyspace
from etcd_agent.pitr.leasefix import LeaseKeeper, apply_lease_rule, grant
from etcd_agent.pitr.leases import fate_of
from etcd_agent.pitr.replay import LeaseOutcome, Plan, ReplayResult
from etcd_agent.pitr.txns import send

# a load transaction on the throwaway member: large enough that round trips do not count
# (measured: 5000 puts of 1 KiB a transaction, 70,000 puts/s), well inside its own
# --max-txn-ops/--max-request-bytes
LOAD_OPS = 10000
LOAD_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """How the tail is cut into transactions and how many are in flight at once (puts only:
    the deletes go first, one after another, so that a key deleted and created again is gone
    before its put)."""

    ops: int
    max_bytes: int
    in_flight: int = 1


SCRATCH = Limits(LOAD_OPS, LOAD_BYTES, 1)
# etcd's defaults (--max-txn-ops 128, --max-request-bytes 1.5 MiB, a margin kept for the
# request's own framing); measured on a 3-member loopback cluster with fsync, 10,000 puts of
# 1 KiB: 0.43 s one transaction after another, 0.30 s with 4 in flight, 0.23 s with 16
# (with transactions in flight, create order holds within each and only roughly across them:
# a key the chain created may get a lower create revision than one it created before it)
CLUSTER = Limits(128, 1024 * 1024, 8)

Kind = str  # "delete" | "put"


class Batches:
    """The load's transactions, built from the key space: deletes first, in transactions of their
    own - a key deleted by the chain, and a key the chain deleted and created again (its create
    revision is after the snapshot's), whose snapshot incarnation must go so that the put below
    creates it anew (create revision, version 1) instead of continuing the old one; deleting a
    key the snapshot never held is a no-op. Then the puts, in original create order, from a new
    transaction (one may not touch a key twice). ``prebuild`` builds the first ones ahead (in the
    fold's thread, while the throwaway member starts); iterating yields them all, in order, each
    with its kind. ``keys``: the keys the chain left changed, counted once iterated to the end."""

    def __init__(self, ks: keyspace.KeySpace, restored: int, limits: Limits = SCRATCH) -> None:
        self.keys = 0
        self._ahead: List[Tuple[Kind, List[RequestOp]]] = []
        self._rest = self._build(ks, restored, limits)

    def _build(self, ks: keyspace.KeySpace, restored: int, limits: Limits) -> Iterator[Tuple[Kind, List[RequestOp]]]:
        for deletes in (True, False):
            kind = "delete" if deletes else "put"
            ops: List[RequestOp] = []
            size = 0
            for ch in ks.changes():
                if deletes:
                    # a key the chain created and never deleted cannot be in the snapshot
                    if not (ch.value is None or (ch.create_revision > restored and ch.deleted_before)):
                        continue
                    op = proto.op_delete(ch.key)
                else:
                    self.keys += 1
                    if ch.value is None:
                        continue
                    op = proto.op_put(ch.key, ch.value, ch.lease)
                n = op.ByteSize()
                if ops and (len(ops) >= limits.ops or size + n > limits.max_bytes):
                    yield kind, ops
                    ops, size = [], 0
                ops.append(op)
                size += n
            if ops:
                yield kind, ops

    def prebuild(self, max_bytes: int) -> None:
        """Build transactions ahead, up to about ``max_bytes`` of them."""
        held = 0
        while held < max_bytes:
            item = next(self._rest, None)
            if item is None:
                return
            self._ahead.append(item)
            held += sum(op.ByteSize() for op in item[1])

    def __iter__(self) -> Iterator[Tuple[Kind, List[RequestOp]]]:
        while self._ahead:
            yield self._ahead.pop(0)
        yield from self._rest


def load(rpc: EtcdRpc, batches: Batches, start_rev: int, in_flight: int = 1) -> Tuple[int, List[int]]:
    """The key space's changes (``Batches``) written; returns (keys, their revisions, ascending).
    Deletes one transaction after another; puts with up to ``in_flight`` transactions at once
    (each key is in one transaction only). A transaction of deletes of absent keys only writes
    no revision."""
    revs: List[int] = []
    pending: List["Future[List[int]]"] = []
    what = "writing the chain's key space"
    with ThreadPoolExecutor(max_workers=max(1, in_flight), thread_name_prefix="tail-load") as pool:
        for kind, ops in batches:
            if kind == "delete" or in_flight <= 1:
                revs += send(rpc, ops, what)
                continue
            pending.append(pool.submit(send, rpc, ops, what))
            if len(pending) >= in_flight:
                revs += pending.pop(0).result()
        for fut in pending:
            revs += fut.result()
    written = sorted(r for r in set(revs) if r > start_rev)  # else it wrote nothing (deletes of absent keys)
    return batches.keys, written


@dataclass
class Written:
    """What ``write_tail`` did: the keys loaded, their revisions, the lease rule's outcome and
    fix-up revisions, and the seconds."""

    keys: int
    load_revisions: List[int]
    leases: LeaseOutcome
    fixups: List[int]
    seconds: float = 0.0


def write_tail(rpc: EtcdRpc, plan: Plan, ks: keyspace.KeySpace, batches: Batches, *, start_rev: int, at_ms: int,
               min_ttl: int, unknown_ttl: int, keeper: LeaseKeeper, limits: Limits = SCRATCH,
               lap: Callable[[str], None] = lambda name: None) -> Written:
    """The tail written into the etcd ``rpc`` reaches: the leases the chain's puts name granted
    with their ids (the TTL they had left at ``at_ms``, by the lease rule) unless it has them, the
    key space's changes (``load``), then the lease rule at ``at_ms`` - keys of leases expired by
    then dropped, keys of the snapshot's leases with less time left moved to a lease of that TTL.
    Every lease held by ``keeper`` until the caller closes it."""
    t = time.monotonic()
    present: Dict[int, int] = {}  # lease id -> granted TTL in the etcd
    snapshot_leases: Set[int] = set()
    for lid in rpc.lease_list():
        granted = rpc.lease_ttl(lid).granted_ttl
        present[lid] = granted
        snapshot_leases.add(lid)
        keeper.hold(lid, granted)
    by_lease: Dict[int, List[LeaseRecord]] = {}
    for rec in plan.records:
        by_lease.setdefault(rec.lease_id, []).append(rec)
    for lid in ks.leases:
        if lid in present:
            continue
        fate = fate_of(lid, by_lease.get(lid, ()), at_ms, min_ttl=min_ttl)
        # an expired lease still holds its keys until the rule removes them at the end
        ttl = fate.ttl if fate.alive and fate.ttl is not None else (unknown_ttl if fate.alive else 60)
        grant(rpc, lid, ttl)
        present[lid] = ttl
        keeper.hold(lid, ttl)
    lap("leases")
    keys, loads = load(rpc, batches, start_rev, limits.in_flight)
    seconds = time.monotonic() - t
    lap("load")
    outcome, fixups = apply_lease_rule(rpc, present, snapshot_leases, plan.records, at_ms, min_ttl, keeper,
                                       chunk=limits.ops)
    lap("lease rule")
    return Written(keys, loads, outcome, fixups, seconds)


def replay_result(plan: Plan, ks: keyspace.KeySpace, w: Written, *, restored: int, segments: int, at_ms: int,
                  fold_seconds: float, snapshot_path: str, snapshot_revision: int, seconds: float,
                  started_from: str = "") -> ReplayResult:
    """What a replay reports, whichever etcd the tail was written into."""
    return ReplayResult(
        snapshot_path=snapshot_path,
        base_revision=plan.base_revision,
        reached_revision=max(restored, plan.stop_revision),
        reached_time=ms_to_datetime(at_ms) if plan.stop_time_ms is not None else None,
        events_applied=ks.events,
        revisions_applied=ks.revisions,
        segments_applied=segments,
        stopped_because=plan.because
        + (f" (the snapshot already held revisions up to {restored})" if restored > plan.base_revision else ""),
        complete=plan.complete,
        lost_after=plan.lost,
        leases=w.leases,
        fixup_revisions=tuple(w.fixups),
        snapshot_revision=snapshot_revision,
        seconds=seconds,
        replay_seconds=fold_seconds + w.seconds,
        keys_loaded=w.keys,
        load_revisions=tuple(w.load_revisions),
        started_from=started_from,
        started_revision=restored,
    )


def target_ms(plan: Plan, now: Optional[float] = None) -> int:
    """The time the lease rule judges at: the plan's stop, else now (a chain with no time)."""
    return plan.stop_time_ms if plan.stop_time_ms is not None else int((now or time.time()) * 1000)
