"""``restore rollback`` and ``restore cleanup``: the commands an operator runs after a restore
(or instead of finishing one), over the same node sessions as the restore itself."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from etcd_agent.config import Config
from etcd_agent.errors import AgentError, OperationFailed, RefusedError
from etcd_agent.node.client import new_owner
from etcd_agent.node.replies import CleanupReply
from etcd_agent.node.sessions import HostNode, close_sessions, group_hosts, open_sessions
from etcd_agent.restore.host.facts import NodeFacts
from etcd_agent.restore.host.journal import JournalSummary
from etcd_agent.restore.orchestrator.live import Progress
from etcd_agent.restore.orchestrator.options import Options
from etcd_agent.restore.orchestrator.orchestrate import Restore
from etcd_agent.restore.orchestrator.precheck import rollback_refusal, split_by_restore


def rollback_open(
    cfg: Config,
    progress: Progress = lambda s: None,
    *,
    dry_run: bool = False,
    confirm: Optional[Callable[[str], bool]] = None,
    nodes: Optional[Callable[[Config], List[HostNode]]] = None,
) -> Dict[str, Any]:
    """``restore rollback``: roll back whatever unfinished restore the hosts have journaled.
    ``dry_run`` only reports the open journals; ``confirm(text)`` False refuses (nothing done)."""
    r = Restore(cfg, Options(spec="", progress=progress), nodes=nodes)
    r.open_all("restore rollback")
    try:
        journals: Dict[str, Optional[JournalSummary]] = {
            m.name: n.ask(NodeFacts, "precheck", member=m.name).journal for n in r.nodes for m in n.members}
        open_ops = {m: j.op for m, j in journals.items() if j is not None and j.open}
        if not open_ops:
            split = split_by_restore(journals)
            if split:
                raise OperationFailed("no unfinished restore is journaled, but members are in two clusters",
                                      details=split)
            return {"rolled_back": {}, "note": "no unfinished restore is journaled"}
        refused = rollback_refusal(journals)
        if refused:  # a member finished it: rolling back the rest would leave two clusters
            raise RefusedError("not rolled back: members finished the restore and serve the restored cluster; "
                               "nothing changed", details=refused)
        what = ", ".join(f"{m} (op {op})" for m, op in sorted(open_ops.items()))
        if dry_run:
            return {"would_roll_back": dict(sorted(open_ops.items())),
                    "note": f"would roll back the unfinished restore of {what}: restored data moved to "
                            "<data dir>.failed-restore-<time>, the set-aside data dir put back, etcd restarted, "
                            "the apiserver unfenced"}
        if confirm is not None and not confirm(f"roll back the unfinished restore of {what}?"):
            raise RefusedError("rollback not confirmed; nothing changed")
        out: Dict[str, Any] = {}
        for op in sorted(set(open_ops.values())):
            r.op = op
            ok, lines = r.rollback([cfg.member(m) for m, o in open_ops.items() if o == op])
            out[op] = {"ok": ok, "report": lines}
            if not ok:
                again = (f"run `etcd-agent restore rollback --yes` again once {', '.join(r.unanswered)} answer"
                         if r.unanswered else "see why below, then run `etcd-agent restore rollback --yes` again")
                raise OperationFailed(f"rollback of restore {op} incomplete: {again}", details=lines)
        return {"rolled_back": out}
    finally:
        r.close_all()


def cleanup(cfg: Config, keep: int, dry_run: bool) -> List[CleanupReply]:
    """``restore cleanup``: every member's set-aside data dirs, the newest ``keep`` kept."""
    nodes = group_hosts(cfg)
    open_sessions(cfg, nodes, new_owner("restore cleanup"), lambda s: None)
    try:
        out = []
        for n in nodes:
            for m in n.members:
                try:
                    out.append(n.ask(CleanupReply, "cleanup", member=m.name, keep=keep, dry_run=dry_run))
                except AgentError as exc:
                    out.append(CleanupReply(m.name, dry_run, error=exc.message))
        return out
    finally:
        close_sessions(nodes)
