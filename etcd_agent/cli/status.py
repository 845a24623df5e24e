"""`etcd-agent status`: one row per member; unreachable members are rows, not crashes."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Dict, Optional

from etcd_agent.cli.main import Context, Output
from etcd_agent.errors import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.bucket.copier import CopyStatus
    from etcd_agent.config import Config


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="per-member status table (exit 1 when any member is unhealthy)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds per member (default 2)")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cluster.status import cluster_status, format_table

    cfg = ctx.config()
    rows = cluster_status(cfg, timeout=args.timeout)
    healthy = all(r.healthy for r in rows)
    last = _last_backup(cfg)
    from etcd_agent.state import markers

    restoring = markers.read_restores(cfg)  # this host's members with a restore in progress
    from etcd_agent.config import security_warnings

    warnings = security_warnings(cfg)
    from etcd_agent.backup.boundaries import load, unreadable_message

    problem = load(cfg.backup.dir).problem
    if problem:  # retention deletes nothing until it is fixed: the disk fills, and nothing else says so
        warnings = [*warnings, f"PRUNE HELD: {unreadable_message(problem)}"]
    from etcd_agent.pitr.workdirs import leftovers

    left = leftovers(cfg)  # a killed point-in-time restore's: the next other command removes them
    lock = _lock_holder(cfg)
    copies = _copies(cfg)
    data = {"cluster": cfg.cluster.name, "healthy": healthy, "members": [r.to_json() for r in rows], "last_backup": last,
            "restore_in_progress": [r.to_json() for r in restoring], "warnings": warnings, "leftovers": left,
            "operation_lock": lock, "copies": copies.to_json() if copies is not None else None}
    summary = f"cluster {cfg.cluster.name}: " + (
        "healthy" if healthy else f"{sum(1 for r in rows if not r.healthy)} of {len(rows)} members unhealthy"
    )
    if last is None:
        summary += f"\nlast backup: none in {cfg.backup.dir}"
    elif "error" in last:
        summary += f"\nlast backup: cannot read {cfg.backup.dir}: {last['error']}"
    else:
        summary += f"\nlast backup: {last['name']} ({_age(last['age_seconds'])} ago, revision {last['revision']})"
    if copies is not None:
        import time

        summary += "\n" + copies.describe(time.time())
    for rec in restoring:
        summary += (f"\nRESTORE IN PROGRESS: member {rec.member}: restore {rec.op} from {rec.backup} "
                    f"since {rec.started or '?'} (the daemon waits); {markers.restore_hint(rec)}")
    if lock is not None:
        summary += f"\noperation lock: held by {lock['holder']}" + (f". STALE: {lock['stale']}" if lock["stale"] else "")
    summary += "".join(f"\nwarning: {w}" for w in warnings)
    summary += "".join(f"\nLEFTOVER of a killed point-in-time restore: {x} (removed by the next etcd-agent command "
                       "other than status)" for x in left)
    return Output(data, format_table(rows) + "\n" + summary, EXIT_OK if healthy else EXIT_FAILED)


def _copies(cfg: "Config") -> "Optional[CopyStatus]":
    """The off-host copy queue as this host's daemon last reported it (None: remote copies off, or
    no report yet)."""
    if not cfg.backup.remote.enabled:
        return None
    from etcd_agent.bucket.copier import read_status

    return read_status(cfg)


def _lock_holder(cfg: "Config") -> Optional[Dict[str, str]]:
    """Who holds this host's operation lock (None: free, or unreadable here), and why it is stale."""
    from etcd_agent.state.locks import describe_holder, holder_of, stale_note

    try:
        rec = holder_of(cfg.backup.dir)
    except OSError:
        return None
    if rec is None:
        return None
    return {"holder": describe_holder(rec) or "another etcd-agent operation", "stale": stale_note(rec)}


def _last_backup(cfg: "Config") -> Optional[Dict[str, Any]]:
    """The newest complete backup in this host's backup dir, with its age."""
    import time

    from etcd_agent.backup.catalog import list_backups

    try:
        entries = [e for e in list_backups(cfg.backup.dir, utc=cfg.backup.utc) if e.complete]
    except OSError as exc:
        return {"error": exc.strerror or str(exc)}
    if not entries:
        return None
    e = entries[0]
    return {"name": e.name, "path": e.path, "revision": e.revision, "age_seconds": round(time.time() - e.time.timestamp())}


def _age(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600}h"
