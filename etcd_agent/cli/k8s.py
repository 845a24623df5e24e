"""`etcd-agent k8s cleanup [--dry-run] [--yes]`: remove what Kubernetes keeps in etcd that is stale.

What a restore runs by itself before the apiservers start again, on request: the masterleases of
addresses that are no masters now, and (with ``[kubernetes] drop_leader_leases``) the
controller-manager and scheduler leader leases. Every key it would delete is listed first.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from etcd_agent.cli.main import Context, Output
from etcd_agent.errors import RefusedError


def register(sub: Any) -> None:
    p = sub.add_parser("k8s", help="Kubernetes state in etcd: cleanup of what a restore leaves stale")
    ksub = p.add_subparsers(dest="k8s_command", metavar="ACTION")
    ksub.required = True
    c = ksub.add_parser("cleanup", help="delete stale masterleases (and, if configured, leader leases)")
    c.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")
    c.add_argument("--yes", action="store_true", help="do not ask")
    c.set_defaults(func=cmd_cleanup)


def cmd_cleanup(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cluster.kubernetes import cleanup
    from etcd_agent.etcd.client import EtcdClient

    cfg = ctx.config()
    with EtcdClient.from_config(cfg, timeout=5.0) as client:
        plan = cleanup(cfg, client, dry_run=True)
        if args.dry_run or not plan.delete:
            text = "\n".join(plan.lines(True)) or "nothing to clean up"
            return Output({"dry_run": True, **plan.to_json()}, text + ("\n(dry run: nothing deleted)" if args.dry_run else ""))
        if not args.yes:
            sys.stderr.write("\n".join(plan.lines(True)) + "\n")
        if not ctx.confirm(f"delete these {len(plan.delete)} key(s)?", args.yes):
            raise RefusedError("cleanup not confirmed; nothing deleted")
        done = cleanup(cfg, client, dry_run=False)
    return Output({"dry_run": False, **done.to_json()}, "\n".join(done.lines(False)))
