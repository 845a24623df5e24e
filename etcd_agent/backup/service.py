"""The backup operation: lock, pre-check, stream, check, publish, prune, report.

Used by ``etcd-agent backup`` (cron / systemd timer) and by risky operations (restore, leave,
upgrade) that take a backup first.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional, Tuple

from .. import __version__
from ..config import Config, Member
from ..errors import AgentError, BackupCorrupt, BackupError, BusyError, EtcdUnavailable, RefusedError
from ..fs import ensure_private_dir
from ..locality import local_member
from ..state.locks import OperationLock, lock_path_for
from . import archive, catalog, retention
from .verify import verify

log = logging.getLogger(__name__)


@dataclass
class BackupResult:
    path: str
    size: int
    revision: Optional[int]
    sha256: str  # of etcd_snapshot.db, as in the manifest (restore checks this one)
    duration: float
    member: str
    pruned: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "revision": self.revision,
            "sha256": self.sha256,
            "duration": round(self.duration, 3),
            "member": self.member,
            "pruned": self.pruned,
            "warnings": self.warnings,
        }


def pick_member(cfg: Config, name: Optional[str]) -> Member:
    """The member to snapshot: the one named, else this machine's own."""
    if name is not None:
        return cfg.member(name)
    from ..locality import machine_identity

    return local_member(cfg, machine_identity())


def required_space(db_size: int, compression: str, margin: float) -> int:
    """Free bytes needed before writing: the archive is at most the db (+ headers); compressed
    output also spools the raw snapshot first, so both exist at once for a moment."""
    expected = db_size + 64 * 1024
    if compression != "none":
        expected *= 2
    return int(expected * (1.0 + margin))


def take_backup(
    cfg: Config,
    *,
    member: Optional[str] = None,
    check_space: bool = True,
    full_verify: bool = False,
    prune: bool = True,
    hold_lock: bool = True,
) -> BackupResult:
    """Take one backup of ``member``'s etcd (default: the local member) into ``cfg.backup.dir``.
    ``hold_lock=False``: the caller already holds this host's operation lock (a node session)."""
    start = time.monotonic()
    try:
        result = _take(cfg, member, check_space, full_verify, prune, start, hold_lock)
    except BusyError:
        raise  # another run is working: not a failed backup
    except AgentError:
        _record_metrics(cfg, False, None, 0, time.monotonic() - start, None)
        raise
    remote_cfg = cfg.backup.remote
    if not remote_cfg.enabled:
        _record_metrics(cfg, True, result.path, result.size, result.duration, result.revision)
        return result
    from . import remote  # imported only when [backup.remote] is enabled

    try:
        remote.upload_and_verify(cfg, result.path, archive.read_manifest(result.path))
    except AgentError as exc:
        # the local backup stands; the run still fails so cron / the timer reports it
        _record_metrics(cfg, True, result.path, result.size, result.duration, result.revision, remote_ok=False)
        raise BackupError(
            f"backup {result.path} written, but the off-host copy failed: {exc.message}", details=exc.details
        ) from exc
    _record_metrics(cfg, True, result.path, result.size, result.duration, result.revision, remote_ok=True)
    if prune:
        try:
            result.pruned += [f"remote:{d.name}" for d in remote.prune_remote(cfg, dry_run=False) if not d.keep]
        except AgentError as exc:
            result.warnings.append(f"remote prune failed: {exc.message}")
            log.warning("remote prune after backup failed: %s", exc.message)
    return result


