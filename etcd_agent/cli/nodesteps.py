"""The table of steps ``etcd-agent node serve`` answers: composed here, at the top, from the rooms
that do the work - the restore's host half (``restore.host.steps``), the upgrade of one member,
a backup, and the session's lock. The node server (``node.server``) is handed this table and
imports none of them, so the node protocol stays below every room that uses it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from etcd_agent.node.protocol import Args, StepArgs
from etcd_agent.node.replies import BackupReply, ReleaseReply
from etcd_agent.node.server import Handler, NodeContext
from etcd_agent.typedjson import Document


@dataclass(frozen=True)
class UpgradeArgs(StepArgs):
    member: str
    to: str  # the version to run
    timeout: float = 120.0  # for the member to serve again, unless serve_seconds says
    # what the operator gave (`upgrade --timeout`): `timeout` above is taken by NodeClient.ask as
    # its own wait for the reply, so it never reached the host, which waited its default 120 s
    serve_seconds: Optional[float] = None


@dataclass(frozen=True)
class ReleaseArgs(StepArgs):
    version: str


@dataclass(frozen=True)
class BackupArgs(StepArgs):
    member: Optional[str] = None  # the member to back up (None: the one the config picks)


def upgrade_member(ctx: NodeContext, args: Args) -> Document:
    from etcd_agent.member.upgrade import upgrade_member as step

    ctx.require_lock("upgrade-member")
    a = args.read(UpgradeArgs)
    return step(ctx.cfg, a.member, a.to, a.serve_seconds if a.serve_seconds is not None else a.timeout)


def release_version(ctx: NodeContext, args: Args) -> Document:
    from etcd_agent.member.upgrade import release_versions

    got = release_versions(ctx.cfg, args.read(ReleaseArgs).version)
    return ReleaseReply(got.get("binary"), got.get("etcdctl"), got.get("etcdutl"))


def backup(ctx: NodeContext, args: Args) -> Document:
    """A verified backup written here, under the lock this session already holds."""
    from etcd_agent.backup.service import take_backup
    from etcd_agent.bucket.copier import off_host

    ctx.require_lock("backup")
    b = take_backup(ctx.cfg, member=args.read(BackupArgs).member, full_verify=True, prune=False, hold_lock=False,
                    off_host=off_host(ctx.cfg))
    return BackupReply.from_json(b.to_json(), "node backup")  # BackupResult.to_json is the one shape


def lock(ctx: NodeContext, args: Args) -> Document:
    return ctx.take_lock()


def handlers() -> Dict[str, Handler]:
    from etcd_agent.restore.host.steps import handlers as restore_handlers

    table: Dict[str, Handler] = {"lock": lock, "upgrade-member": upgrade_member, "release-version": release_version,
                                 "backup": backup}
    table.update(restore_handlers())
    return table
