"""`etcd-agent upgrade --to VERSION` (rolling, whole cluster) and its per-host step `upgrade-member`.

The plan is printed before anything changes; without ``--yes`` the operator is asked. A refused
skew (a long jump, a downgrade) is exit 3 with the multi-hop path; a member that fails on the new
version is rolled back and the run stops with exit 1.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import RefusedError
from .main import Context, Output


def register(sub: Any) -> None:
    p = sub.add_parser("upgrade", help="rolling etcd upgrade, one member at a time (skew rules enforced)")
    p.add_argument("--to", required=True, metavar="VERSION", help="target etcd version, installed in [etcd] versions_dir")
    p.add_argument("--dry-run", action="store_true", help="print the plan and run the pre-checks; change nothing")
    p.add_argument("--yes", action="store_true", help="do not ask")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a member may take to be healthy (default 120)")
    p.set_defaults(func=cmd_upgrade)

    q = sub.add_parser("upgrade-member", help="(internal) one host's upgrade step, run by `upgrade` over SSH")
    q.add_argument("--member", required=True, metavar="NAME")
    q.add_argument("--to", required=True, metavar="VERSION")
    q.add_argument("--timeout", type=float, default=120.0)
    q.set_defaults(func=cmd_upgrade_member)


def cmd_upgrade(args: argparse.Namespace, ctx: Context) -> Output:
    from ..cluster.upgrade import MemberStep, check_release, plan_upgrade, run_upgrade
    from ..etcd.client import EtcdClient

    cfg = ctx.config()
    with EtcdClient.from_config(cfg, timeout=5.0) as client:
        plan = plan_upgrade(cfg, args.to, client)
        if plan.to_upgrade:
            check_release(cfg, plan)
        if args.dry_run or not plan.to_upgrade:
            suffix = "\n(dry run: nothing changed)" if args.dry_run else ""
            return Output({"plan": plan.to_json(), "executed": False}, plan.text() + suffix)
        if not args.yes:
            sys.stderr.write(plan.text() + "\n")
            sys.stderr.flush()
        if not ctx.confirm(f"upgrade {len(plan.to_upgrade)} member(s) to etcd {plan.target}?", args.yes):
            raise RefusedError("upgrade not confirmed; nothing changed")

        def said(step: MemberStep) -> None:
            sys.stderr.write(f"{step.name}: {step.from_version} -> {step.to_version}: {step.outcome} ({step.seconds:.1f}s)\n")
            sys.stderr.flush()

        report = run_upgrade(cfg, plan, client, step_timeout=args.timeout, health_timeout=args.timeout, on_step=said)
    lines = [f"backup before the upgrade: {report.backup}"]
    lines += [f"{s.name}: {s.from_version} -> {s.to_version} {s.outcome} in {s.seconds:.1f}s" for s in report.steps]
    lines.append(f"cluster {cfg.cluster.name} runs etcd {plan.target} ({report.seconds:.1f}s in all)")
    return Output({"executed": True, **report.to_json()}, "\n".join(lines))


def cmd_upgrade_member(args: argparse.Namespace, ctx: Context) -> Output:
    from ..cluster.upgrade import upgrade_member

    out = upgrade_member(ctx.config(), args.member, args.to, args.timeout)
    return Output(out, f"{out['member']}: {out['outcome']} ({out['version']})")
