"""What a watcher learns about leases: LeaseTimeToLive answers, recorded into the segments.

Watch events carry a key's lease id but nothing about the lease; the watcher asks etcd when it
first sees a lease and again for every live lease at each segment close. ``LeaseTracker`` keeps
those answers and the ones still to be written (the rule that uses them is ``leases``).
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Set

from etcd_agent.chain.segments import LeaseRecord
from etcd_agent.errors import EtcdError
from etcd_agent.etcd.rpc import EtcdRpc

log = logging.getLogger(__name__)


class LeaseTracker:
    """Live leases as last observed, ids to ask again, records waiting for a segment."""

    def __init__(self, wall_ms: Callable[[], int], refresh_limit: int = 10000) -> None:
        self._wall_ms = wall_ms
        self.refresh_limit = refresh_limit
        self.known: Dict[int, LeaseRecord] = {}
        self.again: Set[int] = set()
        self.pending: List[LeaseRecord] = []
        self.listed = False

    def wants(self, lease_id: int) -> bool:
        """A lease not seen before (nor waiting to be asked again)."""
        return lease_id not in self.known and lease_id not in self.again

    def observe(self, rpc: EtcdRpc, lease_id: int) -> Optional[LeaseRecord]:
        try:
            ttl = rpc.lease_ttl(lease_id)
        except EtcdError as exc:
            log.warning("LeaseTimeToLive %x failed (%s); asking again at the next segment close", lease_id,
                        exc.message)
            self.again.add(lease_id)
            return None
        self.again.discard(lease_id)
        alive = ttl.ttl >= 0
        rec = LeaseRecord(lease_id, ttl.granted_ttl if alive else -1, ttl.ttl if alive else -1, self._wall_ms())
        if alive:
            self.known[lease_id] = rec
        else:
            self.known.pop(lease_id, None)
        self.pending.append(rec)
        return rec

    def record_all(self, rpc: EtcdRpc) -> None:
        """Every lease the member has now (at the start of a run)."""
        for lid in rpc.lease_list():
            self.observe(rpc, lid)
        self.listed = True

    def refresh(self, rpc: EtcdRpc) -> None:
        """Ask again about every live lease (at most ``refresh_limit``, oldest asked first)."""
        ids = list(self.known)[: self.refresh_limit] + sorted(self.again)
        for lid in ids:
            self.observe(rpc, lid)
        if len(self.known) > self.refresh_limit:
            # refresh the rest next time: the ones just asked go to the back
            for lid in ids[: self.refresh_limit]:
                rec = self.known.pop(lid, None)
                if rec is not None:
                    self.known[lid] = rec

    def take_pending(self) -> List[LeaseRecord]:
        out, self.pending = self.pending, []
        return out
