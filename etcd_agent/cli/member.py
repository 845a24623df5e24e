"""`etcd-agent member list | add | remove` and this host's `join | leave | reset`.

Plans are printed before anything changes; destructive commands (remove, leave, reset) show the
plan on stderr and ask unless ``--yes``; ``--dry-run`` prints the plan and changes nothing.
A refused pre-check is exit 3 with nothing touched.
"""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

from etcd_agent.cli.main import Context, Output
from etcd_agent.errors import RefusedError

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.cluster.scaleplan import Plan
    from etcd_agent.config import Config
    from etcd_agent.member.local import LocalMember


def register(sub: Any) -> None:
    p = sub.add_parser("member", help="cluster membership: list | add NAME | remove NAME (quorum-checked)")
    msub = p.add_subparsers(dest="member_command", metavar="SUBCOMMAND")
    msub.required = True

    pl = msub.add_parser("list", help="etcd's member list with started / learner / healthy flags")
    pl.set_defaults(func=cmd_list)

    pa = msub.add_parser("add", help="add a member to the cluster (start it with `etcd-agent join` on its host)")
    pa.add_argument("name", metavar="NAME")
    pa.add_argument("--peer-url", metavar="URL", help="its peer URL (default: the config's, if NAME is configured)")
    pa.add_argument("--learner", action="store_true", help="add as a non-voting learner")
    pa.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    pa.add_argument("--yes", action="store_true", help="do not ask (a voter added and never started costs fault tolerance)")
    pa.set_defaults(func=cmd_add)

    pr = msub.add_parser("remove", help="remove a member (refused if quorum would be lost or it is the last)")
    pr.add_argument("name", metavar="NAME")
    pr.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    pr.add_argument("--yes", action="store_true", help="do not ask")
    pr.set_defaults(func=cmd_remove)

    helps = {
        "join": "add this host's member to the running cluster and start it (incremental path)",
        "leave": "remove this host's member, stop etcd, move its data dir aside (kept)",
        "reset": "destroy this host's member: remove it, stop etcd, delete its data dir",
    }
    for name, func in (("join", cmd_join), ("leave", cmd_leave), ("reset", cmd_reset)):
        q = sub.add_parser(name, help=helps[name])
        q.add_argument("--member", metavar="NAME", help="which member is local (overrides [local] name)")
        q.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
        if name != "join":
            q.add_argument("--yes", action="store_true", help="do not ask")
        else:
            q.add_argument("--learner", action="store_true",
                           help="join as a learner, promote once caught up (default: [cluster] learner_joins)")
        q.set_defaults(func=func)


def _client(cfg: "Config") -> Any:
    from etcd_agent.etcd.client import EtcdClient

    return EtcdClient.from_config(cfg)


def _local(ctx: Context, args: argparse.Namespace) -> Tuple["Config", "LocalMember"]:
    from etcd_agent.config import with_local
    from etcd_agent.locality import local_member, machine_identity
    from etcd_agent.member.local import LocalMember

    cfg = ctx.config()
    member = cfg.member(args.member) if args.member else local_member(cfg, machine_identity())
    cfg = with_local(cfg, member.name)
    return cfg, LocalMember(cfg, member)


def _dry(plan: "Plan") -> Output:
    return Output({"plan": plan.to_json(), "executed": False}, plan.text() + "\n(dry run: nothing changed)")


def _confirm(ctx: Context, plan: "Plan", question: str, yes: bool) -> None:
    """Show the plan on stderr and ask; a "no" is a refusal with nothing touched."""
    if not yes:
        sys.stderr.write(plan.text() + "\n")
        sys.stderr.flush()
    if not ctx.confirm(question, yes):
        raise RefusedError(f"{plan.action} {plan.target}: not confirmed; nothing changed")


