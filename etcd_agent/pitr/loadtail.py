"""The replay's last leg: the chain's folded key space loaded into the throwaway member, as
transactions built from it (``Batches``: deletes first, then puts in create order; the first ones
built ahead in the fold's thread) and sent one after another (``load``)."""
from __future__ import annotations

from typing import Iterator, List, Tuple

from etcd_agent.chain.errors import ReplayError
from etcd_agent.errors import EtcdError
from etcd_agent.etcd import proto
from etcd_agent.etcd.pb.rpc_pb2 import RequestOp
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.pitr import keyspace

# a load transaction: large enough that round trips do not count (measured: 5000 puts of 1 KiB a
# transaction, 70,000 puts/s), well inside the scratch member's --max-txn-ops/--max-request-bytes
LOAD_OPS = 10000
LOAD_BYTES = 16 * 1024 * 1024


class Batches:
    """The load's transactions, built from the key space: deletes first, in transactions of their
    own - a key deleted by the chain, and a key the chain deleted and created again (its create
    revision is after the snapshot's), whose snapshot incarnation must go so that the put below
    creates it anew (create revision, version 1) instead of continuing the old one; deleting a
    key the snapshot never held is a no-op. Then the puts, in original create order, from a new
    transaction (one may not touch a key twice). ``prebuild`` builds the first ones ahead (in the
    fold's thread, while the throwaway member starts); iterating yields them all, in order.
    ``keys``: the keys the chain left changed, counted once iterated to the end."""

    def __init__(self, ks: keyspace.KeySpace, restored: int) -> None:
        self.keys = 0
        self._ahead: List[List[RequestOp]] = []
        self._rest = self._build(ks, restored)

    def _build(self, ks: keyspace.KeySpace, restored: int) -> Iterator[List[RequestOp]]:
        for deletes in (True, False):
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
                if ops and (len(ops) >= LOAD_OPS or size + n > LOAD_BYTES):
                    yield ops
                    ops, size = [], 0
                ops.append(op)
                size += n
            if ops:
                yield ops

    def prebuild(self, max_bytes: int) -> None:
        """Build transactions ahead, up to about ``max_bytes`` of them."""
        held = 0
        while held < max_bytes:
            ops = next(self._rest, None)
            if ops is None:
                return
            self._ahead.append(ops)
            held += sum(op.ByteSize() for op in ops)

    def __iter__(self) -> Iterator[List[RequestOp]]:
        while self._ahead:
            yield self._ahead.pop(0)
        yield from self._rest


def load(rpc: EtcdRpc, batches: Batches, start_rev: int) -> Tuple[int, List[int]]:
    """The key space's changes (``Batches``) written in large transactions; returns (keys,
    their revisions). A transaction of deletes of absent keys only writes no revision."""
    revs: List[int] = []
    for ops in batches:
        try:
            rev = rpc.txn(ops, timeout=300.0).revision
        except EtcdError as exc:
            raise ReplayError(f"loading the replayed key space failed: {exc.message}") from None
        if rev > (revs[-1] if revs else start_rev):  # else it wrote nothing (deletes of absent keys)
            revs.append(rev)
    return batches.keys, revs
