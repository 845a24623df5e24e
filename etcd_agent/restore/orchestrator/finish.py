"""The restore's last phases, once every member runs on its restored data: each member checked as
what really serves, the apiservers started again one host at a time, every journal closed with
the member's new identity."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from etcd_agent.errors import EtcdError, OperationFailed
from etcd_agent.restore.orchestrator import plan as P
from etcd_agent.restore.orchestrator.options import Outcome
from etcd_agent.restore.orchestrator.source import Source

if TYPE_CHECKING:
    from etcd_agent.restore.orchestrator.orchestrate import Restore


def served(r: Restore, plan: P.Plan, source: Source) -> None:
    """Healthy is not restored: an old etcd (one without a pid file, one started by hand)
    answers health checks too. Each member's host checks that its serving process is the one
    just started, from the restored data dir, answering for the restored cluster at the
    bumped revision; a member that is not fails the restore, which then rolls back."""
    least = source.revision + P.BUMP_REVISION if plan.bump and source.revision is not None else None
    r.phase("serving", lambda m: r.call(m, "serving", min_revision=least))


def folded(source: Source) -> None:
    """Wait for the point-in-time tail's fold (it ran while the hosts opened and the snapshot
    shipped): a chain that fails to fold fails the restore before anything live is touched."""
    from etcd_agent.chain.errors import ReplayError

    assert source.tail is not None
    try:
        source.tail.folded()
    except ReplayError as exc:
        raise OperationFailed(f"folding the point-in-time tail failed: {exc.message}; nothing live was touched") \
            from None


def load_tail(r: Restore, plan: P.Plan, source: Source, outcome: Outcome) -> None:
    """A point-in-time restore that loads its tail into the restored members: once they serve,
    the apiservers still fenced, the chain after the start snapshot is written into the cluster
    (``pitr.members.Tail``). A failure fails the restore, which then rolls every member back
    (none has finished yet); a resumed run loads it again, whatever part of it is there."""
    from etcd_agent.chain.errors import ReplayError
    from etcd_agent.pitr import report
    from etcd_agent.pitr.replayrun import Laps

    assert source.tail is not None and source.revision is not None
    t = time.monotonic()
    lap = Laps()
    start = source.revision + (P.BUMP_REVISION if plan.bump else 0)
    try:
        with r.cluster.writer() as rpc:
            res = source.tail.load(rpc, start, lap, resuming=plan.resuming)
    except (ReplayError, EtcdError) as exc:
        raise OperationFailed(f"loading the point-in-time tail into the restored members failed: {exc.message}") \
            from None
    r.timings["load"] = time.monotonic() - t
    r.timings.update((f"load: {k}", v) for k, v in lap.phases())
    outcome.point_in_time = report.describe(None, res)
    for line in outcome.point_in_time:
        r.say(line)


def unfence(r: Restore, outcome: Outcome) -> None:
    """The apiservers start again one host at a time: each host's unfence, then (with
    ``[kubernetes] readyz_url``) a wait until that apiserver answers /readyz, then the next.
    A slow apiserver is reported, not rolled back: etcd is restored and healthy by now."""
    t = time.monotonic()
    owners = P.fence_owners(r.cfg, {m.name: n.where for n in r.nodes for m in n.members})
    for m in r.cfg.members:
        if m.name in r.resume.finished:
            continue
        r.call(m, "unfence")
        if not owners[m.name] or r.cfg.kubernetes.fence == "none":
            continue
        try:
            waited = r.cluster.wait_ready(m)
        except OperationFailed as exc:
            outcome.ready[m.name] = f"NOT ready: {exc.message}"
            r.say(f"{m.name}: apiserver {outcome.ready[m.name]}; starting the next one anyway")
            continue
        if waited is not None:
            outcome.ready[m.name] = f"ready after {waited:.1f}s"
            r.say(f"{m.name}: apiserver ready after {waited:.1f}s")
    r.timings["unfence"] = time.monotonic() - t


def finish(r: Restore, plan: P.Plan, source: Source) -> None:
    """Every member's journal closed with its new member and cluster ids and the snapshot's
    members as its ancestors. The restore only goes forward from here: a failure is reported as
    unfinished, never rolled back."""
    t = time.monotonic()
    ids = r.cluster.member_ids()
    r.timings["ids"] = time.monotonic() - t
    r.resume = dataclasses.replace(r.resume, serving=tuple(ids))  # every member runs the restored data
    try:
        r.phase("finish", lambda m: r.call(m, "finish", member_id=ids[m.name][0] if m.name in ids else None,
                                           cluster_id=ids[m.name][1] if m.name in ids else None,
                                           ancestors=list(source.member_ids)))
    except OperationFailed as exc:
        raise r.unfinished(plan, exc, exc.details) from exc