def cmd_list(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cluster.scale import observe
    from etcd_agent.cluster.scaleplan import member_rows

    cfg = ctx.config()
    with _client(cfg) as client:
        view = observe(client)
    rows = member_rows(cfg, view)
    return Output({"members": rows, "summary": view.summary()}, _format_rows(rows) + "\n" + view.summary())


def cmd_add(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cluster.scale import execute_add, plan_add

    cfg = ctx.config()
    with _client(cfg) as client:
        plan = plan_add(cfg, client, args.name, args.peer_url, learner=args.learner)
        if args.dry_run:
            return _dry(plan)
        # a voter that is added but never started counts against quorum until it runs: ask first
        _confirm(ctx, plan, f"add member {args.name} to the cluster?", args.yes)
        info = execute_add(cfg, client, plan)
    text = (
        f"added {args.name} as {info.hex_id}{' (learner)' if info.is_learner else ''}; start it on its host with "
        f"`etcd-agent join` (ETCD_INITIAL_CLUSTER={plan.initial_cluster}, state existing)"
    )
    return Output({"plan": plan.to_json(), "executed": True, "member_id": info.hex_id}, text)


def cmd_remove(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cluster.scale import execute_remove, plan_remove

    cfg = ctx.config()
    with _client(cfg) as client:
        plan = plan_remove(cfg, client, args.name)
        if args.dry_run:
            return _dry(plan)
        _confirm(ctx, plan, f"remove member {args.name} ({plan.member_id:x}) from the cluster?", args.yes)
        execute_remove(cfg, client, plan)
    return Output({"plan": plan.to_json(), "executed": True}, f"removed {args.name} ({plan.member_id:x})")


def cmd_join(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cluster.scale import execute_join, plan_join

    cfg, lm = _local(ctx, args)
    with _client(cfg) as client:
        plan = plan_join(cfg, client, lm)
        if args.dry_run:
            return _dry(plan)
        info = execute_join(cfg, client, lm, learner=args.learner or cfg.cluster.learner_joins)
    return Output(
        {"plan": plan.to_json(), "executed": True, "member_id": info.hex_id},
        f"{lm.member.name} joined as {info.hex_id} and is healthy",
    )


def _leave(args: argparse.Namespace, ctx: Context, reset: bool) -> Output:
    from etcd_agent.cluster.scale import execute_leave, others_client, plan_leave

    cfg, lm = _local(ctx, args)
    with others_client(cfg, lm.member) as client:
        plan = plan_leave(cfg, client, lm, reset=reset)
        if args.dry_run:
            return _dry(plan)
        what = "DESTROY this member: remove it, stop etcd and DELETE" if reset else "remove this member, stop etcd and move aside"
        _confirm(ctx, plan, f"{what} {lm.data_dir} ({lm.member.name})?", args.yes)
        done = execute_leave(cfg, client, lm, reset=reset)
    if reset:
        text = f"{lm.member.name} reset: removed from the cluster, etcd stopped, data deleted"
    else:
        kept = f"; old data kept in {done.aside_dir}" if done.aside_dir else ""
        text = f"{lm.member.name} left the cluster and etcd is stopped{kept}"
    return Output({"plan": done.to_json(), "executed": True}, text)


def cmd_leave(args: argparse.Namespace, ctx: Context) -> Output:
    return _leave(args, ctx, reset=False)


def cmd_reset(args: argparse.Namespace, ctx: Context) -> Output:
    return _leave(args, ctx, reset=True)


def _format_rows(rows: List[Dict[str, Any]]) -> str:
    head = ["ID", "NAME", "STARTED", "LEARNER", "HEALTHY", "IN CONFIG", "PEER URLS", "CLIENT URLS"]

    def yn(v: bool) -> str:
        return "yes" if v else "no"

    body = [
        [r["id"], r["name"] or "-", yn(r["started"]), yn(r["learner"]), yn(r["healthy"]), yn(r["in_config"]),
         ",".join(r["peer_urls"]), ",".join(r["client_urls"]) or "-"]
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + body)
