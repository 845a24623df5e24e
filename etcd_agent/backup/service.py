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
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Mapping, Optional, Protocol, Tuple

from etcd_agent import __version__
from etcd_agent.backup import archive, boundaries, catalog, checks, keys, lean, retention
from etcd_agent.backup.checks import SYSTEM_WALL_CLOCK, WallClock
from etcd_agent.backup.manifest import ClusterClaim, FileEntry, Manifest, ManifestMember
from etcd_agent.backup.snapcheck import SnapshotFacts
from etcd_agent.backup.verify import verify
from etcd_agent.config import Config, Member
from etcd_agent.errors import AgentError, BackupCorrupt, BackupError, BusyError, EtcdUnavailable, RefusedError
from etcd_agent.etcd.snapdb import SnapshotIdentity
from etcd_agent.fs import ensure_private_dir, open_regular
from etcd_agent.locality import local_member
from etcd_agent.state.locks import OperationLock, lock_path_for

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.chain.chains import Scan

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
    quarantined: List[str] = field(default_factory=list)
    manifest: Dict[str, Any] = field(default_factory=dict)

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
            "quarantined": self.quarantined,
        }



class OffHostCopy(Protocol):
    """The off-host copy of a new full backup (``bucket.copier.OffHostCopy``): the bucket sits
    above the backups it copies, so the backup is handed its copier and never imports it."""

    def upload(self, path: str, manifest: Mapping[str, Any], snapshot_sha256: str) -> None: ...

    def prune(self) -> List[str]:
        """Remote retention after a copy: the names it deleted."""
        ...

def _local_candidates(cfg: Config) -> List[Member]:
    """This machine's members; several on a one-host cluster (the demo), where any healthy one's
    snapshot is the cluster's."""
    from etcd_agent.locality import local_members, machine_identity

    me = machine_identity() if cfg.local.name is None else None
    found = local_members(cfg, me)
    if not found:
        return [local_member(cfg, me or machine_identity())]  # raises the "not found" ConfigError
    return found


def required_space(db_size: int, compression: str, margin: float) -> int:
    """Free bytes needed before writing: the archive is at most the db (+ headers, + 16 bytes per
    64 KiB when encrypted); compressed, at most what zstd makes of incompressible data (+ 1/256,
    + a frame header per 4 MiB) and the head reserved for the manifest. gzip spools the snapshot
    beside the archive first, so it needs the db once more."""
    expected = db_size + db_size // 4096 + 64 * 1024
    if compression != "none":
        expected = db_size + db_size // 128 + archive.head_room({}) + (1 << 20)
    if compression == "gzip":
        expected += db_size
    return int(expected * (1.0 + margin))


