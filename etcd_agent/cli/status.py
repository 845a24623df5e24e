"""`etcd-agent status`: one row per member; unreachable members are rows, not crashes."""
from __future__ import annotations

import argparse
from typing import Any

from ..errors import EXIT_FAILED, EXIT_OK
from .main import Context, Output


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="per-member status table (exit 1 when any member is unhealthy)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds per member (default 2)")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace, ctx: Context) -> Output:
    from ..status import cluster_status, format_table

    cfg = ctx.config()
    rows = cluster_status(cfg, timeout=args.timeout)
    healthy = all(r.healthy for r in rows)
    data = {"cluster": cfg.cluster.name, "healthy": healthy, "members": [r.to_json() for r in rows]}
    summary = f"cluster {cfg.cluster.name}: " + (
        "healthy" if healthy else f"{sum(1 for r in rows if not r.healthy)} of {len(rows)} members unhealthy"
    )
    return Output(data, format_table(rows) + "\n" + summary, EXIT_OK if healthy else EXIT_FAILED)
