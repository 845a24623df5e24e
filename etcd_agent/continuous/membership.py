"""Is the cluster's membership still the one the newest full backup holds? (pure)

A restore checks a snapshot's members, read from its own db, against the config
(``backup.identity.layout_problems``). A member add, a removal or a replacement is no KV event:
nothing breaks a delta chain, so a chain begun from a backup of a smaller (or older) layout would
go on continuing it, and ``restore --from latest`` would find only backups of a layout that no
longer exists. The supervisor compares the member list the daemon asks each cycle with the
members of the newest full backup's snapshot (``compare``) and answers a difference with a new
full backup and a new chain (``decision.decide``).

What is compared, and why:

- member ids and peer URLs only: etcd 3.5.1-3.5.19 never rewrite a member's entry in the db, so
  a joined member has no name there and a promoted learner stays a learner (``etcd/snapdb``);
  names and learner flags would differ forever, and a backup would follow every cycle;
- a learner is a member like any other: its id and peer URLs are part of the layout, its
  promotion changes neither (and a restore makes every member a voter);
- a member that is down is still listed: not a change;
- a member added but not started yet (etcd lists it without a name) makes the change half-done:
  the backup waits for it to start, at most ``HALF_DONE_WAIT`` s; after that it is backed up as
  etcd lists it, as a down member would be (an unstarted member is a member too);
- a backup member whose id is gone but whose peer URL a current member holds is that member's
  earlier incarnation (etcd 3.4 keeps them in the db after a restore) or the one it replaced;
- a backup none of whose member ids is listed any more is not of this membership's history but
  of the cluster before a restore (or of another cluster): the chain's own checks of the member
  say so, as a break (a restore by hand is recorded from it), so it is no change here;
- a backup whose snapshot cannot be read here (compressed, encrypted) is compared by the member
  ids its writer found in its db (the check cache), peer URLs unknown.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Sequence, Tuple

from etcd_agent.etcd.client import MemberInfo

HALF_DONE_WAIT = 300.0  # seconds a full backup waits for a member added but not started


@dataclass(frozen=True)
class Seat:
    """A member as a backup's snapshot db lists it."""

    id: int
    name: str = ""  # only when etcd wrote one (a bootstrapped member; 3.4; 3.5.20+)
    peer_urls: Tuple[str, ...] = ()  # (): not known (the snapshot was not read, its ids were)

    @property
    def label(self) -> str:
        return self.name or format(self.id, "x")


@dataclass(frozen=True)
class Change:
    what: str = ""  # "membership changed: member ew3 added; ..." ("" the same, or nothing to compare)
    half_done: str = ""  # a member added but not started yet ("" none)


def _label(m: MemberInfo) -> str:
    return m.name or f"{m.id:x} ({','.join(m.peer_urls) or 'no peer URL'})"


def compare(live: Sequence[MemberInfo], held: Sequence[Seat]) -> Change:
    """How the running cluster's members (``live``, as etcd lists them) differ from ``held`` (a
    backup's snapshot members); nothing when either is unknown (empty)."""
    if not live or not held:
        return Change()
    held_by_id = {s.id: s for s in held}
    live_ids = {m.id for m in live}
    if not live_ids & set(held_by_id):
        return Change()  # restored, or another cluster: a chain break, not a membership change
    live_peers = {u for m in live for u in m.peer_urls}
    gone = [s for s in held if s.id not in live_ids]
    changes: List[str] = []
    for m in sorted(live, key=lambda x: x.id):
        s = held_by_id.get(m.id)
        if s is None:
            was = next((g for g in gone if set(g.peer_urls) & set(m.peer_urls)), None)
            changes.append(f"member {_label(m)} replaced (id {was.id:x} -> {m.id:x})" if was is not None and m.name
                           else f"member {_label(m)} added")
        elif s.peer_urls and set(s.peer_urls) != set(m.peer_urls):
            changes.append(f"member {_label(m)}'s peer URLs changed to {','.join(m.peer_urls)}")
    for s in gone:
        if not set(s.peer_urls) & live_peers:  # a peer URL still served: an earlier incarnation
            changes.append(f"member {s.label} removed")
    waiting = [m for m in live if not m.name]
    half = "; ".join(f"member {_label(m)} is added but not started yet" for m in waiting)
    return Change("membership changed: " + "; ".join(changes) if changes else "", half)


def fingerprint(live: Sequence[MemberInfo]) -> FrozenSet[Tuple[int, Tuple[str, ...]]]:
    """The layout of a member list as compared here: ids with their peer URLs."""
    return frozenset((m.id, tuple(sorted(m.peer_urls))) for m in live)