def take_backup(
    cfg: Config,
    *,
    member: Optional[str] = None,
    check_space: bool = True,
    full_verify: bool = False,
    prune: bool = True,
    clock: WallClock = SYSTEM_WALL_CLOCK,
    hold_lock: bool = True,
    origin: str = "operator",
    lock_wait: float = 0.0,
    checkpoint_of: Optional[str] = None,
    off_host: Optional["OffHostCopy"] = None,
) -> BackupResult:
    """Take one backup of ``member``'s etcd (default: a local member) into ``cfg.backup.dir``.

    ``clock`` names the archive and ages the others (retention): a test passes a fake one.
    ``hold_lock=False``: the caller already holds this host's operation lock (a node session).
    ``origin``: who takes it (``manifest.ORIGINS``): the daemon's chain backups are kept in slots
    of their own, so that they never push the operator's history out. ``lock_wait``: while
    another backup, prune or import of this host holds the lock, wait up to this long for it.
    ``checkpoint_of``: the daemon's checkpoint inside that delta chain (its id): recorded in the
    signed manifest, kept by retention's checkpoint rule, and not copied off-host (a bucket
    holds full backups and chains; a checkpoint only shortens a local replay). ``off_host``: the
    off-host copy (``bucket.copier.off_host(cfg)``, None when ``[backup.remote]`` is off) made of
    a full backup once written, and the remote retention run after it: required when
    ``[backup.remote]`` is on, except for the daemon's backups (its copy queue copies them)."""
    start = time.monotonic()
    if checkpoint_of is not None and origin != "daemon":
        raise ValueError("only the daemon takes checkpoints")
    _check_off_host(cfg, origin, off_host)
    try:
        result = _take(cfg, member, check_space, full_verify, prune, start, clock, hold_lock, origin, lock_wait,
                       checkpoint_of)
    except BusyError:
        raise  # another run is working: not a failed backup
    except AgentError:
        _record_metrics(cfg, False, None, 0, time.monotonic() - start, None)
        raise
    if off_host is None or checkpoint_of is not None or origin == "daemon":
        # the daemon's own backups and checkpoints are copied by its copy queue (bucket.copier),
        # which retries: its local work never waits for the bucket
        _record_metrics(cfg, True, result.path, result.size, result.duration, result.revision)
        return result
    try:
        off_host.upload(result.path, result.manifest, result.sha256)
    except AgentError as exc:
        # the local backup stands; the run still fails so cron / the timer reports it. The copy
        # is not lost: the daemon's copy queue finds it missing from the bucket and retries
        _record_metrics(cfg, True, result.path, result.size, result.duration, result.revision, remote_ok=False)
        raise BackupError(
            f"backup {result.path} written, but the off-host copy failed: {exc.message}; the daemon (etcd-agent run) "
            "copies it once the bucket takes it (`etcd-agent backup push` tries now)", details=exc.details
        ) from exc
    _record_metrics(cfg, True, result.path, result.size, result.duration, result.revision, remote_ok=True)
    if prune:
        try:
            result.pruned += off_host.prune()
        except AgentError as exc:
            result.warnings.append(f"remote prune failed: {exc.message}")
            log.warning("remote prune after backup failed: %s", exc.message)
    return result


def _check_off_host(cfg: Config, origin: str, off_host: Optional["OffHostCopy"]) -> None:
    """A caller that forgot the off-host copy fails at once, before any backup is taken: a backup
    that [backup.remote] says is copied, silently not copied, is found only on the bad day."""
    daemon = origin == "daemon"
    if off_host is None and cfg.backup.remote.enabled and not daemon:
        raise ValueError("take_backup: [backup.remote] is enabled but no off_host copier was given: the backup "
                         "would not be copied (pass off_host=bucket.copier.off_host(cfg))")
    if off_host is not None and daemon:
        raise ValueError("take_backup: the daemon's backups are copied by its copy queue, not by off_host")


def _choose(cfg: Config, member_name: Optional[str], client_for: Any) -> Tuple[Member, List[str]]:
    """The member to snapshot and what to say about the choice."""
    if member_name is not None:
        return cfg.member(member_name), []
    cands = _local_candidates(cfg)
    if len(cands) == 1:
        return cands[0], []
    for m in cands:
        c = client_for(m)
        try:
            ok, _why = c.healthy(m.client_url, timeout=3.0)
        finally:
            c.close()
        if ok:
            note = (f"members {', '.join(x.name for x in cands)} all run on this host; backing up {m.name} "
                    "(healthy: any healthy member's snapshot is the cluster's)")
            log.info("%s", note)
            return m, [note]
    raise RefusedError(f"no healthy member on this host ({', '.join(x.name for x in cands)}) to back up; nothing written")


