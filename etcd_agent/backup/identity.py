"""Whose snapshot is this? Judged from the snapshot's own db against what the caller could find.

Pure: no I/O. ``judge(snapshot, cfg, evidence, new_cluster=...)`` applies these rules, and the
Verdict says which held (``proven``), what could not be known (``unproven``) and, when refused,
one sentence per reason with what to do:

1. Layout: the members recorded in the snapshot's db (names and peer URLs) must be the config's
   members, no more, no fewer; else it is another cluster layout (refused unless --new-cluster).
   A member etcd never named (added, never started, or 3.5 < 3.5.20 not rewriting the entry) is
   matched by its peer URL; etcd 3.4 keeps the members of earlier incarnations beside the new
   ones after a restore, which map to the same config members and are fine.
2. Identity: when anything of the current cluster is known (its running member list, member ids
   in a data dir's db or an agent's bootstrap record on a host, the member ids a restore recorded
   as this cluster's earlier incarnations), at least one snapshot member id must be among them;
   else the snapshot is foreign and refused. When the snapshot's members have the config's names
   and peer URLs but other ids, it is explained as what it usually is: this cluster restored or
   re-bootstrapped by hand (no lineage recorded), restorable on purpose with --new-cluster.
3. No evidence at all (nothing running, every data dir and state gone): a layout match proceeds,
   and the Verdict says plainly that nothing else could be compared.

A manifest is never an input: what it says about cluster ids and members proves nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from etcd_agent.etcd.snapdb import SnapshotIdentity

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config


@dataclass(frozen=True)
class KnownMember:
    """A member of the running cluster as etcd lists it."""

    id: int
    name: str
    peer_urls: Tuple[str, ...]


@dataclass(frozen=True)
class HostIds:
    """Member ids found on one host: in a data dir's db, or in the agent's bootstrap record."""

    where: str  # e.g. "m1: /var/lib/etcd/default.etcd/member/snap/db"
    ids: FrozenSet[int]


@dataclass(frozen=True)
class Evidence:
    """What the caller could find of the current cluster (empty = nothing to compare with)."""

    running: Optional[Tuple[KnownMember, ...]] = None  # None: no member answered
    running_cluster_id: Optional[int] = None
    hosts: Tuple[HostIds, ...] = ()
    lineage: Tuple[FrozenSet[int], ...] = ()  # member ids of earlier incarnations (restores)
    lineage_cluster_ids: FrozenSet[int] = frozenset()  # older restore records: cluster ids only
    notes: Tuple[str, ...] = ()  # what could not be looked at, one line each

    @property
    def empty(self) -> bool:
        return self.running is None and not self.hosts and not self.lineage and not self.lineage_cluster_ids


@dataclass(frozen=True)
class Verdict:
    ok: bool
    same_cluster: Optional[bool]  # True: proven ours; False: foreign; None: nothing to compare with
    layout_ok: bool
    proven: Tuple[str, ...]
    unproven: Tuple[str, ...]
    refused: Tuple[str, ...]

    def lines(self) -> List[str]:
        return ([f"proven: {p}" for p in self.proven] + [f"not proven: {u}" for u in self.unproven]
                + [f"REFUSED: {r}" for r in self.refused])


def _ids(ids: Sequence[int]) -> str:
    return ",".join(format(i, "x") for i in sorted(ids)) or "-"


def layout_problems(snapshot: SnapshotIdentity, cfg: "Config") -> List[str]:
    """Differences between the snapshot's members and the config's (empty: same layout)."""
    problems: List[str] = []
    if not snapshot.members:
        return ["the snapshot's db records no members (not the db of an etcd cluster member)"]
    by_name = {m.name: m for m in cfg.members}
    by_peer = {m.peer_url: m for m in cfg.members}
    represented: Set[str] = set()
    for sm in snapshot.members:
        peers = list(sm.peer_urls)
        if sm.name:
            known = by_name.get(sm.name)
            if known is None:
                problems.append(f"snapshot member {sm.name} ({','.join(peers) or 'no peer URL'}) is not in the config")
                continue
            if known.peer_url not in peers:
                problems.append(f"snapshot member {sm.name} has peer URL {','.join(peers) or '-'}, "
                                f"the config says {known.peer_url}")
                continue
            represented.add(known.name)
        else:
            hit = next((by_peer[u] for u in peers if u in by_peer), None)
            if hit is None:
                problems.append(f"snapshot member {sm.id_hex} (unnamed, {','.join(peers) or 'no peer URL'}) "
                                "is not in the config")
                continue
            represented.add(hit.name)
    missing = [m.name for m in cfg.members if m.name not in represented]
    if missing and not problems:
        listed = "; ".join(f"{sm.name or sm.id_hex + ' (unnamed)'} {','.join(sm.peer_urls) or 'no peer URL'}"
                           + (" (learner)" if sm.is_learner else "") for sm in snapshot.members)
        problems.append(f"config member(s) {', '.join(missing)} are not in the snapshot's cluster (it lists "
                        f"{listed})")
    return problems


def shares_members(snapshot: SnapshotIdentity, cfg: "Config") -> bool:
    """Whether any snapshot member is a config member (same peer URL, and same name if named):
    a scaled or partly moved cluster still does; another cluster's layout does not."""
    by_peer = {m.peer_url: m for m in cfg.members}
    for sm in snapshot.members:
        for u in sm.peer_urls:
            known = by_peer.get(u)
            if known is not None and (not sm.name or sm.name == known.name):
                return True
    return False


