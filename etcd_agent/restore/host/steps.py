"""The restore's steps ``etcd-agent node serve`` runs, by name: the node protocol's server side.

Each handler reads its typed arguments and calls the code that does the work on this host
(``NodeRestore``); ``cli/node.py`` registers this table with the other steps (the upgrade of one
member, a backup, the session lock) into the node server; the orchestrator reaches them only through
``NodeClient.call(step, ...)``. Steps that change anything require the session's host lock.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Callable, Dict, List, Optional, Tuple

from etcd_agent.errors import AgentError, OperationFailed, RefusedError
from etcd_agent.node.protocol import Args, StepArgs
from etcd_agent.node.replies import MemberSteps, StepReply, StepsReply
from etcd_agent.node.server import Handler, NodeContext
from etcd_agent.typedjson import Document, Items

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.restore.host.node import NodeRestore

log = logging.getLogger(__name__)
MAX_MEMBERS = 64  # the members of one host a batch of steps names


# ---------------------------------------------------------------- the steps' arguments
# What the orchestrator sends (``NodeClient.call(step, member=..., op=..., **args)``), read as one
# typed document per step: a wrong or missing argument is refused (exit 3) naming it, before the
# step touches anything.


@dataclass(frozen=True)
class MemberArgs(StepArgs):
    """A step that takes nothing but the member and the restore (op) it belongs to."""

    member: str
    op: Optional[str] = None


@dataclass(frozen=True)
class BeginArgs(StepArgs):
    member: str
    token: str
    initial_cluster: str
    size: int
    backup: str
    op: Optional[str] = None
    sha256: Optional[str] = None
    bump: Optional[int] = None
    fence_owner: bool = False
    new_cluster: bool = False


@dataclass(frozen=True)
class ReceiveArgs(StepArgs):
    member: str
    op: Optional[str] = None
    sha256: Optional[str] = None
    copy_from: Optional[str] = None  # a file on this host to copy from (absolute) ...
    offset: Optional[int] = None  # ... where the snapshot starts in it


@dataclass(frozen=True)
class FinishArgs(StepArgs):
    member: str
    op: Optional[str] = None
    member_id: Optional[str] = None
    cluster_id: Optional[str] = None
    ancestors: Tuple[str, ...] = ()


@dataclass(frozen=True)
class ServingArgs(StepArgs):
    member: str
    op: Optional[str] = None
    min_revision: Optional[int] = None


@dataclass(frozen=True)
class CleanupArgs(StepArgs):
    member: str
    keep: int
    op: Optional[str] = None
    dry_run: bool = False


@dataclass(frozen=True)
class MemberStepsArgs(Document):
    member: str
    steps: Tuple[str, ...] = ()


@dataclass(frozen=True)
class StepsArgs(StepArgs):
    members: Annotated[Tuple[MemberStepsArgs, ...], Items(1, MAX_MEMBERS)]
    op: Optional[str] = None


def _node(ctx: NodeContext, member: str, op: Optional[str]) -> "NodeRestore":
    from etcd_agent.restore.host.node import NodeRestore

    return NodeRestore(ctx.cfg, member, op)


def precheck(ctx: NodeContext, args: Args) -> Document:
    from etcd_agent.restore.host.node import NodeRestore

    return NodeRestore(ctx.cfg, args.read(MemberArgs).member).precheck()


def begin(ctx: NodeContext, args: Args) -> Document:
    ctx.require_lock("begin")
    a = args.read(BeginArgs)
    return _node(ctx, a.member, a.op).begin(
        token=a.token, initial_cluster=a.initial_cluster, sha256=a.sha256, size=a.size, backup=a.backup, bump=a.bump,
        fence_owner=a.fence_owner, new_cluster=a.new_cluster,
    )


# steps that take nothing but the member and the op
SIMPLE_STEPS = ("restore", "fence", "halt", "stop", "aside", "install", "chown", "repair", "start", "unfence", "rollback")


def simple(name: str) -> Handler:
    def handler(ctx: NodeContext, args: Args) -> Document:
        ctx.require_lock(name)
        a = args.read(MemberArgs)
        return run_step(_node(ctx, a.member, a.op), name)

    return handler


def run_step(node: "NodeRestore", name: str) -> StepReply:
    """One of ``SIMPLE_STEPS`` by name (checked against that list: never any other attribute)."""
    if name not in SIMPLE_STEPS:
        raise RefusedError(f"node: not a simple step: {name}")
    fn: Callable[[], StepReply] = getattr(node, name)
    return fn()


def steps(ctx: NodeContext, args: Args) -> Document:
    """Simple steps of several of this host's members in one call (``run_members``)."""
    plan = member_steps(args)
    ctx.require_lock("steps")
    op = args.read(StepsArgs).op
    from etcd_agent.restore.host.node import NodeRestore

    def runner(member: str) -> Callable[[str], StepReply]:
        node = NodeRestore(ctx.cfg, member, op)
        return lambda name: run_step(node, name)

    return run_members(plan, runner)


