"""``backup import FILE``: a tarball made by hand (the runbook's ``etcdctl snapshot save`` + tar)
becomes a verified agent backup, with a signed manifest, in the backup dir.

The file is read once by the bounded reader (staged when compressed), judged (its snapshot's
members must be this config's, and this cluster's when anything of the cluster can be found),
then written anew by the same single-pass writer a backup uses: the snapshot is checked again as
it streams in, its identity read back, the manifest built from what the content says (members
from the snapshot's own db, no cluster id claimed) and signed. The name keeps the original's date
(``etcd-2019-08-07.tar`` -> ``etcd-2019-08-07-HH-MM-SS.tar``, the time of day from the snapshot's
tar header when it falls on that date, else 00:00:00); an existing name is never overwritten.

An encrypted backup (``etcd_snapshot.db.age``) is imported only with ``--identity`` (its identity
is in the encrypted db) and only into a config with ``[backup] encrypt_to``: it is re-encrypted
to the configured recipients as it is written anew, like every backup there; without encrypt_to
it would land in the clear, so it is refused. With encrypt_to, a plain tarball is encrypted too.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional

from etcd_agent import __version__
from etcd_agent.backup import archive, checks, keys
from etcd_agent.backup.catalog import name_time
from etcd_agent.backup.checks import SYSTEM_WALL_CLOCK, WallClock
from etcd_agent.backup.identity import Evidence, Verdict, judge
from etcd_agent.backup.manifest import FileEntry, Manifest, ManifestMember
from etcd_agent.backup.reader import Archive, SnapshotSource, open_archive, peek_archive
from etcd_agent.backup.snapcheck import SnapshotFacts
from etcd_agent.config import Config
from etcd_agent.errors import RefusedError
from etcd_agent.etcd.snapdb import SnapshotIdentity
from etcd_agent.fs import ensure_private_dir
from etcd_agent.state.locks import OperationLock, lock_path_for

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities

log = logging.getLogger(__name__)


@dataclass
class ImportResult:
    source: str
    path: str  # where it is (or would be, with --dry-run)
    dry_run: bool
    kind: str
    revision: int
    checked: List[str] = field(default_factory=list)
    not_checked: List[str] = field(default_factory=list)
    verdict: Optional[Verdict] = None
    warnings: List[str] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {
            "source": self.source, "path": self.path, "dry_run": self.dry_run, "kind": self.kind,
            "revision": self.revision, "checked": self.checked, "not_checked": self.not_checked,
            "proven": list(self.verdict.proven) if self.verdict else [],
            "unproven": list(self.verdict.unproven) if self.verdict else [], "warnings": self.warnings,
        }


def _when(arc: Archive, source: str, utc: bool, clock: WallClock) -> datetime:
    """The original's date (name), the time of day from the snapshot's tar mtime when it is on
    that date; no date in the name: the snapshot's tar mtime, else the file's mtime."""
    tz = timezone.utc if utc else datetime.now().astimezone().tzinfo
    mt = dict(arc.mtimes).get(arc.snapshot_member) or int(os.stat(source).st_mtime)
    member_time = datetime.fromtimestamp(mt, tz)
    day = name_time(os.path.basename(source), utc)
    if day is None:
        when = member_time
    elif member_time.date() == day.date():
        when = member_time if day.time() == datetime.min.time() else day
    else:
        when = day
    if when > clock.now() + timedelta(minutes=5):
        raise RefusedError(f"{source} is dated in the future ({when.isoformat()}): fix the name or the clock first")
    return when.replace(microsecond=0)


def _free(directory: str, when: datetime, compression: str) -> str:
    for i in range(120):
        name = archive.archive_name(when + timedelta(seconds=i), compression)
        if not os.path.lexists(os.path.join(directory, name)):
            return name
    raise RefusedError(f"no free backup name near {when.isoformat()} in {directory}")


def _chunks(snap: SnapshotSource) -> Iterator[bytes]:
    with snap.open() as fh:
        while True:
            chunk = fh.read(1 << 20)
            if not chunk:
                return
            yield chunk


def import_backup(
    cfg: Config,
    source: str,
    *,
    dry_run: bool,
    evidence: Evidence,
    status_fn: Optional[Any] = None,
    clock: WallClock = SYSTEM_WALL_CLOCK,
    client: Optional[Any] = None,
    identities: Optional["Identities"] = None,
) -> ImportResult:
    """Import ``source`` into ``cfg.backup.dir`` (see the module doc); RefusedError if foreign,
    IdentityRefused for an encrypted one without (the right) ``identities``."""
    directory = cfg.backup.dir
    ensure_private_dir(directory)
    if peek_archive(source).encrypted and not cfg.backup.encrypt_to:  # cheap: headers and the manifest
        raise RefusedError(f"{source}: not imported: its snapshot is encrypted and this config has no [backup] "
                           "encrypt_to, so the import would store it in the clear; set encrypt_to (it is then "
                           "re-encrypted to those recipients) or decrypt it by hand first")
    if os.path.dirname(os.path.abspath(source)) == os.path.abspath(directory) and dry_run is False:
        log.info("importing %s from the backup dir itself; the original stays", source)
    keystate = keys.cluster_key(cfg, client, create=True) if client is not None else keys.local_key(cfg)
    with OperationLock(lock_path_for(directory), "import"):
        arc = open_archive(source, staging_dir=directory, key=keystate.key, extract=status_fn is not None,
                           identities=identities, need_plaintext=True)
        try:
            snap, ident = arc.plaintext()
            verdict = judge(ident, cfg, evidence, new_cluster=False)
            if verdict.refused:
                raise RefusedError(f"{source}: not imported: {verdict.refused[0]}")
            status = status_fn(snap.path) if status_fn is not None else None
            if status is not None and status.get("revision") != ident.revision:
                raise RefusedError(f"{source}: `snapshot status` says revision {status.get('revision')}, the db "
                                   f"holds {ident.revision}: not imported")
            when = _when(arc, source, cfg.backup.utc, clock)
            comp = cfg.backup.compression
            name = _free(directory, when, comp)
            result = ImportResult(source, os.path.join(directory, name), dry_run, arc.kind, ident.revision,
                                  list(arc.checked), list(arc.not_checked), verdict, list(keystate.warnings))
            if dry_run:
                return result
            files: Dict[str, bytes] = {}
            rendered: Dict[str, str] = {}
            missing: Dict[str, str] = {}
            if arc.conf is not None:
                files[archive.CONF] = arc.conf
            else:
                missing[archive.CONF] = f"not in the imported {os.path.basename(source)}"
            if arc.unit is not None:
                files[archive.UNIT] = arc.unit
            else:
                from etcd_agent.member.local import LocalMember

                local = cfg.member(cfg.local.name) if cfg.local.name else cfg.members[0]
                files[archive.UNIT] = LocalMember(cfg, local).unit_text().encode()
                rendered[archive.UNIT] = f"not in the imported {os.path.basename(source)}: rendered for {local.name}"
            imported = {"from": os.path.abspath(source), "kind": arc.kind, "compression": arc.compression,
                        "size": os.stat(source).st_size, "at": clock.now().isoformat(timespec="seconds")}
            if arc.sealed is not None:  # re-encrypted below to the configured recipients
                imported["encrypted_to"] = list(arc.sealed.recipients)

            def build(infos: Dict[str, archive.FileInfo], facts: SnapshotFacts, ident: SnapshotIdentity) -> Manifest:
                return Manifest(
                    files={n: FileEntry(i.size, i.sha256) for n, i in infos.items()},
                    name=name, created=when.isoformat(), created_unix=int(when.timestamp()),
                    host=socket.gethostname(),
                    members=tuple(ManifestMember(m.id_hex, m.name, m.peer_urls, m.client_urls, m.is_learner)
                                  for m in ident.members),
                    revision=ident.revision, etcd_version=ident.cluster_version, agent_version=__version__,
                    compression=comp, missing=missing, rendered=rendered,
                    snapshot={"page_size": facts.page_size, "pages": facts.high_water, "txid": facts.txid,
                              "checks": ["etcd sha256 trailer", "bbolt meta pages", "size = pages x page size"]
                              + (["snapshot status"] if status is not None else []),
                              "status": status},
                    imported=imported, verified=True,
                )

            from etcd_agent.backup.service import recipients_of

            written = archive.write_archive(directory, name, chunks=_chunks(snap), files=files, build_manifest=build,
                                            mtime=int(when.timestamp()), key=keystate.key, encrypt_to=recipients_of(cfg))
        finally:
            arc.close()
        c = checks.check_of(written.path, ok=True, how="import", clock=clock, kind="agent",
                            revision=written.revision, sha256=written.sha256,
                            member_ids=tuple(m.id_hex for m in written.identity.members),
                            signature="valid" if keystate.key is not None else "unsigned")
        if c is not None:
            checks.record(directory, name, c)
        if keystate.key is None:
            result.warnings.append("no manifest key: the imported backup's manifest is unsigned")
        log.info("imported %s as %s", source, written.path)
        return result
