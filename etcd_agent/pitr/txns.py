"""One transaction of a replay's writes, split when the etcd refuses it for its size."""
from __future__ import annotations

from typing import List, Sequence

from etcd_agent.chain.errors import ReplayError
from etcd_agent.errors import EtcdError
from etcd_agent.etcd.pb.rpc_pb2 import RequestOp
from etcd_agent.etcd.rpc import EtcdRpc

# what etcd answers for a request over its limits (--max-request-bytes, --max-txn-ops), and
# gRPC for a message over the channel's
TOO_LARGE = ("request is too large", "too many operations in txn request", "trying to send message larger than max")


def send(rpc: EtcdRpc, ops: Sequence[RequestOp], what: str, timeout: float = 300.0) -> List[int]:
    """``ops`` written as one transaction, or - refused as too large or as too many operations -
    as two halves, each split again if need be (a member configured below etcd's defaults); the
    revisions written. One operation alone refused, or any other error: ReplayError naming
    ``what``."""
    try:
        return [rpc.txn(ops, timeout=timeout).revision]
    except EtcdError as exc:
        if len(ops) > 1 and any(s in exc.message for s in TOO_LARGE):
            half = len(ops) // 2
            return send(rpc, ops[:half], what, timeout) + send(rpc, ops[half:], what, timeout)
        raise ReplayError(f"{what} failed: {exc.message}") from None
