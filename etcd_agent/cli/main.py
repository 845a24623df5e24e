"""Entry point: the argparse tree, output, and the one place errors become exit codes.

Each command group lives in its own module under ``etcd_agent.cli`` exposing
``register(subparsers)``; a handler takes ``(args, ctx)`` and returns an ``Output`` (or None).
Handlers never print results themselves and never call ``sys.exit``.

``main`` runs every command under umask 0077. Everything the agent creates already gets an
explicit mode (``etcd_agent.fs``); the umask is defence in depth for what its children create,
which inherit it: etcd under the process backend, ``etcd-agent node`` steps, and `snapshot
restore` (etcdctl 3.4 writes the restored .snap file 0666 & ~umask: world-writable under umask
000). The caller's umask is put back when ``main`` returns (tests call it in-process).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

from etcd_agent import __version__
from etcd_agent.errors import EXIT_OK, AgentError, Interrupted, UsageError

if TYPE_CHECKING:  # the config package is imported on first use: `--help` stays fast
    from etcd_agent.config import Config

log = logging.getLogger("etcd_agent")

# gRPC's fork handlers run in every child forked while its channels are busy and can abort it
# before it execs (grpc/grpc#43055; delta/rpc.py): the daemon's restore drill starts etcd from
# a thread while other threads talk to etcd, and was seen to die so (SIGSEGV, "Check failure").
# The agent forks only to exec. Read when grpc initialises, which is after this (lazy imports).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# Command-group modules, in the order --help lists them. Importing them must stay cheap:
# gRPC/etcd3 and paramiko are imported inside the handlers that need them.
COMMAND_MODULES: List[str] = [
    "config_cmd",
    "render",
    "demo",
    "status",
    "run",
    "backup",
    "drill",
    "member",
    "upgrade",
    "maintenance",
    "restore",
    "k8s",
    "node",
]


@dataclass
class Output:
    """What a command returns: JSON data and a human rendering of it."""

    data: Any
    text: Optional[str] = None
    exit_code: int = EXIT_OK
    silent: bool = False  # the command wrote its own output (the node protocol): print nothing


@dataclass
class Context:
    """What every handler gets besides its own arguments."""

    config_path: str
    json: bool
    verbose: int
    _config: "Optional[Config]" = field(default=None, repr=False)

    def config(self) -> "Config":
        """The validated config (loaded once, on first use)."""
        if self._config is None:
            from etcd_agent.config import load

            self._config = load(self.config_path)
        return self._config

    def confirm(self, question: str, assume_yes: bool) -> bool:
        """Ask on the terminal unless --yes; with no terminal, refuse rather than guess."""
        if assume_yes:
            return True
        if not sys.stdin.isatty():
            raise UsageError(f"{question} - no terminal to ask on; pass --yes to proceed")
        sys.stderr.write(f"{question} [y/N] ")
        sys.stderr.flush()
        answer = sys.stdin.readline().strip().lower()
        return answer in ("y", "yes")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> "None":  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    from etcd_agent.config import DEFAULT_PATH

    p = _Parser(
        prog="etcd-agent",
        description="Manage the etcd members of Kubernetes masters: bootstrap, heal, scale, back up, restore.",
    )
    p.add_argument("-c", "--config", default=DEFAULT_PATH, help=f"config file (default {DEFAULT_PATH})")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output on stderr")
    p.add_argument("--version", action="version", version=f"etcd-agent {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"etcd_agent.cli.{name}").register(sub)
    return p


def setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("etcd_agent")
    root.handlers[:] = [handler]
    root.setLevel(level)


def emit(out: Output, as_json: bool) -> None:
    if out.silent:
        return
    if as_json:
        json.dump(out.data, sys.stdout, indent=2, sort_keys=True, default=str)
        sys.stdout.write("\n")
    elif out.text is not None:
        sys.stdout.write(out.text if out.text.endswith("\n") or not out.text else out.text + "\n")
    sys.stdout.flush()


# Files and dirs created by anything this process runs: private unless given a mode on purpose.
UMASK = 0o077


def main(argv: Optional[Sequence[str]] = None) -> int:
    # gRPC's fork handlers can abort a forked child before it execs while channels are busy
    # (grpc/grpc#43055; the daemon's watch and a backup's etcdutl run at once); the agent forks
    # only to exec. Read when grpc initialises, which is after this (grpc is imported lazily).
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    old_umask = os.umask(UMASK)
    try:
        return _main(argv)
    finally:
        os.umask(old_umask)


def _main(argv: Optional[Sequence[str]]) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args_list
    try:
        parser = build_parser()
        args = parser.parse_args(args_list)
        setup_logging(args.verbose)
        ctx = Context(config_path=args.config, json=args.json, verbose=args.verbose)
        # status reports them; every other command cleans them, but an orchestrator's own helpers
        # (`node serve`/`node receive`, started while its replay may run): one orphaned by a killed
        # restore would otherwise sweep them behind the operator's `status`
        if args.command not in ("status", "node"):
            _clean_leftovers(ctx)
        handler: Callable[[argparse.Namespace, Context], Optional[Output]] = args.func
        out = handler(args, ctx)
        if out is not None:
            emit(out, args.json)
            return out.exit_code
        return EXIT_OK
    except KeyboardInterrupt:
        return _fail(Interrupted("interrupted"), as_json)
    except AgentError as exc:
        return _fail(exc, as_json)
    except BrokenPipeError:
        return EXIT_OK


def _clean_leftovers(ctx: Context) -> None:
    """What a killed point-in-time restore left on this host (its throwaway etcd still running, its
    plaintext): removed before this command's own work. Never fails the command: without a
    readable config or the rights to clean, the command goes on as it would have."""
    try:
        cfg = ctx.config()
    except (AgentError, OSError):
        return
    from etcd_agent.pitr.workdirs import clean

    try:
        clean(cfg)
    except (AgentError, OSError) as exc:
        logging.getLogger(__name__).info("could not clean what a killed point-in-time restore left: %s", exc)


def _fail(exc: AgentError, as_json: bool) -> int:
    if as_json:
        json.dump(exc.to_json(), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    sys.stderr.write(f"etcd-agent: error: {exc.message}\n")
    for d in exc.details:
        sys.stderr.write(f"  - {d}\n")
    return exc.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