def _take(
    cfg: Config, member_name: Optional[str], check_space: bool, full_verify: bool, prune: bool, start: float,
    hold_lock: bool = True,
) -> BackupResult:
    from ..etcd.client import EtcdClient
    from ..etcd.tools import snapshot_status
    from ..hosts.local import LocalHost

    directory = cfg.backup.dir
    ensure_private_dir(directory)
    m = pick_member(cfg, member_name)
    with OperationLock(lock_path_for(directory), "backup") if hold_lock else contextlib.nullcontext():
        archive.remove_partials(directory)
        client = EtcdClient.from_config(cfg, endpoints=[m.client_url], timeout=10.0)
        try:
            # a linearizable read through this member first: it then has applied everything
            # committed before the backup began, so the snapshot holds every acknowledged write
            ok, why = client.healthy(m.client_url)
            if not ok:
                raise EtcdUnavailable(f"member {m.name} ({m.client_url}) is not healthy ({why}); not backing up from "
                                      "it: its snapshot could miss acknowledged writes")
            st = client.status(m.client_url)
            members = client.members(m.client_url)
            comp = cfg.backup.compression
            if check_space:
                need = required_space(st.db_size, comp, cfg.backup.space_margin)
                free = shutil.disk_usage(directory).free
                if free < need:
                    raise RefusedError(
                        f"not enough space in {directory}: {free} bytes free, a backup of the "
                        f"{st.db_size}-byte db needs {need} (db + {cfg.backup.space_margin:.0%} margin"
                        f"{', x2 while compressing' if comp != 'none' else ''}); nothing written"
                    )
            when, name = _free_name(directory, cfg.backup.utc, comp)
            files, missing = _local_files(cfg, m.name)
            host = LocalHost()

            def build(infos: Dict[str, archive.FileInfo], facts: Any, revision: Optional[int], status: Optional[Dict[str, Any]]) -> Dict[str, Any]:
                checks = ["etcd sha256 trailer", "bbolt meta pages", "size = pages x page size"]
                if status is not None:
                    checks.append("snapshot status")
                return {
                    "format": archive.FORMAT,
                    "format_version": archive.FORMAT_VERSION,
                    "name": name,
                    "created": when.isoformat(),
                    "created_unix": int(when.timestamp()),
                    "host": socket.gethostname(),
                    "member": m.name,
                    "endpoint": m.client_url,
                    "member_id": f"{st.member_id:x}",
                    "cluster": {"name": cfg.cluster.name, "id": f"{st.cluster_id:x}"},
                    "members": [
                        {
                            "id": f"{x.id:x}",
                            "name": x.name,
                            "peer_urls": list(x.peer_urls),
                            "client_urls": list(x.client_urls),
                            "is_learner": x.is_learner,
                        }
                        for x in members
                    ],
                    # as `snapshot status` counts it: the newest revision in the key bucket, 0
                    # when the snapshot holds no key (a fresh or fully compacted-away keyspace)
                    "revision": revision if revision is not None else (status or {}).get("revision", 0),
                    # the member's store revision when the snapshot began (header of Status)
                    "store_revision": st.revision,
                    "etcd_version": st.version,
                    "agent_version": __version__,
                    "db_size": st.db_size,
                    "compression": comp,
                    "files": {n: {"size": i.size, "sha256": i.sha256} for n, i in infos.items()},
                    "missing": missing,
                    "snapshot": {
                        "page_size": facts.page_size,
                        "pages": facts.high_water,
                        "txid": facts.txid,
                        "checks": checks,
                        "status": status,
                    },
                    "verified": True,
                }

            log.info("backing up member %s (%s, db %d bytes) to %s", m.name, m.client_url, st.db_size, name)
            written = archive.write_archive(
                directory,
                name,
                chunks=client.snapshot_chunks(m.client_url),
                files=files,
                build_manifest=build,
                mtime=int(when.timestamp()),
                status_of_file=(lambda p: snapshot_status(host, cfg, p)) if comp != "none" else None,
            )
        finally:
            client.close()
        if full_verify:
            rep = verify(written.path, status_fn=lambda p: snapshot_status(host, cfg, p), tmp_parent=directory)
            if not rep.ok:
                os.unlink(written.path)  # a backup that fails its check must not count
                raise BackupCorrupt(f"backup {written.path} failed verification; removed", details=rep.problems)
        duration = time.monotonic() - start
        log.info("backup %s: %d bytes, revision %s, %.2fs", written.path, written.size, written.revision, duration)
        result = BackupResult(
            written.path, written.size, written.manifest.get("revision"), written.facts.sha256, duration, m.name
        )
        if prune:  # still under the lock: prune never races another run
            try:
                result.pruned = [d.name for d in prune_backups(cfg, dry_run=False) if not d.keep]
            except (AgentError, OSError) as exc:
                result.warnings.append(f"prune failed: {exc}")
                log.warning("prune after backup failed: %s", exc)
    return result


def _free_name(directory: str, utc: bool, compression: str) -> Tuple[datetime, str]:
    """A timestamp whose name no backup uses yet (waits for the next second if needed)."""
    for _ in range(3):
        when = archive.now(utc)
        stem = archive.archive_name(when, "none")
        if not any(os.path.exists(os.path.join(directory, stem[: -len(".tar")] + ext)) for ext in archive.EXTENSIONS.values()):
            return when, archive.archive_name(when, compression)
        time.sleep(1.0 - (time.time() % 1.0) + 0.01)
    raise BackupError(f"cannot find a free backup name in {directory}")


def _local_files(cfg: Config, member: str) -> Tuple[Dict[str, bytes], Dict[str, str]]:
    """etcd.conf and etcd.service as found on disk; what is missing is recorded, not fatal."""
    files: Dict[str, bytes] = {}
    missing: Dict[str, str] = {}
    for arc, path in ((archive.CONF, cfg.conf_file(member)), (archive.UNIT, cfg.etcd.unit_file)):
        try:
            with open(path, "rb") as fh:
                files[arc] = fh.read(1 << 20)
        except FileNotFoundError:
            missing[arc] = f"{path} not found"
            log.warning("%s not found; the backup records it as missing", path)
        except OSError as exc:
            missing[arc] = f"{path} unreadable: {exc.strerror or exc}"
            log.warning("cannot read %s: %s", path, exc)
    return files, missing


def prune_backups(cfg: Config, *, dry_run: bool) -> List[retention.Decision]:
    """Apply the retention policy to the backup dir; returns every decision (newest first)."""
    directory = cfg.backup.dir
    entries = catalog.list_backups(directory, utc=cfg.backup.utc)
    decisions = retention.plan(
        [retention.BackupRef(e.name, e.time, e.verified) for e in entries],
        keep_last=cfg.backup.keep_last,
        keep_hourly=cfg.backup.keep_hourly,
        keep_daily=cfg.backup.keep_daily,
    )
    if dry_run:
        return decisions
    by_name = {e.name: e for e in entries}
    for d in decisions:
        if not d.keep:
            log.info("pruning %s: %s", d.name, d.reason)
            os.unlink(by_name[d.name].path)
    if any(not d.keep for d in decisions):
        from ..fs import fsync_dir

        fsync_dir(directory)
    return decisions


def prune_locked(cfg: Config, *, dry_run: bool) -> List[retention.Decision]:
    """``backup prune``: the same, under the operation lock (dry runs need no lock)."""
    if dry_run:
        return prune_backups(cfg, dry_run=True)
    ensure_private_dir(cfg.backup.dir)
    with OperationLock(lock_path_for(cfg.backup.dir), "prune"):
        return prune_backups(cfg, dry_run=False)


def _record_metrics(
    cfg: Config,
    ok: bool,
    path: Optional[str],
    size: int,
    duration: float,
    revision: Optional[int],
    remote_ok: Optional[bool] = None,
) -> None:
    if not cfg.backup.metrics_file:
        return
    from . import metrics

    # record_backup never raises: metrics must not turn a good backup into a failed one
    metrics.record_backup(cfg, ok, path, size, duration, revision, remote_ok)