def judge(snapshot: SnapshotIdentity, cfg: "Config", evidence: Evidence, *, new_cluster: bool) -> Verdict:
    """Is ``snapshot`` this cluster's (see the module doc for the rules)?"""
    proven: List[str] = []
    unproven: List[str] = list(evidence.notes)
    refused: List[str] = []
    snap_ids = set(snapshot.member_ids)
    layout = layout_problems(snapshot, cfg)
    if layout:
        if new_cluster:
            unproven.append(f"another cluster layout ({'; '.join(layout)}): --new-cluster seeds this config's "
                            "members from it on purpose")
        else:
            refused.append(f"the snapshot is of another cluster layout: {'; '.join(layout)}; restore it into a "
                           "cluster of this config only on purpose, with --new-cluster")
    else:
        proven.append(f"the snapshot's members ({', '.join(sorted({m.name or m.id_hex for m in snapshot.members}))}) "
                      "have the config's names and peer URLs")

    if evidence.empty:
        unproven.append(
            f"nothing of the current cluster could be found (no member answered, no data dir, no bootstrap "
            f"record, no lineage): its member ids {_ids(list(snap_ids))} were compared with nothing"
            + ("; the layout match is all that was checked" if not layout else "")
        )
        return Verdict(not refused, None, not layout, tuple(proven), tuple(unproven), tuple(refused))

    matched = False
    current: Dict[int, str] = {}
    if evidence.running is not None:
        for km in evidence.running:
            current[km.id] = "the running cluster"
        hit = sorted(snap_ids & {km.id for km in evidence.running})
        if hit:
            matched = True
            proven.append(f"member ids {_ids(hit)} match the running cluster")
    for h in evidence.hosts:
        for i in h.ids:
            current.setdefault(i, h.where)
        hit = sorted(snap_ids & set(h.ids))
        if hit:
            matched = True
            proven.append(f"member ids {_ids(hit)} match {h.where}")
    earlier: Set[int] = set()
    for inc in evidence.lineage:
        earlier |= set(inc)
    hit = sorted(snap_ids & earlier)
    if hit:
        matched = True
        proven.append(f"member ids {_ids(hit)} are an earlier incarnation of this cluster (restore lineage)")
    computed = snapshot.computed_cluster_id
    if computed is not None:
        if computed in evidence.lineage_cluster_ids:
            matched = True
            proven.append(f"its members' bootstrap cluster id {computed:x} is in the restore lineage")
        if evidence.running_cluster_id is not None and computed == evidence.running_cluster_id:
            matched = True
            proven.append(f"its members' bootstrap cluster id {computed:x} is the running cluster's")
    if matched:
        return Verdict(not refused, True, not layout, tuple(proven), tuple(unproven), tuple(refused))

    where = sorted(set(current.values()))
    known = f"{_ids(list(current))} ({', '.join(where)})" if current else "only lineage records"
    if new_cluster:
        unproven.append(f"the snapshot's member ids {_ids(list(snap_ids))} match nothing of the current cluster "
                        f"({known}): --new-cluster restores another cluster's data on purpose")
        return Verdict(not refused, False, not layout, tuple(proven), tuple(unproven), tuple(refused))
    if not layout:
        refused.append(
            f"the snapshot's members have this config's names and peer URLs but other member ids "
            f"({_ids(list(snap_ids))}; this cluster's are {known}): it is this cluster as it was before it was "
            "restored or re-bootstrapped by hand (no restore lineage was recorded), or another cluster built with "
            "the same layout; if you are sure it is this cluster's data, restore it with --new-cluster"
        )
    else:
        refused.append(
            f"the snapshot is of a foreign cluster: its member ids {_ids(list(snap_ids))} match nothing of this "
            f"cluster's ({known}) nor its restore lineage; to seed a new cluster from it on purpose use --new-cluster"
        )
    return Verdict(False, False, not layout, tuple(proven), tuple(unproven), tuple(refused))
