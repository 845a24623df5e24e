"""`etcd-agent backup` and `backup list | verify FILE | prune [--dry-run]`."""
from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from ..errors import EXIT_FAILED, EXIT_OK, UsageError
from .main import Context, Output

if TYPE_CHECKING:  # pragma: no cover
    from ..config import Config

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p = sub.add_parser("backup", help="take a backup now (or: backup list | verify FILE | prune)")
    p.add_argument("--member", metavar="NAME", help="snapshot this member's etcd (default: the local member)")
    p.add_argument(
        "--verify", action="store_true",
        help="also run the full verify (extract + snapshot status) before the backup counts",
    )
    p.add_argument("--no-prune", action="store_true", help="do not apply the retention policy afterwards")
    p.set_defaults(func=cmd_backup)
    bsub = p.add_subparsers(dest="backup_command", metavar="SUBCOMMAND")

    pl = bsub.add_parser("list", help="backups in the backup dir, newest first")
    pl.add_argument("--remote", action="store_true", help="list the off-host copies ([backup.remote]) instead")
    pl.set_defaults(func=cmd_list)

    pv = bsub.add_parser("verify", help="check an archive: manifest, every sha256, snapshot status, cluster id")
    pv.add_argument("file", metavar="FILE", help="a path, a file name in the backup dir, a date prefix, or latest")
    pv.add_argument("--cluster-id", metavar="HEX", help="expected cluster id (default: ask the configured etcd)")
    pv.add_argument("--no-status", action="store_true", help="skip `snapshot status` (no extraction)")
    pv.set_defaults(func=cmd_verify)

    pp = bsub.add_parser("prune", help="apply the retention policy; every decision is printed with its reason")
    pp.add_argument("--dry-run", action="store_true", help="decide and print, delete nothing")
    pp.add_argument("--remote", action="store_true", help="apply the remote retention to the off-host copies instead")
    pp.set_defaults(func=cmd_prune)


def cmd_backup(args: argparse.Namespace, ctx: Context) -> Output:
    from ..backup.service import take_backup
    from ..config import security_warnings

    cfg = ctx.config()
    for w in security_warnings(cfg):  # cron mails / syslogs stderr
        log.warning("%s", w)
    res = take_backup(cfg, member=args.member, full_verify=args.verify, prune=not args.no_prune)
    text = res.path
    for w in res.warnings:
        log.warning("%s", w)
    return Output(res.to_json(), text)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def cmd_list(args: argparse.Namespace, ctx: Context) -> Output:
    from ..backup.catalog import list_backups

    cfg = ctx.config()
    if args.remote:
        return _list_remote(cfg)
    entries = list_backups(cfg.backup.dir, utc=cfg.backup.utc)
    rows: List[str] = [f"{'NAME':<32} {'TIME':<25} {'SIZE':>10} {'REVISION':>10}  VERIFIED"]
    for e in entries:
        verified = "yes" if e.verified else ("INCOMPLETE: " + (e.problem or "") if not e.complete else "no")
        rows.append(
            f"{e.name:<32} {e.time.isoformat():<25} {_size(e.size):>10} {str(e.revision or '-'):>10}  {verified}"
        )
    if not entries:
        rows.append(f"(no backups in {cfg.backup.dir})")
    return Output({"dir": cfg.backup.dir, "backups": [e.to_json() for e in entries]}, "\n".join(rows))


def _require_remote(cfg: "Config") -> None:
    if not cfg.backup.remote.enabled:
        raise UsageError("no off-host copies configured: set [backup.remote] enabled = true")


def _list_remote(cfg: "Config") -> Output:
    from ..backup.remote import list_remote

    _require_remote(cfg)
    objs = list_remote(cfg)
    rows = [f"{'NAME':<32} {'TIME':<25} {'SIZE':>10}  SHA256"]
    for o in objs:
        rows.append(f"{o.name:<32} {o.time.isoformat():<25} {_size(o.size):>10}  {(o.sha256 or '-')[:16]}")
    if not objs:
        rows.append("(no off-host copies)")
    return Output({"remote": True, "backups": [o.to_json() for o in objs]}, "\n".join(rows))


def _expected_cluster(ctx: Context, given: Optional[str]) -> Tuple[Optional[str], List[str]]:
    """The cluster id a backup must carry (--cluster-id, else the running cluster's) and the ids
    this cluster had before restores (its lineage)."""
    if given:
        return given.lower(), []
    from ..cluster.lineage import current_cluster

    return current_cluster(ctx.config())


def cmd_verify(args: argparse.Namespace, ctx: Context) -> Output:
    from ..backup.catalog import resolve
    from ..backup.verify import verify
    from ..etcd.tools import snapshot_status
    from ..hosts.local import LocalHost

    cfg = ctx.config()
    path = args.file
    if not os.path.isfile(path):
        candidate = os.path.join(cfg.backup.dir, path)
        path = candidate if os.path.isfile(candidate) else resolve(cfg.backup.dir, path, utc=cfg.backup.utc).path
    expect, lineage = _expected_cluster(ctx, args.cluster_id)
    host = LocalHost()
    report = verify(
        path,
        status_fn=None if args.no_status else (lambda p: snapshot_status(host, cfg, p)),
        expect_cluster_id=expect,
        lineage=lineage,
    )
    if expect is None:
        report.checked.append("cluster id not checked: no --cluster-id and no configured etcd answered")
    lines = [f"{path}: {'OK' if report.ok else 'FAILED'}"]
    lines += [f"  ok: {c}" for c in report.checked]
    lines += [f"  PROBLEM: {p}" for p in report.problems]
    return Output(report.to_json(), "\n".join(lines), EXIT_OK if report.ok else EXIT_FAILED)


def cmd_prune(args: argparse.Namespace, ctx: Context) -> Output:
    from ..backup.service import prune_locked

    cfg = ctx.config()
    if args.remote:
        from ..backup.remote import prune_remote

        _require_remote(cfg)
        decisions = prune_remote(cfg, dry_run=args.dry_run)
    else:
        decisions = prune_locked(cfg, dry_run=args.dry_run)
    lines = []
    for d in decisions:
        verb = "keep  " if d.keep else ("would delete" if args.dry_run else "delete")
        lines.append(f"{verb:<12} {d.name}: {d.reason}")
    if not decisions:
        lines.append("(no backups)")
    data = {
        "dry_run": args.dry_run,
        "decisions": [{"name": d.name, "keep": d.keep, "reasons": list(d.reasons)} for d in decisions],
    }
    return Output(data, "\n".join(lines))
