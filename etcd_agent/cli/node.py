"""`etcd-agent node serve | receive`: the remote end of restore and upgrade (not for operators).

``serve`` speaks the node protocol on stdin/stdout for as long as its caller keeps the session
(see ``etcd_agent.node``); ``receive`` takes a snapshot on stdin into a member's restore work dir,
hashing and checking it as it writes. Both print only protocol documents on stdout; logs go to
stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

from etcd_agent.cli.main import Context, Output


def register(sub: Any) -> None:
    p = sub.add_parser("node", help="the remote end of restore and upgrade (run over SSH by them; not for operators)")
    nsub = p.add_subparsers(dest="node_step", metavar="STEP")
    nsub.required = True

    s = nsub.add_parser("serve", help="speak the node protocol on stdin/stdout until the caller closes the session")
    s.set_defaults(func=cmd_serve)

    r = nsub.add_parser("receive", help="write a restore's snapshot from stdin into a member's work dir "
                                          "(what, for whom and how encoded: the stream's first frame)")
    r.add_argument("--idle-timeout", required=True, type=float, metavar="SECONDS",
                   help="give up (and keep nothing) when no data arrives for this long")
    r.set_defaults(func=cmd_receive)


def cmd_serve(args: argparse.Namespace, ctx: Context) -> Optional[Output]:
    import logging
    import signal

    from etcd_agent.cli.nodesteps import handlers
    from etcd_agent.node.server import end_stuck_session, serve

    if ctx.verbose == 0:
        logging.getLogger("etcd_agent").setLevel(logging.INFO)  # the host's side of the story, on stderr
    stopped = {"why": ""}

    def on_signal(signum: int, _frame: object) -> None:  # only sets a flag; the session ends after its step
        stopped["why"] = f"signal {signal.Signals(signum).name}"

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    code = serve(ctx.config(), sys.stdin.buffer, sys.stdout.buffer, handlers(), stop=lambda: stopped["why"],
                 stuck=end_stuck_session)
    # leave at once: the reader thread may sit in a read of stdin that only the caller can end
    # (a silent, half-open connection), and closing stdin under it at exit would hang
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_receive(args: argparse.Namespace, ctx: Context) -> Output:
    """Prints one protocol line when ready for the data (or the error that refused it), and one
    when done: the receipt, or the error as AgentError.to_json. Nothing at all when the stream
    ended before its order (the receiver was not needed)."""
    import signal

    from etcd_agent.errors import AgentError, Interrupted, UsageError
    from etcd_agent.node.protocol import encode
    from etcd_agent.node.transfer import Ready
    from etcd_agent.restore.host.receive import receive_snapshot

    def say(doc: Any) -> None:
        try:
            sys.stdout.buffer.write(encode(doc))
            sys.stdout.buffer.flush()
        except OSError:
            pass  # the sender is gone; what it does next does not depend on this line

    def on_signal(signum: int, _frame: object) -> None:  # the temp file is removed on the way out
        raise Interrupted(f"receive ended by signal {signal.Signals(signum).name}; nothing kept")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        if not args.idle_timeout > 0:
            raise UsageError("--idle-timeout must be > 0")

        def ready(r: Ready) -> None:
            say(r.to_json())

        doc = receive_snapshot(ctx.config(), idle=args.idle_timeout, stdin_fd=sys.stdin.buffer.fileno(), ready=ready)
        if doc is None:
            return Output(None, None, exit_code=0, silent=True)
        code = 0
    except AgentError as exc:
        doc, code = exc.to_json(), exc.exit_code
        sys.stderr.write(f"etcd-agent: error: {exc.message}\n")
    say(doc)
    return Output(None, None, exit_code=code, silent=True)