def _take(
    cfg: Config, member_name: Optional[str], check_space: bool, full_verify: bool, prune: bool, start: float,
    clock: WallClock,
    hold_lock: bool = True,
    origin: str = "operator",
    lock_wait: float = 0.0,
    checkpoint_of: Optional[str] = None,
) -> BackupResult:
    from etcd_agent.etcd.client import EtcdClient
    from etcd_agent.etcd.tools import snapshot_status
    from etcd_agent.hosts.local import LocalHost

    directory = cfg.backup.dir
    ensure_private_dir(directory)
    m, notes = _choose(cfg, member_name, lambda x: EtcdClient.from_config(cfg, endpoints=[x.client_url], timeout=5.0))
    with OperationLock(lock_path_for(directory), "backup", wait=lock_wait) if hold_lock else contextlib.nullcontext():
        archive.remove_partials(directory)
        lean.sweep(cfg)  # a checkpoint's stage a killed run left
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
            when, name = _free_name(directory, cfg.backup.utc, comp, clock)
            files, missing, rendered = _local_files(cfg, m)
            keystate = keys.cluster_key(cfg, client, create=True)
            for w in keystate.warnings:
                log.warning("%s", w)
                notes.append(w)
            if keystate.key is None:
                notes.append("no manifest key could be had: this backup's manifest is unsigned")
            lineage_raw: Optional[bytes] = None
            try:
                from etcd_agent.etcd.lineage import LINEAGE_KEY

                lineage_raw = client.get(LINEAGE_KEY)
            except AgentError:
                pass
            host = LocalHost()

            def build(infos: Dict[str, archive.FileInfo], facts: SnapshotFacts, ident: SnapshotIdentity) -> Manifest:
                checks = ["etcd sha256 trailer", "bbolt meta pages", "size = pages x page size"]
                return Manifest(
                    files={n: FileEntry(i.size, i.sha256) for n, i in infos.items()},
                    name=name,
                    created=when.isoformat(),
                    created_unix=int(when.timestamp()),
                    host=socket.gethostname(),
                    member=m.name,
                    endpoint=m.client_url,
                    member_id=f"{st.member_id:x}",
                    cluster=ClusterClaim(cfg.cluster.name, f"{st.cluster_id:x}"),
                    members=tuple(ManifestMember(f"{x.id:x}", x.name, tuple(x.peer_urls), tuple(x.client_urls),
                                                 x.is_learner) for x in members),
                    # as `snapshot status` counts it, read from the snapshot's db: the newest
                    # revision in the key bucket, 0 when it holds no key
                    revision=ident.revision,
                    store_revision=st.revision,  # the member's store revision when the snapshot began
                    etcd_version=st.version,
                    agent_version=__version__,
                    db_size=st.db_size,
                    compression=comp,
                    missing=missing,
                    rendered=rendered,
                    snapshot={"page_size": facts.page_size, "pages": facts.high_water, "txid": facts.txid,
                              "checks": checks, "status": None, "taken_by": origin,
                              **({"checkpoint": {"chain_id": checkpoint_of}} if checkpoint_of else {}),
                              # defragmented offline (``lean``): the size etcd streamed
                              **({"lean": {"from_bytes": stage.from_bytes}} if stage and stage.lean else {})},
                    verified=True,
                )

            recipients = recipients_of(cfg)
            log.info("backing up member %s (%s, db %d bytes) to %s%s", m.name, m.client_url, st.db_size, name,
                     f", encrypted to {len(recipients)} age recipient(s)" if recipients else "")
            with _checkpoint_stage(cfg, host, client, m, st.db_size, checkpoint_of) as stage:
                written = archive.write_archive(
                    directory,
                    name,
                    chunks=stage.chunks() if stage else client.snapshot_chunks(m.client_url),
                    files=files,
                    build_manifest=build,
                    mtime=int(when.timestamp()),
                    encrypt_to=recipients,
                    key=keystate.key,
                )
        finally:
            client.close()
        ids = tuple(x.id_hex for x in written.identity.members)
        _record_check(directory, written.path, "written", clock, revision=written.revision, sha256=written.sha256,
                      member_ids=ids, signature="valid" if keystate.key is not None else "unsigned")
        if full_verify:
            rep = verify(written.path, status_fn=lambda p: snapshot_status(host, cfg, p), tmp_parent=directory,
                         key=keystate.key)
            if not rep.ok:
                os.unlink(written.path)  # a backup that fails its check must not count
                raise BackupCorrupt(f"backup {written.path} failed verification; removed", details=rep.problems)
            _record_check(directory, written.path, "verify", clock, revision=written.revision,
                          sha256=written.sha256, member_ids=ids, signature=rep.signature)
        duration = time.monotonic() - start
        log.info("backup %s: %d bytes, revision %s, %.2fs", written.path, written.size, written.revision, duration)
        result = BackupResult(
            written.path, written.size, written.revision, written.sha256, duration, m.name,
            warnings=notes, manifest=written.manifest.to_json(),
        )
        if prune:  # still under the lock: prune never races another run
            from etcd_agent.backup.evidence import local_hosts, parse_lineage
            from etcd_agent.backup.identity import Evidence, KnownMember

            lineage, lcids = parse_lineage(lineage_raw)
            # this host's data dirs too: etcd 3.4 keeps an earlier incarnation's member ids in the
            # db after a restore, so backups from before it are still recognised as ours
            hosts, _notes = local_hosts(cfg)
            evidence = Evidence(running=tuple(KnownMember(x.id, x.name, x.peer_urls) for x in members),
                                running_cluster_id=st.cluster_id, hosts=tuple(hosts), lineage=lineage,
                                lineage_cluster_ids=lcids)
            try:
                decisions = prune_backups(cfg, dry_run=False, protect=(name,), clock=clock, evidence=evidence,
                                          key=keystate.key)
                result.pruned = [d.name for d in decisions if not d.keep]
                result.quarantined = [f"{d.name}: {d.reason}" for d in decisions if d.reason.startswith("quarantined")]
            except (AgentError, OSError) as exc:
                result.warnings.append(f"prune failed: {exc}")
                log.warning("prune after backup failed: %s", exc)
    return result


