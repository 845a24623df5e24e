"""`etcd-agent run`: the daemon (ExecStart of etcd-agent.service)."""
from __future__ import annotations

import argparse
from typing import Any, Optional

from etcd_agent.cli.main import Context, Output


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="the daemon: converge this host's member, heal it, keep it in the cluster")
    p.add_argument("--member", help="which member this process manages (default: [local] name / this machine)")
    p.add_argument("--once", action="store_true", help="one cycle: observe, decide, act, print the decision")
    p.add_argument("--interval", type=float, help="seconds between cycles (default: [daemon] interval)")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace, ctx: Context) -> Optional[Output]:
    import dataclasses

    from etcd_agent.memory import limit_arenas

    limit_arenas()  # before any thread starts (docs in daemon/memory.py)
    from etcd_agent.daemon.loop import Daemon

    if ctx.verbose == 0:
        # a daemon's one sentence per cycle is its product: INFO by default
        import logging

        logging.getLogger("etcd_agent").setLevel(logging.INFO)
    cfg = ctx.config()
    if args.interval is not None:
        cfg = dataclasses.replace(cfg, daemon=dataclasses.replace(cfg.daemon, interval=args.interval))
    daemon = Daemon(ctx.config_path, member=args.member, cfg=cfg)
    if args.once:
        report = daemon.cycle()
        return Output(
            {"member": report.observation.member, "observation": dataclasses.asdict(report.observation),
             "action": report.decision.action, "reason": report.decision.reason, "outcome": report.outcome},
            report.sentence(),
        )
    daemon.install_signal_handlers()
    daemon.run()
    return None