# member -> a function running that member's steps by name
Runner = Callable[[str], Callable[[str], StepReply]]


def run_members(plan: List[Tuple[str, List[str]]], runner: Runner) -> StepsReply:
    """Each member's steps in order, stopping at its first failure; the members at once (two etcds
    of one host stopped one after the other would each wait out etcd's peer shutdown). Every
    member's results come back, and its error when it failed; what it finished is journaled."""
    from etcd_agent.node.sessions import parallel

    def run(item: Tuple[str, List[str]]) -> MemberSteps:
        member, names = item
        done: List[StepReply] = []
        try:
            step = runner(member)
            for name in names:
                done.append(step(name))
        except AgentError as exc:
            return MemberSteps(member, tuple(done), exc.to_json())
        except Exception as exc:  # a bug in a step: reported as that member's failure, not a hang
            log.exception("node steps of %s failed unexpectedly", member)
            crash = OperationFailed(f"node step crashed: {type(exc).__name__}: {exc}")
            return MemberSteps(member, tuple(done), crash.to_json())
        return MemberSteps(member, tuple(done))

    return StepsReply(tuple(res for _item, res, _err in parallel(run, plan) if res is not None))


def member_steps(args: Args) -> List[Tuple[str, List[str]]]:
    """The ``members`` argument of ``steps``: [{"member": NAME, "steps": [SIMPLE_STEP, ...]}, ...],
    each member once."""
    out: List[Tuple[str, List[str]]] = []
    for entry in args.read(StepsArgs).members:
        member, names = entry.member, list(entry.steps)
        bad = [n for n in names if n not in SIMPLE_STEPS]
        if bad:
            raise RefusedError(f"node steps: not a simple step: {', '.join(bad)}")
        if member in (m for m, _n in out):
            raise RefusedError(f"node steps: member {member} named twice")
        out.append((member, names))
    return out


def receive(ctx: NodeContext, args: Args) -> Document:
    ctx.require_lock("receive")
    a = args.read(ReceiveArgs)
    if a.copy_from is not None and not os.path.isabs(a.copy_from):
        raise RefusedError(f"node receive: copy_from must be an absolute path, got {a.copy_from!r}")
    copy_from = (a.copy_from, a.offset or 0) if a.copy_from is not None else None
    return _node(ctx, a.member, a.op).receive(a.sha256, copy_from)


def finish(ctx: NodeContext, args: Args) -> Document:
    ctx.require_lock("finish")
    a = args.read(FinishArgs)
    return _node(ctx, a.member, a.op).finish(member_id=a.member_id, cluster_id=a.cluster_id, ancestors=list(a.ancestors))


def serving(ctx: NodeContext, args: Args) -> Document:
    """Read-only: who serves the member now (``NodeRestore.serving``)."""
    a = args.read(ServingArgs)
    return _node(ctx, a.member, a.op).serving(a.min_revision)


def cleanup(ctx: NodeContext, args: Args) -> Document:
    a = args.read(CleanupArgs)
    if not a.dry_run:
        ctx.require_lock("cleanup")
    return _node(ctx, a.member, a.op).cleanup(a.keep, a.dry_run)


def handlers() -> Dict[str, Handler]:
    """The restore's steps by name, for ``node serve`` to register (the node server never imports
    the restore: it is handed this table)."""
    table: Dict[str, Handler] = {
        "precheck": precheck, "begin": begin, "steps": steps, "receive": receive, "finish": finish, "serving": serving,
        "cleanup": cleanup,
    }
    for name in SIMPLE_STEPS:
        table[name] = simple(name)
    return table
