"""The restore's steps ``etcd-agent node serve`` runs, by name: the node protocol's server side.

Each handler reads its typed arguments and calls the code that does the work on this host
(``NodeRestore``); ``cli/node.py`` registers this table with the other steps (the upgrade of one
member, a backup, the session lock) into the node server; the orchestrator reaches them only through
``NodeClient.call(step, ...)``. Steps that change anything require the session's host lock.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable, Dict, List, Tuple

from etcd_agent.errors import AgentError, OperationFailed, RefusedError
from etcd_agent.node.protocol import Args, str_list
from etcd_agent.node.replies import MemberSteps, StepReply, StepsReply
from etcd_agent.node.server import Handler, NodeContext
from etcd_agent.typedjson import Document

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.restore.host.node import NodeRestore

log = logging.getLogger(__name__)


def _node(ctx: NodeContext, args: Args) -> "NodeRestore":
    from etcd_agent.restore.host.node import NodeRestore

    return NodeRestore(ctx.cfg, args.text("member"), args.opt_text("op"))


def precheck(ctx: NodeContext, args: Args) -> Document:
    from etcd_agent.restore.host.node import NodeRestore

    return NodeRestore(ctx.cfg, args.text("member")).precheck()


def begin(ctx: NodeContext, args: Args) -> Document:
    ctx.require_lock("begin")
    return _node(ctx, args).begin(
        token=args.text("token"), initial_cluster=args.text("initial_cluster"), sha256=args.opt_text("sha256"),
        size=args.integer("size"), backup=args.text("backup"), bump=args.opt_integer("bump"),
        fence_owner=args.flag("fence_owner"), new_cluster=args.flag("new_cluster"),
    )


# steps that take nothing but the member and the op
SIMPLE_STEPS = ("restore", "fence", "halt", "stop", "aside", "install", "chown", "repair", "start", "unfence", "rollback")


def simple(name: str) -> Handler:
    def handler(ctx: NodeContext, args: Args) -> Document:
        ctx.require_lock(name)
        return run_step(_node(ctx, args), name)

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
    op = args.opt_text("op")
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
    raw = args.raw.get("members")
    if not isinstance(raw, list) or not raw:
        raise RefusedError("node steps: argument 'members' must be a non-empty list")
    out: List[Tuple[str, List[str]]] = []
    for item in raw:
        if not isinstance(item, dict):
            raise RefusedError("node steps: every entry of 'members' must be an object")
        entry = Args(item, "steps")
        member, names = entry.text("member"), str_list(entry, "steps")
        bad = [n for n in names if n not in SIMPLE_STEPS]
        if bad:
            raise RefusedError(f"node steps: not a simple step: {', '.join(bad)}")
        if member in (m for m, _n in out):
            raise RefusedError(f"node steps: member {member} named twice")
        out.append((member, names))
    return out


def receive(ctx: NodeContext, args: Args) -> Document:
    ctx.require_lock("receive")
    path = args.opt_text("copy_from")
    if path is not None and not os.path.isabs(path):
        raise RefusedError(f"node receive: copy_from must be an absolute path, got {path!r}")
    copy_from = (path, args.opt_integer("offset") or 0) if path is not None else None
    return _node(ctx, args).receive(args.opt_text("sha256"), copy_from)


def finish(ctx: NodeContext, args: Args) -> Document:
    ctx.require_lock("finish")
    return _node(ctx, args).finish(
        member_id=args.opt_text("member_id"), cluster_id=args.opt_text("cluster_id"), ancestors=str_list(args, "ancestors"),
    )


def serving(ctx: NodeContext, args: Args) -> Document:
    """Read-only: who serves the member now (``NodeRestore.serving``)."""
    return _node(ctx, args).serving(args.opt_integer("min_revision"))


def cleanup(ctx: NodeContext, args: Args) -> Document:
    keep, dry_run = args.integer("keep"), args.flag("dry_run")
    if not dry_run:
        ctx.require_lock("cleanup")
    return _node(ctx, args).cleanup(keep, dry_run)


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
