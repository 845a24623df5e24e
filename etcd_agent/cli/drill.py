"""`etcd-agent drill [--from BACKUP] [--identity FILE]`: a restore drill now, on this host (see backup/drill.py).

Progress goes to stderr as it happens; what the drill proved (or why it failed), check by check,
goes to stdout. Exit 0 when it passed, 1 when it failed, 4 when another drill runs here.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from etcd_agent.cli.backup import IDENTITY_HELP
from etcd_agent.cli.main import Context, Output
from etcd_agent.errors import EXIT_FAILED, EXIT_OK

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "drill",
        help="restore a backup into a throwaway etcd on loopback and check it against the backup (a restore drill)",
    )
    p.add_argument("--from", dest="spec", default="latest", metavar="BACKUP",
                   help="a path, a file name in the backup dir, a date like 2019-08-07, or latest (default)")
    p.add_argument("--identity", metavar="FILE", help=IDENTITY_HELP + "; an encrypted backup cannot be drilled "
                                                                       "without it")
    p.set_defaults(func=cmd_drill)


def _progress(line: str) -> None:
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} drill: {line}\n")
    sys.stderr.flush()


def cmd_drill(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cli.backup import load_identity
    from etcd_agent.drill.run import run_drill
    from etcd_agent.drill.schedule import tell_cluster

    cfg = ctx.config()
    report = run_drill(cfg, args.spec, progress=_progress, identities=load_identity(args.identity))
    if not report.interrupted:
        why = tell_cluster(cfg, report)  # the daemons' schedule counts a drill by hand too
        if why:
            log.info("the drill is not recorded in etcd (%s): the daemons' schedule does not know of it", why)
    return Output(report.to_json(), "\n".join(report.lines()), EXIT_OK if report.ok else EXIT_FAILED)