def _checkpoint_stage(cfg: Config, host: Any, client: Any, m: Member, db_size: int,
                      checkpoint_of: Optional[str]) -> ContextManager[Optional[lean.Staged]]:
    """A checkpoint's snapshot staged and defragmented offline (``backup.lean``) with
    ``[backup.delta] lean_checkpoints``; None (streamed straight from etcd, as every other backup)
    otherwise, or when the defrag tool is missing (said in one log line)."""
    if checkpoint_of is None or not cfg.backup.delta.lean_checkpoints:
        return contextlib.nullcontext(None)
    missing = lean.tool_missing(cfg)
    if missing:
        log.warning("delta: checkpoint taken as etcd streams it, not defragmented: %s", missing)
        return contextlib.nullcontext(None)
    return lean.staged(cfg, host, lambda: client.snapshot_chunks(m.client_url), db_size)


def recipients_of(cfg: Config) -> Tuple[Any, ...]:
    """``[backup] encrypt_to`` parsed (validated with the config already); () = not encrypted."""
    if not cfg.backup.encrypt_to:
        return ()
    from etcd_agent.age import parse_recipients

    return parse_recipients(cfg.backup.encrypt_to)


def _record_check(directory: str, path: str, how: str, clock: WallClock, **kw: Any) -> None:
    c = checks.check_of(path, ok=True, how=how, clock=clock, kind="agent", **kw)
    if c is not None:
        checks.record(directory, os.path.basename(path), c)


def _free_name(directory: str, utc: bool, compression: str, clock: WallClock) -> Tuple[datetime, str]:
    """A timestamp whose name no backup uses yet (waits for the next second if needed)."""
    for _ in range(3):
        t = clock.now()
        when = (t.astimezone(timezone.utc) if utc else t.astimezone()).replace(microsecond=0)
        stem = archive.archive_name(when, "none")
        if not any(os.path.exists(os.path.join(directory, stem[: -len(".tar")] + ext)) for ext in archive.EXTENSIONS.values()):
            return when, archive.archive_name(when, compression)
        clock.sleep(1.0 - (t.timestamp() % 1.0) + 0.01)
    raise BackupError(f"cannot find a free backup name in {directory}")


