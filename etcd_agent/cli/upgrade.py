"""`etcd-agent upgrade --to VERSION [--via V,...]`: a rolling upgrade of the whole cluster.

The plan (every hop, every member in order) is printed before anything changes; without
``--yes`` the operator is asked. A refused skew (a downgrade, a jump that needs an intermediate
release nobody chose) is exit 3 with the path; a member that fails on the new release is rolled
back and the run stops with exit 1, naming the release every member is on.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Tuple

from etcd_agent.cli.main import Context, Output
from etcd_agent.errors import RefusedError, UsageError


def register(sub: Any) -> None:
    p = sub.add_parser("upgrade", help="rolling etcd upgrade across one or more releases (skew rules enforced)")
    p.add_argument("--to", required=True, metavar="VERSION", help="target etcd version, installed in [etcd] versions_dir")
    p.add_argument("--via", default="", metavar="V1,V2",
                   help="releases to pass through on the way (comma-separated, ascending; each installed everywhere)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and run the pre-checks; change nothing")
    p.add_argument("--yes", action="store_true", help="do not ask")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a member may take to be healthy (default 120)")
    p.set_defaults(func=cmd_upgrade)


def _via(text: str) -> Tuple[str, ...]:
    parts = tuple(v.strip() for v in text.split(",") if v.strip())
    if text and not parts:
        raise UsageError("--via needs versions, e.g. --via 3.5.16")
    return parts


def _say(line: str) -> None:
    sys.stderr.write(f"upgrade: {line}\n")
    sys.stderr.flush()


def cmd_upgrade(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cluster.upgrade import MemberStep, check_releases, plan_upgrade, run_upgrade
    from etcd_agent.etcd.client import EtcdClient

    cfg = ctx.config()
    with EtcdClient.from_config(cfg, timeout=5.0) as client:
        plan = plan_upgrade(cfg, args.to, client, _via(args.via))
        if args.dry_run:
            if plan.hops:
                check_releases(cfg, plan, _say)
            return Output({"plan": plan.to_json(), "executed": False}, plan.text() + "\n(dry run: nothing changed)")
        if not plan.hops:
            return Output({"plan": plan.to_json(), "executed": False}, plan.text())
        if not args.yes:
            sys.stderr.write(plan.text() + "\n")
            sys.stderr.flush()
        n = len(plan.to_upgrade)
        if not ctx.confirm(f"upgrade {n} member(s) to etcd {plan.target} ({len(plan.hops)} hop(s))?", args.yes):
            raise RefusedError("upgrade not confirmed; nothing changed")

        def said(step: MemberStep) -> None:
            _say(f"{step.name}: {step.from_version} -> {step.to_version}: {step.outcome} ({step.seconds:.1f}s)")

        report = run_upgrade(cfg, plan, client, step_timeout=args.timeout, health_timeout=args.timeout, say=_say,
                             on_step=said)
    lines = []
    for h in plan.hops:
        lines.append(f"hop {h.from_version} -> {h.to_version} in {h.seconds:.1f}s (backup {h.backup})")
        lines += [f"  {s.name}: {s.outcome} in {s.seconds:.1f}s" for s in h.steps]
    lines.append(f"cluster {cfg.cluster.name} runs etcd {plan.target} ({report.seconds:.1f}s in all)")
    return Output({"executed": True, **report.to_json()}, "\n".join(lines))
