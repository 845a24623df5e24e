"""Defragmentation and alarms: keep the backend db small and get a cluster out of NOSPACE.

Fragmentation of a member is ``1 - db_size_in_use / db_size`` from its status. A member over the
threshold (and over a minimum size) is defragmented one at a time, followers first, the leader
last, and only while the whole cluster is healthy: defragmenting blocks that member's reads and
writes while it rewrites the db, so two at once could cost the quorum.

A NOSPACE alarm (the db hit its quota; etcd then only serves reads and deletes) is cleared the
documented way: compact to the current revision, defragment every member, disarm.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from etcd_agent.cluster.health import cluster_health, statuses, wait_cluster_healthy
from etcd_agent.config import Config
from etcd_agent.errors import EtcdError, OperationFailed, RefusedError
from etcd_agent.etcd.client import EndpointStatus, EtcdClient, free_share

log = logging.getLogger(__name__)


def fragmentation(st: EndpointStatus) -> float:
    """Share of the db file not in use (0.0 when etcd does not report the in-use size)."""
    return free_share(st.db_size, st.db_size_in_use) or 0.0


@dataclass
class DefragItem:
    name: str
    endpoint: str
    db_size: int
    db_size_in_use: int
    fragmentation: float
    leader: bool
    defrag: bool
    reason: str
    size_after: Optional[int] = None
    seconds: Optional[float] = None

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "endpoint": self.endpoint, "db_size": self.db_size,
                "db_size_in_use": self.db_size_in_use, "fragmentation": round(self.fragmentation, 4),
                "leader": self.leader, "defrag": self.defrag, "reason": self.reason,
                "size_after": self.size_after, "seconds": None if self.seconds is None else round(self.seconds, 3)}


def decide_defrag(rows: List[Tuple[str, EndpointStatus]], threshold_percent: float, min_bytes: int,
                  force: bool = False) -> List[DefragItem]:
    """Pure: which members to defragment, in order (followers first, the leader last), and why."""
    items = []
    for name, st in rows:
        frag = fragmentation(st)
        if force:
            do, why = True, "forced"
        elif st.db_size < min_bytes:
            do, why = False, f"db {st.db_size} B is under the {min_bytes} B minimum"
        elif frag * 100 <= threshold_percent:
            do, why = False, f"fragmentation {frag:.0%} is within the {threshold_percent:.0f}% threshold"
        else:
            do, why = True, f"fragmentation {frag:.0%} exceeds the {threshold_percent:.0f}% threshold"
        items.append(DefragItem(name, st.endpoint, st.db_size, st.db_size_in_use, frag, st.is_leader, do, why))
    return sorted(items, key=lambda i: i.leader)  # stable: config order, leader last


def defrag(cfg: Config, client: EtcdClient, *, dry_run: bool = False, threshold: Optional[float] = None,
           force: bool = False, allow_alarms: bool = False, gate_timeout: float = 60.0) -> List[DefragItem]:
    """Defragment the members that need it, one at a time; RefusedError if the cluster is unhealthy."""
    mt = cfg.maintenance
    ok, problems = cluster_health(cfg, client, allow_alarms=allow_alarms)
    if not ok:
        raise RefusedError("the cluster is not healthy; not defragmenting", details=problems)
    items = decide_defrag(list(statuses(cfg, client, purpose="maintenance").items()), mt.defrag_threshold_percent if threshold is None else threshold,
                          mt.defrag_min_db_bytes, force)
    if dry_run:
        return items
    for it in items:
        if not it.defrag:
            continue
        wait_cluster_healthy(cfg, client, gate_timeout, allow_alarms=allow_alarms)
        t0 = time.monotonic()
        client.defragment(it.endpoint, timeout=mt.defrag_timeout)
        it.seconds = time.monotonic() - t0
        it.size_after = client.status(it.endpoint).db_size
        log.info("%s: defragmented %d -> %d bytes in %.2fs", it.name, it.db_size, it.size_after, it.seconds)
    wait_cluster_healthy(cfg, client, gate_timeout, allow_alarms=allow_alarms)
    return items


@dataclass
class AlarmReport:
    alarms: List[Dict[str, str]]
    actions: List[str] = field(default_factory=list)
    cleared: bool = False
    defrag: List[DefragItem] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {"alarms": self.alarms, "actions": self.actions, "cleared": self.cleared,
                "defrag": [d.to_json() for d in self.defrag]}


def list_alarms(cfg: Config, client: EtcdClient) -> List[Dict[str, str]]:
    by_id = {}
    try:
        by_id = {m.id: m.name for m in client.members()}
    except EtcdError:
        pass
    return [{"member_id": f"{mid:x}", "member": by_id.get(mid, "?"), "alarm": kind} for mid, kind in client.alarms()]


def clear_nospace(cfg: Config, client: EtcdClient, *, dry_run: bool = False) -> AlarmReport:
    """NOSPACE: compact to the current revision, defragment every member, disarm; report each step."""
    rep = AlarmReport(list_alarms(cfg, client))
    nospace = [a for a in rep.alarms if a["alarm"] == "NOSPACE"]
    others = [a for a in rep.alarms if a["alarm"] != "NOSPACE"]
    for a in others:
        rep.actions.append(f"{a['alarm']} alarm on {a['member']} ({a['member_id']}): not cleared automatically; "
                           "a CORRUPT alarm means a member's data differs: replace that member")
    if not nospace:
        return rep
    st = list(statuses(cfg, client, purpose="maintenance").items())
    revision = max(s.revision for _n, s in st)
    plan = [f"compact to revision {revision}", "defragment every member (followers first, leader last)",
            "disarm " + ", ".join(f"NOSPACE of {a['member']}" for a in nospace)]
    if dry_run:
        rep.actions += [f"would {p}" for p in plan]
        return rep
    try:
        client.compact(revision, physical=True, timeout=120)
        rep.actions.append(f"compacted to revision {revision}")
    except EtcdError as exc:
        if "compacted" not in exc.message:  # already compacted that far is fine
            raise
        rep.actions.append(f"revision {revision} was already compacted")
    rep.defrag = defrag(cfg, client, force=True, allow_alarms=True)
    rep.actions += [f"defragmented {d.name}: {d.db_size} -> {d.size_after} bytes" for d in rep.defrag]
    for a in nospace:
        client.disarm(int(a["member_id"], 16), "NOSPACE")
        rep.actions.append(f"disarmed NOSPACE of {a['member']}")
    left = [a for a in list_alarms(cfg, client) if a["alarm"] == "NOSPACE"]
    rep.cleared = not left
    if left:
        raise OperationFailed("NOSPACE alarm is back right after disarming: the data itself exceeds the quota "
                              "(raise --quota-backend-bytes or delete data)", details=rep.actions)
    return rep
