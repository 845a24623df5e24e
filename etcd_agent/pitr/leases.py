"""The lease rule of a point-in-time restore, as a pure function of the captured lease records.

Watch events carry a key's lease id but nothing about the lease: its TTL is observed separately
(the watcher asks LeaseTimeToLive when it first sees a lease, and again for every live lease at
each segment close) and recorded as ``LeaseRecord(observed_ms, remaining_ttl, granted_ttl)``.
A lease's revocation or expiry reaches the watch as DELETE events of its keys, in the revision
in which etcd revoked it.

The rule, at the target time T:

- a lease is **expired** at T if the latest observation at or before T says it is gone, or its
  remaining TTL then had run out by T (etcd's TTL is whole seconds, "expires in under TTL+1
  seconds", so the upper bound counts) and no later observation shows it still alive (a later
  live observation means a keep-alive renewed it in between);
- otherwise it is **alive**, and gets the TTL it had left at T: from the latest observation at
  or before T (or the earliest after T when there is none before, or when a keep-alive came
  between), rounded up to whole seconds, at least ``min_ttl``, at most its granted TTL;
- a lease with no observation at all is **unknown**: kept, TTL decided by the caller.

Keys attached to an expired lease are not restored; keys of an alive lease are restored
attached to a lease with that TTL.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Dict, Iterable, List, Optional

from etcd_agent.chain.segments import LeaseRecord, ms_to_datetime
from etcd_agent.typedjson import HEX, Document, Key, Text

MIN_TTL = 5


@dataclass(frozen=True)
class LeaseFate(Document):
    lease_id: Annotated[int, HEX, Key("lease")]
    alive: bool
    ttl: Optional[int]  # seconds to grant in the restored store; None: no observation (unknown)
    granted_ttl: int  # as last observed, -1 unknown
    reason: Annotated[str, Text(16 * 1024)]


def _ttl_left(rec: LeaseRecord, at_ms: int, min_ttl: int) -> int:
    left = math.ceil((rec.observed_ms + rec.remaining_ttl * 1000 - at_ms) / 1000.0)
    ttl = max(min_ttl, left)
    if rec.granted_ttl > 0:
        ttl = min(ttl, max(rec.granted_ttl, min_ttl))
    return ttl


def _when(ms: int) -> str:
    return ms_to_datetime(ms).strftime("%H:%M:%S.%f")[:-3]


def fate_of(lease_id: int, records: Iterable[LeaseRecord], at_ms: int, *, min_ttl: int = MIN_TTL) -> LeaseFate:
    """The fate of one lease at ``at_ms`` (Unix ms) from its observations (any order)."""
    recs = sorted((r for r in records if r.lease_id == lease_id), key=lambda r: r.observed_ms)
    if not recs:
        return LeaseFate(lease_id, True, None, -1, "no TTL observation recorded")
    granted = next((r.granted_ttl for r in reversed(recs) if r.granted_ttl > 0), -1)
    before = [r for r in recs if r.observed_ms <= at_ms]
    after = [r for r in recs if r.observed_ms > at_ms]
    later_alive = next((r for r in after if r.alive), None)
    if before:
        b = before[-1]
        if not b.alive:
            return LeaseFate(lease_id, False, None, granted, f"gone when observed at {_when(b.observed_ms)}")
        if b.observed_ms + (b.remaining_ttl + 1) * 1000 > at_ms:
            return LeaseFate(
                lease_id, True, _ttl_left(b, at_ms, min_ttl), granted,
                f"{b.remaining_ttl}s left at {_when(b.observed_ms)}",
            )
        if later_alive is not None:
            return LeaseFate(
                lease_id, True, _ttl_left(later_alive, at_ms, min_ttl), granted,
                f"renewed: alive again at {_when(later_alive.observed_ms)}",
            )
        return LeaseFate(
            lease_id, False, None, granted,
            f"{b.remaining_ttl}s left at {_when(b.observed_ms)}: expired by the target",
        )
    first = after[0]
    if first.alive:
        return LeaseFate(
            lease_id, True, _ttl_left(first, at_ms, min_ttl), granted,
            f"first observed after the target, {first.remaining_ttl}s left at {_when(first.observed_ms)}",
        )
    # first seen after the target and already gone: its keys were written before the target
    # with the lease alive; when it ended is unknown, so the keys are kept, about to expire
    return LeaseFate(lease_id, True, min_ttl, granted, f"gone when first observed at {_when(first.observed_ms)}")


def lease_fates(
    lease_ids: Iterable[int], records: Iterable[LeaseRecord], at_ms: int, *, min_ttl: int = MIN_TTL
) -> Dict[int, LeaseFate]:
    """``fate_of`` for each of ``lease_ids``."""
    by_id: Dict[int, List[LeaseRecord]] = {}
    for r in records:
        by_id.setdefault(r.lease_id, []).append(r)
    return {lid: fate_of(lid, by_id.get(lid, ()), at_ms, min_ttl=min_ttl) for lid in lease_ids}