def _local_files(cfg: Config, member: Member) -> Tuple[Dict[str, bytes], Dict[str, str], Dict[str, str]]:
    """etcd.conf and etcd.service as found on disk; a missing unit file is rendered instead (the
    unit the agent would install on a systemd host) and recorded so; a missing conf is recorded."""
    files: Dict[str, bytes] = {}
    missing: Dict[str, str] = {}
    rendered: Dict[str, str] = {}
    for arc, path in ((archive.CONF, cfg.conf_file(member.name)), (archive.UNIT, cfg.etcd.unit_file)):
        try:
            with open_regular(path, follow_symlinks=True) as fh:  # a FIFO there must not hang the backup
                files[arc] = fh.read(1 << 20)
        except FileNotFoundError:
            missing[arc] = f"{path} not found"
            if arc == archive.CONF:
                log.warning("%s not found; the backup records it as missing", path)
        except OSError as exc:
            missing[arc] = f"{path} unreadable: {exc.strerror or exc}"
            log.warning("cannot read %s: %s", path, exc)
    if archive.UNIT not in files:
        from etcd_agent.member.local import LocalMember

        files[archive.UNIT] = LocalMember(cfg, member).unit_text().encode()
        rendered[archive.UNIT] = (f"{missing.pop(archive.UNIT)} ({cfg.etcd.service_manager} backend): the unit "
                                  "the agent would install on a systemd host")
    return files, missing, rendered


def prune_backups(
    cfg: Config,
    *,
    dry_run: bool,
    protect: Tuple[str, ...] = (),
    clock: WallClock = SYSTEM_WALL_CLOCK,
    evidence: Optional[Any] = None,
    key: Optional[bytes] = None,
) -> List[retention.Decision]:
    """Apply the retention policy to the good backups in the backup dir; quarantined files are
    listed after them (kept, never deleted, no slot). Returns every decision, newest first."""
    from etcd_agent.chain import chains

    directory = cfg.backup.dir
    entries = catalog.list_backups(directory, utc=cfg.backup.utc, clock=clock, cfg=cfg, evidence=evidence, key=key)
    found = chains.scan(directory)
    goods, unproven = _checkpoints_by_chain(catalog.good(entries), found)
    record = boundaries.load(directory)
    held = boundaries.holds(record.boundaries,
                            [boundaries.BackupAt(e.name, e.time.timestamp(), e.snapshot_sha256) for e in goods],
                            os.path.lexists)
    holds = [(h.name, h.reason) for h in held]
    # the daemon's checkpoints (inside a chain) are counted apart, after the chains are decided
    checkpoints = [e for e in goods if e.checkpoint_of]
    goods = [e for e in goods if not e.checkpoint_of]
    decisions = retention.plan(
        [retention.BackupRef(e.name, e.time, e.verified, e.origin) for e in goods],
        keep_last=cfg.backup.keep_last,
        keep_hourly=cfg.backup.keep_hourly,
        keep_daily=cfg.backup.keep_daily,
        protect=protect,
        holds=holds,
    )
    quarantined = [retention.Decision(e.name, True, (f"quarantined: {e.problem} (not deleted, takes no slot)",))
                   for e in entries if not e.complete]
    chain_plan = _chain_plan(found, directory, decisions, goods, entries)
    chain_decisions = [retention.Decision(c.label, c.keep, (c.reason,)) for c in chain_plan]
    decisions += retention.plan_checkpoints(
        [retention.BackupRef(e.name, e.time, e.verified, e.origin, chain=e.checkpoint_of or "") for e in checkpoints],
        live_chains={c.chain_id for c in chain_plan if c.keep and c.chain_id},
        keep=cfg.backup.delta.checkpoint_keep, protect=protect, holds=holds)
    decisions += unproven
    if record.problem:  # what it protects is unknown: fail closed, delete nothing
        why = boundaries.unreadable_message(record.problem)
        log.warning("prune held: %s", why)
        return _held_back(decisions, why) + _held_back(chain_decisions, why) + quarantined
    if not dry_run:
        _delete(directory, decisions, goods + checkpoints, chain_plan)
    return decisions + chain_decisions + quarantined


