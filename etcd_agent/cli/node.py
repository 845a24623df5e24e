"""`etcd-agent node STEP ... --json`: one host's restore steps, run over SSH by `restore`.

The remote end of the restore is this same program: every step is a function of
``etcd_agent.restore.node`` run locally on the host that owns the member. Output is one JSON
document (``--json``); errors carry the usual exit codes (3 refused, 4 busy).
"""
from __future__ import annotations

import argparse
from typing import Any

from .main import Context, Output

MEMBER_STEPS = ("fence", "stop", "aside", "receive", "restore", "chown", "repair", "start", "unfence", "finish", "rollback")


def register(sub: Any) -> None:
    p = sub.add_parser("node", help="one host's restore steps (run over SSH by `restore`; not for operators)")
    nsub = p.add_subparsers(dest="node_step", metavar="STEP")
    nsub.required = True

    pc = nsub.add_parser("precheck", help="report this host's facts for a member (changes nothing)")
    pc.add_argument("--member", required=True, metavar="NAME")
    pc.set_defaults(func=cmd_precheck)

    for name in ("lock", "unlock"):
        q = nsub.add_parser(name, help=f"{name} this host's operation lock for a restore")
        q.add_argument("--op", required=True, metavar="ID")
        q.set_defaults(func=cmd_lock if name == "lock" else cmd_unlock)

    b = nsub.add_parser("begin", help="create the work dir and journal of a member's restore")
    b.add_argument("--member", required=True, metavar="NAME")
    b.add_argument("--op", required=True, metavar="ID")
    b.add_argument("--token", required=True)
    b.add_argument("--initial-cluster", required=True)
    b.add_argument("--sha256", required=True)
    b.add_argument("--size", required=True, type=int)
    b.add_argument("--backup", required=True)
    b.add_argument("--bump", type=int, default=None)
    b.add_argument("--fence-owner", action="store_true")
    b.add_argument("--new-cluster", action="store_true")
    b.set_defaults(func=cmd_begin)

    for name in MEMBER_STEPS:
        q = nsub.add_parser(name, help=f"restore step {name} for a member (journaled, idempotent)")
        q.add_argument("--member", required=True, metavar="NAME")
        q.add_argument("--op", required=True, metavar="ID")
        q.add_argument(
            "--then", action="append", default=[], choices=MEMBER_STEPS, metavar="STEP",
            help="run these steps next in the same process, stopping at the first failure",
        )
        q.set_defaults(func=cmd_step, step=name)

    c = nsub.add_parser("cleanup", help="list / remove a member's set-aside data dirs")
    c.add_argument("--member", required=True, metavar="NAME")
    c.add_argument("--keep", type=int, default=1)
    c.add_argument("--dry-run", action="store_true")
    c.set_defaults(func=cmd_cleanup)


def _node(ctx: Context, member: str, op: Any = None) -> Any:
    from ..restore.node import NodeRestore

    return NodeRestore(ctx.config(), member, op)


def cmd_precheck(args: argparse.Namespace, ctx: Context) -> Output:
    return Output(_node(ctx, args.member).precheck())


def cmd_lock(args: argparse.Namespace, ctx: Context) -> Output:
    from ..state.locks import lock

    return Output(lock(ctx.config(), args.op))


def cmd_unlock(args: argparse.Namespace, ctx: Context) -> Output:
    from ..state.locks import unlock

    return Output(unlock(ctx.config(), args.op))


def cmd_begin(args: argparse.Namespace, ctx: Context) -> Output:
    n = _node(ctx, args.member, args.op)
    return Output(
        n.begin(
            token=args.token, initial_cluster=args.initial_cluster, sha256=args.sha256, size=args.size,
            backup=args.backup, bump=args.bump, fence_owner=args.fence_owner, new_cluster=args.new_cluster,
        )
    )


def cmd_step(args: argparse.Namespace, ctx: Context) -> Output:
    n = _node(ctx, args.member, args.op)
    results = [getattr(n, step)() for step in [args.step] + list(args.then)]
    return Output(results[0] if len(results) == 1 else {**results[-1], "steps": results})


def cmd_cleanup(args: argparse.Namespace, ctx: Context) -> Output:
    return Output(_node(ctx, args.member).cleanup(args.keep, args.dry_run))
