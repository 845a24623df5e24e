"""`etcd-agent render [--member NAME]`: print etcd.conf and etcd.service; writes nothing."""
from __future__ import annotations

import argparse
from typing import Any

from etcd_agent.cli.main import Context, Output


def register(sub: Any) -> None:
    p = sub.add_parser("render", help="print etcd.conf and etcd.service for a member (writes nothing)")
    p.add_argument("--member", help="member name (default: this machine's member)")
    p.add_argument(
        "--state",
        choices=("auto", "new", "existing"),
        default="auto",
        help="auto: static -> new with every member; incremental -> the seed is new, others join "
        "with the members before them (config order)",
    )
    p.set_defaults(func=cmd_render)


def cmd_render(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent import topology
    from etcd_agent.locality import local_member, machine_identity

    cfg = ctx.config()
    member = cfg.member(args.member) if args.member else local_member(cfg, machine_identity())
    if cfg.cluster.bootstrap == "static" and args.state in ("auto", "new"):
        boot = topology.static_bootstrap(cfg, member)
    else:
        walk = {b.member: b for b in topology.incremental_walk(cfg)}
        boot = walk[member.name]
        if args.state == "new":
            boot = topology.seed_bootstrap(cfg, member)
        elif args.state == "existing" and boot.state != topology.EXISTING:
            boot = topology.join_bootstrap(cfg, member, topology.member_pairs(cfg.members))
    conf = topology.render_conf(cfg, member, boot)
    from etcd_agent.member.local import LocalMember

    unit = LocalMember(cfg, member).unit_text()
    text = f"# ---- {cfg.conf_file(member.name)}\n{conf}\n# ---- {cfg.etcd.unit_file}\n{unit}"
    return Output(
        {"member": member.name, "conf_file": cfg.conf_file(member.name), "conf": conf, "unit_file": cfg.etcd.unit_file, "unit": unit},
        text,
    )
