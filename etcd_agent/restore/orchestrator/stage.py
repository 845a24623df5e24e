"""The restore's staging phase: every member's snapshot into its work dir and restored beside its
data dir while etcd still serves (none of it is downtime).

This master's own members copy it from the file here and restore it at once, on a thread of their
own, while it is shipped to the others, which then restore theirs: the local restore overlaps the
ship. Both halves end before anything is raised, so a rollback never races a step still running.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

from etcd_agent.config import Member
from etcd_agent.errors import OperationFailed
from etcd_agent.node.replies import ReceiveReply
from etcd_agent.node.sessions import message, parallel
from etcd_agent.restore.host.facts import NodeFacts
from etcd_agent.restore.orchestrator.ship import ship_snapshot
from etcd_agent.restore.orchestrator.source import Source

if TYPE_CHECKING:
    from etcd_agent.restore.orchestrator.orchestrate import Restore

Half = Callable[[], Optional[str]]  # one half of the staging; the sha256 it shipped, if it shipped


def stage(r: Restore, source: Source, facts: Dict[str, NodeFacts]) -> None:
    """Both halves, in parallel (either alone when the other has no member); then the copies here
    compared with what was shipped."""
    everyone = r.active()
    here = [m for m in everyone if r.node_of(m.name).local]
    away = [m for m in everyone if not r.node_of(m.name).local]
    copied: Dict[str, str] = {}  # member -> sha256 of its copy

    def local_half() -> Optional[str]:
        r.phase("copy", lambda m: copy_here(r, m, source, copied), unreceived(r.op, here, facts))
        r.batch("restore", [(m, ["restore"]) for m in here], timing="restore here")
        return None

    def remote_half() -> Optional[str]:
        sha = ship(r, source, unreceived(r.op, away, facts))
        r.batch("restore", [(m, ["restore"]) for m in away])
        return sha

    halves: List[Half] = [f for f, ms in ((local_half, here), (remote_half, away)) if ms]
    results = parallel(lambda f: f(), halves)
    raise_failed([e for _f, _r, e in results if e is not None])
    same_copies(copied, next((sha for _f, sha, _e in results if sha is not None), None))


def raise_failed(failed: Sequence[BaseException]) -> None:
    """One half's failure as it was raised (an interrupt always so); both halves' as one error."""
    for e in failed:
        if len(failed) == 1 or isinstance(e, KeyboardInterrupt):
            raise e
    if failed:
        raise OperationFailed("restore failed while staging the snapshot; nothing stopped",
                              details=[message(e) for e in failed])


def same_copies(copied: Dict[str, str], shipped: Optional[str]) -> None:
    """The copies made here hold what was shipped to the others: one read here, another there
    means the file changed under the restore."""
    if shipped is None:
        return
    wrong = sorted((n, s) for n, s in copied.items() if s != shipped)
    if wrong:
        raise OperationFailed("the snapshot copied on this master is not the one shipped to the others "
                              f"({shipped[:16]}...); nothing stopped",
                              details=[f"{n}: {s[:16]}..." for n, s in wrong])


def unreceived(op: str, members: List[Member], facts: Dict[str, NodeFacts]) -> List[Member]:
    """``members`` whose snapshot ``op`` has not received yet (a resumed restore skips the rest)."""
    out = []
    for m in members:
        f = facts.get(m.name)
        j = f.journal if f is not None else None
        if not (j is not None and j.op == op and "receive" in j.steps):
            out.append(m)
    return out


def copy_here(r: Restore, m: Member, source: Source, copied: Dict[str, str]) -> None:
    """A member on this master: its node copies the snapshot from the file here, with the
    receiver's checks (sha256 against the manifest's when there is one, etcd's trailer, bbolt)."""
    path, offset = source.location()
    got = r.node_of(m.name).ask(ReceiveReply, "receive", member=m.name, op=r.op, sha256=source.sha256,
                                copy_from=os.path.abspath(path), offset=offset)
    r.said(m, got, "receive")
    if got.sha256 is None:
        raise OperationFailed(f"{m.name}: its copy of the snapshot reports no sha256")
    copied[m.name] = got.sha256


def ship(r: Restore, source: Source, todo: List[Member]) -> Optional[str]:
    """The snapshot to the other masters' members while etcd still serves (shipping is not
    downtime): read and hashed once here, fanned out to one receiver per member, each hashing
    what lands (``restore.ship``); then each member's ``receive`` step compares. The sha256
    shipped, or None when there was nothing to ship."""
    t = time.monotonic()
    sha = None
    if todo:
        assert r.owner is not None
        shipped = ship_snapshot(r.cfg, source, [(m, r.node_of(m.name)) for m in todo], op=r.op,
                                owner=r.owner, say=r.say, standby=r.standby)
        r.say(shipped.describe())
        r.timings["ship: receivers ready"] = shipped.ready
        r.timings["ship: stream"] = shipped.seconds - shipped.ready
        r.phase("ship", lambda m: r.call(m, "receive", sha256=shipped.sha256), todo)
        sha = shipped.sha256
    r.timings["ship"] = time.monotonic() - t
    return sha
