"""`etcd-agent demo`: a one-host N-member cluster on 127.0.0.1, until Ctrl-C."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any, Optional

from etcd_agent.cli.main import Context, Output
from etcd_agent.errors import Interrupted


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="run a one-host demo cluster on 127.0.0.1 until Ctrl-C")
    p.add_argument("--members", type=int, default=3, help="number of members, 1-6 (default 3)")
    p.add_argument("--dir", default="etcd-agent-demo", help="where config, data and backups go (default ./etcd-agent-demo)")
    p.add_argument("--etcd", default=shutil.which("etcd") or "/usr/bin/etcd", help="etcd binary")
    p.add_argument("--etcdctl", default=shutil.which("etcdctl") or "/usr/bin/etcdctl", help="etcdctl binary")
    p.add_argument("--etcdutl", default=None,
                   help="etcdutl binary (etcd >= 3.5; point-in-time restores replay with it); default: the one "
                        "beside --etcd, else on PATH, else none")
    p.add_argument("--exit-when-healthy", action="store_true", help="stop the cluster once healthy (smoke test)")
    p.set_defaults(func=cmd_demo)


def _say(msg: str) -> None:
    sys.stderr.write(f"demo: {msg}\n")
    sys.stderr.flush()


def _etcdutl_for(etcd: str) -> Optional[str]:
    """The etcdutl of the same release as ``etcd`` (a versions_dir layout keeps them side by side),
    else the one on PATH; None where there is none (etcd 3.4 has none)."""
    beside = os.path.join(os.path.dirname(os.path.abspath(etcd)), "etcdutl")
    return beside if os.access(beside, os.X_OK) else shutil.which("etcdutl")


def cmd_demo(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.memory import limit_arenas

    limit_arenas()  # a long-running process like the daemon (docs in daemon/memory.py)
    from etcd_agent.cluster.demo import Demo, install_signal_handlers
    from etcd_agent.cluster.status import cluster_status, format_table

    demo = Demo(args.dir, args.members, args.etcd, args.etcdctl, args.etcdutl or _etcdutl_for(args.etcd))
    install_signal_handlers(demo)
    resumed = demo.prepare()
    assert demo.cfg is not None
    seconds = None
    try:
        seconds = demo.bootstrap(_say)
        rows = cluster_status(demo.cfg)
        if not ctx.json:
            # the table is the result; print it now: the command then runs until Ctrl-C
            sys.stdout.write(format_table(rows) + "\n")
            sys.stdout.write(
                f"{len(rows)} members healthy in {seconds:.1f}s "
                f"({'resumed from their data' if resumed else 'incremental bootstrap'}).\n"
                f"Try: etcd-agent -c {demo.config_path} status   |   Ctrl-C stops the cluster.\n"
            )
            sys.stdout.flush()
        if not args.exit_when_healthy:
            demo.start_continuous_backup()
            demo.supervise(_say)
    except (KeyboardInterrupt, Interrupted):
        _say("stopping every member")
    finally:
        t = time.monotonic()
        demo.stop_all()
        _say(f"all members stopped in {time.monotonic() - t:.1f}s")
    return Output(
        {
            "config": demo.config_path,
            "members": [m.name for m in demo.cfg.members],
            "seconds_to_healthy": None if seconds is None else round(seconds, 2),
        },
        None,
    )