def _checkpoints_by_chain(goods: List[catalog.Entry], found: "Scan"
                          ) -> Tuple[List[catalog.Entry], List[retention.Decision]]:
    """``goods`` with every checkpoint a chain here vouches for known as one, whatever its manifest
    can say here (``catalog.chain_checkpoints``): a master restored from the bucket has no manifest
    key until its daemon's first full backup, and a fetched checkpoint read as an operator's backup
    took an operator's slot and pushed a real backup out (with its chain). A file of a vouched name
    whose snapshot is not known to be the one vouched for is neither counted nor deleted: a keep
    saying why (its own check, `backup verify`, tells)."""
    if all(e.signature == "valid" for e in goods):  # every manifest has said what it is
        return goods, []
    marked = catalog.chain_checkpoints(goods, found)
    named = {e.name for e in marked}
    vouchers = {cp.name: c.chain_id for c in found.chains for cp in c.checkpoints}
    unproven = [retention.Decision(e.name, True, (
        f"named as a checkpoint by delta chain {vouchers.get(e.name, '?')[:8]}, {_unproven(e)}: kept, takes no slot",))
        for e in goods if e.name not in named]
    return marked, unproven


def _unproven(e: catalog.Entry) -> str:
    if e.snapshot_sha256:  # another snapshot under a checkpoint's name: never deleted by a rule
        return f"but its snapshot is another one (sha256 {e.snapshot_sha256[:16]}...)"
    return ("its snapshot not known to be the one vouched for (no check recorded, no manifest key; "
            "`etcd-agent backup verify` checks it)")


def _chain_plan(found: "Scan", directory: str, decisions: List[retention.Decision], goods: List[catalog.Entry],
                entries: List[catalog.Entry]) -> List[Any]:
    """What becomes of each delta chain: a full backup and the chain that continues it go together
    (a quarantined one is never deleted: its chain stays with it)."""
    from etcd_agent.chain import chains

    fulls = [chains.FullRef(d.name, by_rev.revision, d.keep, reason=d.reason, base=by_rev.base) for d in decisions
             for by_rev in goods if by_rev.name == d.name]
    fulls += [chains.FullRef(e.name, e.revision, True, good=False, base=e.base) for e in entries if not e.complete]
    return chains.plan_prune(found, fulls, active=chains.active_base(directory))


def _held_back(decisions: List[retention.Decision], why: str) -> List[retention.Decision]:
    """Every deletion in ``decisions`` turned into a keep that says why."""
    return [d if d.keep else retention.Decision(d.name, True, (f"held ({d.reason}): {why}",)) for d in decisions]


def _delete(directory: str, decisions: List[retention.Decision], backups: List[catalog.Entry],
            chain_plan: List[Any]) -> None:
    """The full backups and chains decided against, removed; the dir fsynced if anything went."""
    by_name = {e.name: e for e in backups}
    for d in decisions:
        if not d.keep:
            log.info("pruning %s: %s", d.name, d.reason)
            os.unlink(by_name[d.name].path)
    from etcd_agent.chain import chains

    removed = chains.apply(chain_plan)
    if removed or any(not d.keep for d in decisions):
        from etcd_agent.fs import fsync_dir

        fsync_dir(directory)


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
    from etcd_agent.backup import metrics

    # record_backup never raises: metrics must not turn a good backup into a failed one
    metrics.record_backup(cfg, ok, path, size, duration, revision, remote_ok)
