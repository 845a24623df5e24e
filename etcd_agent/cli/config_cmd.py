"""`etcd-agent config sample | validate [PATH]`."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from etcd_agent.cli.main import Context, Output


def register(sub: Any) -> None:
    p = sub.add_parser("config", help="print a sample config or validate one")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    s = csub.add_parser("sample", help="print a commented sample config that validates")
    s.set_defaults(func=cmd_sample)
    v = csub.add_parser("validate", help="report every problem of a config (PATH, or - for stdin)")
    v.add_argument("path", nargs="?", help="config file (default: -c / /etc/etcd-agent/agent.toml)")
    v.set_defaults(func=cmd_validate)


def cmd_sample(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.config.sample import SAMPLE

    return Output({"sample": SAMPLE}, SAMPLE)


def cmd_validate(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.config import load, security_warnings
    from etcd_agent.config.load import MAX_CONFIG_BYTES, decode_config

    path = args.path or ctx.config_path
    if path == "-":
        # bounded like a file: `config validate - < /dev/zero` ends with one sentence
        text = decode_config(sys.stdin.buffer.read(MAX_CONFIG_BYTES + 1), "<stdin>")
        cfg = load("<stdin>", text=text)
    else:
        cfg = load(path)
    warnings = security_warnings(cfg)  # valid, so exit 0, but said
    text = f"{path}: valid ({len(cfg.members)} members, bootstrap {cfg.cluster.bootstrap}, service manager {cfg.etcd.service_manager})"
    text += "".join(f"\nwarning: {w}" for w in warnings)
    return Output({"path": path, "valid": True, "members": [m.name for m in cfg.members], "warnings": warnings}, text)
