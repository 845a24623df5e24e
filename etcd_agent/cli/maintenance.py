"""`etcd-agent defrag`, `etcd-agent alarms`, `etcd-agent repair` and `etcd-agent promote`."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from etcd_agent.cli.main import Context, Output
from etcd_agent.errors import EXIT_FAILED, EXIT_OK, RefusedError


def register(sub: Any) -> None:
    p = sub.add_parser("defrag", help="defragment members over the fragmentation threshold, one at a time")
    p.add_argument("--dry-run", action="store_true", help="show each member's fragmentation and the decision")
    p.add_argument("--threshold", type=float, metavar="PCT", help="override [maintenance] defrag_threshold_percent")
    p.add_argument("--force", action="store_true", help="defragment every member regardless of the threshold")
    p.set_defaults(func=cmd_defrag)

    a = sub.add_parser("alarms", help="list etcd alarms; --disarm clears NOSPACE (compact, defrag, disarm)")
    a.add_argument("--disarm", action="store_true", help="clear a NOSPACE alarm")
    a.add_argument("--dry-run", action="store_true", help="with --disarm: print the steps only")
    a.add_argument("--yes", action="store_true", help="with --disarm: do not ask (compaction drops old revisions)")
    a.set_defaults(func=cmd_alarms)

    r = sub.add_parser("repair", help="fix safe drift (never-started zombie members, drifted etcd.conf); explain the rest")
    r.add_argument("--dry-run", action="store_true", help="print findings and fixes; change nothing")
    r.add_argument("--yes", action="store_true", help="do not ask")
    r.set_defaults(func=cmd_repair)

    q = sub.add_parser("promote", help="promote a learner to a voting member once it has caught up")
    q.add_argument("name", metavar="NAME", help="member name (or hex id)")
    q.add_argument("--wait", type=float, default=120.0, help="seconds to keep retrying while it catches up")
    q.set_defaults(func=cmd_promote)


def cmd_defrag(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cluster.maintenance import defrag
    from etcd_agent.cluster.status import human_size
    from etcd_agent.etcd.client import EtcdClient

    cfg = ctx.config()
    with EtcdClient.from_config(cfg) as client:
        items = defrag(cfg, client, dry_run=args.dry_run, threshold=args.threshold, force=args.force)
    lines = []
    for it in items:
        after = f" -> {human_size(it.size_after)} in {it.seconds:.2f}s" if it.size_after is not None else ""
        verb = ("would defragment" if args.dry_run else "defragmented") if it.defrag else "skip"
        lines.append(f"{it.name}{' (leader)' if it.leader else ''}: {human_size(it.db_size)} "
                     f"({it.fragmentation:.0%} fragmented): {verb}: {it.reason}{after}")
    if args.dry_run:
        lines.append("(dry run: nothing changed)")
    return Output({"members": [i.to_json() for i in items], "executed": not args.dry_run}, "\n".join(lines))


def cmd_alarms(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cluster.maintenance import AlarmReport, clear_nospace, list_alarms
    from etcd_agent.etcd.client import EtcdClient

    cfg = ctx.config()
    with EtcdClient.from_config(cfg) as client:
        if args.disarm and not args.dry_run:
            # compaction is destructive (history before the current revision is gone): show the plan, ask
            plan = clear_nospace(cfg, client, dry_run=True)
            if any(a["alarm"] == "NOSPACE" for a in plan.alarms):
                for step in plan.actions:
                    sys.stderr.write(f"  {step}\n")
                if not ctx.confirm("compact, defragment and disarm as above?", args.yes):
                    raise RefusedError("alarms --disarm not confirmed; nothing changed")
        rep = clear_nospace(cfg, client, dry_run=args.dry_run) if args.disarm else AlarmReport(list_alarms(cfg, client))
    lines = [f"{a['alarm']} on {a['member']} ({a['member_id']})" for a in rep.alarms] or ["no alarms"]
    lines += rep.actions
    code = EXIT_OK if (not rep.alarms or rep.cleared) else EXIT_FAILED
    return Output(rep.to_json(), "\n".join(lines), code)


def cmd_repair(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cluster.drift import execute_repair, find_drift, plan_repair

    cfg = ctx.config()
    findings = find_drift(cfg)
    plan = plan_repair(cfg, findings)
    lines = [f"{f.kind}: {f.detail}" for f in findings] or ["no drift found"]
    lines += [f"fix: {x.description}" for x in plan if x.safe] + [f"manual: {x.description}" for x in plan if not x.safe]
    fixes = [x for x in plan if x.safe]
    data = {"findings": [f.to_json() for f in findings], "fixes": [x.to_json() for x in plan]}
    if args.dry_run or not fixes:
        if args.dry_run:
            lines.append("(dry run: nothing changed)")
        return Output({**data, "executed": False}, "\n".join(lines), EXIT_OK)
    if not args.yes:
        sys.stderr.write("\n".join(lines) + "\n")
    if not ctx.confirm(f"apply {len(fixes)} fix(es)?", args.yes):
        raise RefusedError("repair not confirmed; nothing changed")
    done = execute_repair(cfg, fixes)
    lines += [f"done: {d}" for d in done]
    return Output({**data, "executed": True, "done": done}, "\n".join(lines))


def cmd_promote(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.etcd.client import EtcdClient
    from etcd_agent.member.learner import promote_when_ready

    cfg = ctx.config()
    with EtcdClient.from_config(cfg) as client:
        info = promote_when_ready(cfg, client, args.name, timeout=args.wait)
    return Output({"member_id": info.hex_id, "promoted": True}, f"{args.name} ({info.hex_id}) is a voting member")
