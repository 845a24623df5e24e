"""The steps ``etcd-agent node serve`` runs, by name: the node protocol's server side.

Each handler reads its typed arguments and calls the code that does the work on this host
(restore steps, the upgrade of one member); the orchestrator reaches them only through
``NodeClient.call(step, ...)``. Steps that change anything require the session's host lock.
"""
from __future__ import annotations

from typing import Any, Dict

from .protocol import Args, str_list
from .server import Handler, NodeContext


def _node(ctx: NodeContext, args: Args) -> Any:
    from ..restore.node import NodeRestore

    return NodeRestore(ctx.cfg, args.text("member"), args.opt_text("op"))


def precheck(ctx: NodeContext, args: Args) -> Dict[str, Any]:
    from ..restore.node import NodeRestore

    return NodeRestore(ctx.cfg, args.text("member")).precheck().to_json()


def begin(ctx: NodeContext, args: Args) -> Dict[str, Any]:
    ctx.require_lock("begin")
    result: Dict[str, Any] = _node(ctx, args).begin(
        token=args.text("token"), initial_cluster=args.text("initial_cluster"), sha256=args.opt_text("sha256"),
        size=args.integer("size"), backup=args.text("backup"), bump=args.opt_integer("bump"),
        fence_owner=args.flag("fence_owner"), new_cluster=args.flag("new_cluster"),
    )
    return result


# steps that take nothing but the member and the op
SIMPLE_STEPS = ("fence", "stop", "aside", "restore", "chown", "repair", "start", "unfence", "rollback")


def simple(name: str) -> Handler:
    def handler(ctx: NodeContext, args: Args) -> Dict[str, Any]:
        ctx.require_lock(name)
        result: Dict[str, Any] = getattr(_node(ctx, args), name)()
        return result

    return handler


def steps(ctx: NodeContext, args: Args) -> Dict[str, Any]:
    """Several simple steps of one member in order, stopping at the first failure (fewer round
    trips); the reply lists each one's result."""
    names = str_list(args, "steps")
    bad = [n for n in names if n not in SIMPLE_STEPS]
    if bad:
        from ..errors import RefusedError

        raise RefusedError(f"node steps: not a simple step: {', '.join(bad)}")
    ctx.require_lock("steps")
    node = _node(ctx, args)
    return {"steps": [getattr(node, n)() for n in names]}


def receive(ctx: NodeContext, args: Args) -> Dict[str, Any]:
    ctx.require_lock("receive")
    result: Dict[str, Any] = _node(ctx, args).receive(args.text("sha256"))
    return result


def finish(ctx: NodeContext, args: Args) -> Dict[str, Any]:
    ctx.require_lock("finish")
    result: Dict[str, Any] = _node(ctx, args).finish(
        member_id=args.opt_text("member_id"), cluster_id=args.opt_text("cluster_id"), ancestors=str_list(args, "ancestors"))
    return result


def cleanup(ctx: NodeContext, args: Args) -> Dict[str, Any]:
    keep, dry_run = args.integer("keep"), args.flag("dry_run")
    if not dry_run:
        ctx.require_lock("cleanup")
    result: Dict[str, Any] = _node(ctx, args).cleanup(keep, dry_run)
    return result


def upgrade_member(ctx: NodeContext, args: Args) -> Dict[str, Any]:
    from ..member.upgrade import upgrade_member as step

    ctx.require_lock("upgrade-member")
    return step(ctx.cfg, args.text("member"), args.text("to"), args.number("timeout", 120.0))


def release_version(ctx: NodeContext, args: Args) -> Dict[str, Any]:
    from ..member.upgrade import release_versions

    return dict(release_versions(ctx.cfg, args.text("version")))


def backup(ctx: NodeContext, args: Args) -> Dict[str, Any]:
    """A verified backup written here, under the lock this session already holds."""
    from ..backup.service import take_backup

    ctx.require_lock("backup")
    return take_backup(ctx.cfg, member=args.opt_text("member"), full_verify=True, prune=False, hold_lock=False).to_json()


def lock(ctx: NodeContext, args: Args) -> Dict[str, Any]:
    return ctx.take_lock()


def handlers() -> Dict[str, Handler]:
    table: Dict[str, Handler] = {
        "lock": lock,
        "precheck": precheck, "begin": begin, "steps": steps, "receive": receive, "finish": finish,
        "cleanup": cleanup, "upgrade-member": upgrade_member, "release-version": release_version, "backup": backup,
    }
    for name in SIMPLE_STEPS:
        table[name] = simple(name)
    return table
