"""The backup a restore reads from: its snapshot bytes, what is claimed about them, what was checked.

``open_source`` resolves ``--from`` (a path, a file name in the backup dir in any timestamp form,
a date, ``latest``) and reads the archive with the one bounded reader (``backup.reader``), which
accepts the agent's own tarballs and the runbook's (``etcdctl snapshot save`` + ``tar``, gzip or
not, no manifest). Cheap first: headers, manifest, signature and the snapshot's own identity
(its members, from a few pages of its db) are read without reading the whole snapshot; a plain
tar's snapshot is then shipped straight from the archive (no copy here) and hashed as it is read,
a compressed one is decompressed once into a private staging dir. An encrypted one
(``etcd_snapshot.db.age``) is decrypted here, with ``--identity``, into a private staging dir outside
the backup dir (``pitr.workdirs.private_dir``) on this master only: the other masters receive the plaintext through their node sessions, as always.
Without an identity it is refused before anything is touched.

``open_pitr_source`` (``restore --to-time/--to-revision/--to newest``) reads the full backup the
same way, then replays its delta chain onto it in a throwaway loopback member (``delta.pitr``)
and offers the saved result as the snapshot to restore. Whose data it is is judged on the full
backup's members, read from its own db as usual: the replayed db's member list is the replay
member's (``snapshot restore`` rewrites it), while its data is the full backup's plus the chain
captured from this cluster (every segment links to the full backup's revision by sha256).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Callable, Dict, List, Optional, Tuple, Union

from etcd_agent.backup.reader import Archive, open_archive
from etcd_agent.config import Config
from etcd_agent.errors import RefusedError
from etcd_agent.etcd.snapdb import SnapshotIdentity
from etcd_agent.fs import open_regular
from etcd_agent.restore.orchestrator.plan import SourceFacts
from etcd_agent.state.locks import OperationLock

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities
    from etcd_agent.backup.catalog import Entry
    from etcd_agent.pitr.carried import CheckedChain
    from etcd_agent.pitr.members import Record, Tail
    from etcd_agent.pitr.prepare import Prepared
    from etcd_agent.pitr.replay import ReplayResult, Target
    from etcd_agent.restore.orchestrator.meanwhile import Meanwhile
    from etcd_agent.restore.orchestrator.options import Options

log = logging.getLogger(__name__)


@dataclass
class Source:
    path: str
    kind: str  # "agent" | "runbook"
    size: int
    sha256: Optional[str]  # the signed manifest's, or the reader's own hash; None until shipped
    revision: Optional[int]
    etcd_version: Optional[str]  # the manifest's claim; None for a runbook tarball
    identity: Optional[SnapshotIdentity]  # from the snapshot's own db
    checked: Tuple[str, ...] = ()
    archive: Optional[Archive] = None
    # a component test's source: bytes at (file, offset) without an archive around them
    snapshot_path: Optional[str] = None
    offset: int = 0
    # a point-in-time restore's replayed snapshot: removed when the restore ends (a crash keeps it
    # for the re-run that resumes)
    remove_on_close: Optional[str] = None
    lock: Optional[OperationLock] = None  # ... and the lock that makes it this restore's own
    timings: Dict[str, float] = dataclasses.field(default_factory=dict)  # a replay's phases (the restore's JSON)
    # a point-in-time restore that loads its tail into the restored members: the tail (folding
    # meanwhile), and the record its journals name as their backup - kept once a member began,
    # until the restore is done, so that `--from <record>` resumes it
    tail: "Optional[Tail]" = None
    record: Optional[str] = None
    keep_record: bool = False
    tail_to: Optional[int] = None  # the revision the tail is loaded to (a dry run's too, which folds none)

    @property
    def member_ids(self) -> Tuple[str, ...]:
        return tuple(f"{x:x}" for x in self.identity.member_ids) if self.identity else ()

    def open(self) -> BinaryIO:
        """A reader of exactly the snapshot's bytes."""
        if self.archive is not None:
            return self.archive.plaintext()[0].open()
        assert self.snapshot_path is not None
        fh = open_regular(self.snapshot_path, follow_symlinks=True)
        fh.seek(self.offset)
        return fh

    def location(self) -> Tuple[str, int]:
        """The file on this host holding the snapshot's bytes, and where in it they start (a plain
        tarball: the backup itself; compressed or encrypted: the private extracted copy)."""
        if self.archive is not None:
            snap = self.archive.plaintext()[0]
            return snap.path, snap.offset
        assert self.snapshot_path is not None
        return self.snapshot_path, self.offset

    def read_at(self, offset: int, n: int) -> bytes:
        """``n`` bytes of the snapshot from ``offset`` (fewer at its end): samples, no stream."""
        if self.archive is not None:
            return self.archive.plaintext()[0].read_at(offset, n)
        assert self.snapshot_path is not None
        fd = os.open(self.snapshot_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, max(0, min(n, self.size - offset)), self.offset + offset)
        finally:
            os.close(fd)

    def facts(self, lines: Tuple[str, ...] = ()) -> SourceFacts:
        return SourceFacts(self.kind, self.revision, self.size, self.sha256, tuple(self.checked) + lines, self.tail_to)

    def close(self) -> None:
        if self.tail is not None:
            self.tail.close()
        if self.record is not None and not self.keep_record:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.record)
        if self.archive is not None:
            self.archive.close()
        if self.remove_on_close is not None:
            from etcd_agent.pitr.prepare import remove_kept

            remove_kept(self.remove_on_close)
        if self.lock is not None:
            self.lock.release()


def source_for(opts: "Options") -> Callable[[Config, str, str, bool, "Meanwhile"], "Source"]:
    """How a restore asked ``opts`` opens its source: the backup ``--from`` names (read at once:
    the hosts are opened after it); with a target, its chain replayed to it first
    (``open_pitr_source``, the hosts opened while it replays)."""
    def opened(cfg: Config, spec: str, staging: str, hash_now: bool, meanwhile: "Meanwhile") -> Source:
        if opts.target is None:
            return open_source(cfg, spec, staging, hash_now=hash_now, identities=opts.identities)
        return open_pitr_source(cfg, spec, opts.target, staging, progress=opts.progress, identities=opts.identities,
                                checkpoints=opts.checkpoints, accept_unsigned=opts.accept_unsigned,
                                checked=opts.checked, meanwhile=meanwhile, dry_run=hash_now)
    return opened


def open_source(cfg: Config, spec: Union[str, "Entry"], staging_parent: str, *, hash_now: bool = False,
                identities: Optional["Identities"] = None) -> Source:
    """The backup ``spec`` names, read and checked (``hash_now``: hash the whole snapshot now, as
    a dry run does; otherwise it is hashed as it is shipped). An encrypted one is decrypted with
    ``identities`` (IdentityRefused without them, or with a wrong key: exit 3, nothing touched)."""
    from etcd_agent.backup.catalog import resolve_from

    if isinstance(spec, str):
        kept = _kept_replay(cfg, spec) or _kept_tail(cfg, spec, staging_parent, identities, hash_now)
        if kept is not None:
            return kept
        path = resolve_from(cfg, spec).path
    else:  # the entry a point-in-time restore resolved already (--from is resolved once)
        path = spec.path
    return _archive_source(cfg, path, staging_parent, hash_now, identities)


def _archive_source(cfg: Config, path: str, staging_parent: str, hash_now: bool,
                    identities: Optional["Identities"]) -> Source:
    """The backup tarball (or a checkpoint's) at ``path``, read and checked as ``open_source`` says."""
    from etcd_agent.backup.keys import local_key

    if identities is not None:  # its plaintext never under the backup dir (copied off-host)
        from etcd_agent.pitr.workdirs import work_dir

        staging_parent = work_dir(cfg, True)
    arc = open_archive(path, staging_dir=staging_parent, hash_snapshot=hash_now, key=local_key(cfg).key,
                       identities=identities, need_plaintext=True)
    try:
        if arc.signature == "invalid":
            raise RefusedError(f"{path}: its manifest was changed after it was written (the signature does not "
                               "match); nothing touched. Restore another backup, or `backup import` the tarball "
                               "to have it checked from its content alone")
        m = arc.manifest
        snap, ident = arc.plaintext()
        claimed = None
        if m is not None and arc.signature == "valid":
            claimed = m.encryption.plaintext_sha256 if m.encryption is not None else m.files[m.snapshot_member].sha256
        lines = []
        if arc.sealed is not None:
            lines.append(f"encrypted ({arc.sealed.describe()}): decrypted with {arc.sealed.identity_file} into a "
                         "private staging dir on this master only; the other masters receive the plaintext over "
                         "their node sessions, into their 0700 work dirs")
        lines += list(arc.checked)
        if arc.signature in ("unsigned", "unknown-key") and m is not None:
            lines.append(f"manifest {arc.signature}: what it says is trusted for nothing; checked from the content")
        lines += [f"not checked here: {n}" for n in arc.not_checked]
        return Source(
            path=path, kind=arc.kind, size=snap.size, sha256=snap.sha256 or claimed,
            revision=ident.revision, etcd_version=m.etcd_version if m is not None else None,
            identity=ident, checked=tuple(lines), archive=arc,
        )
    except BaseException:
        arc.close()
        raise


def open_pitr_source(cfg: Config, spec: str, target: "Target", staging_parent: str, *,
                     progress: Callable[[str], None] = lambda s: None,
                     identities: Optional["Identities"] = None, checkpoints: bool = True,
                     accept_unsigned: bool = False, checked: Optional["CheckedChain"] = None,
                     meanwhile: Optional["Meanwhile"] = None, dry_run: bool = False,
                     members: Optional[bool] = None) -> Source:
    """The full backup ``spec`` names (``latest``: the newest at or before the target), its chain
    replayed to ``target`` (``newest``, a revision, an ISO time with its zone). The dry run
    replays too (nothing live is touched) and the result is removed when the restore ends.
    ``identities`` decrypt an encrypted full backup and its encrypted segments (into a private
    dir outside the backup dir, ``pitr.workdirs.private_dir``, removed once replayed). ``checkpoints`` False: the replay
    starts from the full backup whatever checkpoints its chain vouches for. ``accept_unsigned``:
    a chain not signed with the manifest key is restored (``--accept-unsigned-chain``). ``checked``:
    the chain as a restore from the bucket checked it, taken instead of checking it again while
    its files are the very ones checked (``pitr.carried.take``). ``meanwhile``: started once the
    chain and the full backup passed their checks (a refusal of the chain comes before any host is
    opened), its ``stop`` stops the replay at its next step (``restore.orchestrator.meanwhile``).
    ``members`` (default: ``[backup.delta] point_in_time_load``): no replay here - the source is
    the start snapshot itself, with the chain after it folding meanwhile (``Source.tail``), loaded
    into the restored members by the restore (``pitr.members``). ``dry_run``: hashed, not folded."""
    import shutil

    from etcd_agent.chain.errors import CheckpointUnusable
    from etcd_agent.pitr import carried, report, workdirs
    from etcd_agent.pitr import prepare as pitr
    from etcd_agent.pitr.members import Record, members_load

    parsed = target
    t0 = time.monotonic()
    timings: Dict[str, float] = {}
    # the check a restore from the bucket made, with the lock and the decrypted copies it kept
    # (released when not taken, before this run takes the lock itself)
    taken = carried.take(checked, cfg, spec, parsed, checkpoints=checkpoints, accept_unsigned=accept_unsigned,
                         progress=progress)
    # first: the staging of the segments below is this run's own
    held = taken.lock if taken is not None and taken.lock is not None else workdirs.lock(cfg)
    staging = (taken.private if taken is not None and taken.private is not None
               else workdirs.open_staging(cfg) if identities is not None else None)
    skip: Dict[str, str] = {}  # checkpoints the replay found unusable: prepared again without them
    into_members = members_load(cfg) if members is None else members
    tail_src: Optional[Source] = None
    try:
        try:  # the decrypted segments live only until the replay has run (or failed)
            while True:
                if taken is not None:
                    prep = taken.prepared
                    taken = None  # once: a second attempt (a checkpoint found unusable) checks again
                else:
                    prep = pitr.prepare(cfg, spec, parsed, identities=identities, staging=staging,
                                        checkpoints=checkpoints, skip=skip, accept_unsigned=accept_unsigned)
                timings["prepare"] = time.monotonic() - t0
                base = open_source(cfg, prep.entry, staging_parent, hash_now=dry_run and into_members,
                                   identities=identities)
                timings["full backup"] = time.monotonic() - t0 - timings["prepare"]
                try:
                    _chain_matches(prep, base)
                    if into_members:
                        rec = Record(prep.entry.name, prep.plan.stop_revision, checkpoints, accept_unsigned)
                        tail_src = _tail_source(cfg, prep, base, staging_parent, identities, staging, rec, dry_run,
                                                meanwhile, progress)
                        if tail_src.tail is not None:
                            staging = None  # the tail's now: removed once folded
                        break
                    st = prep.start
                    onto = (f"checkpoint {st.name} (revision {st.revision}, inside the chain of {prep.entry.name}; "
                            f"~{st.events_after} event(s) after it)" if st else prep.entry.name)
                    progress(f"replaying the delta chain onto {onto} up to revision {prep.plan.stop_revision} in a "
                             "throwaway etcd on loopback (nothing live is touched)")
                    if meanwhile is not None:  # the hosts opened and pre-checked while it replays
                        meanwhile.start(pitr.kept_path(cfg, prep, identities is not None))
                    t = time.monotonic()
                    path, res, reused = pitr.replay_kept(cfg, prep, identities,
                                                         stop=meanwhile.stop if meanwhile is not None else None)
                    timings["replay"] = time.monotonic() - t
                    timings.update((f"replay: {k}", v) for k, v in res.phases)
                    break
                except CheckpointUnusable as exc:
                    assert prep.start is not None
                    log.warning("%s; starting from an older checkpoint or the full backup instead", exc.message)
                    skip[prep.start.name] = exc.message
                    if staging is not None:  # the next prepare decrypts what it needs afresh
                        shutil.rmtree(staging, ignore_errors=True)
                        os.mkdir(staging, 0o700)
                finally:
                    if tail_src is None or tail_src.archive is not base.archive:
                        base.close()
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        if tail_src is not None:
            tail_src.lock = held
            tail_src.timings = timings
            return tail_src
        progress(f"reusing the replay an interrupted run of this restore left: {path}" if reused else
                 f"replayed {res.events_applied} event(s) in {res.replay_seconds:.1f}s: revision {res.reached_revision}")
        lines = report.describe(prep, res, reused=reused) + [f"full backup: {x}" for x in base.checked]
        lines += _encryption_lines(prep) + ([prep.signatures] if prep.signatures else [])
        t = time.monotonic()
        src = _replayed(path, res, base, lines)
        timings["hash"] = time.monotonic() - t
    except BaseException:
        held.release()
        raise
    src.lock = held
    src.timings = timings
    return src


def _tail_source(cfg: Config, prep: "Prepared", base: Source, staging_parent: str,
                 identities: Optional["Identities"], staging: Optional[str], rec: "Record", dry_run: bool,
                 meanwhile: Optional["Meanwhile"], progress: Callable[[str], None]) -> Source:
    """The start snapshot of ``prep`` as the source every member restores - the full backup
    ``base``, or the checkpoint the chain vouches for (CheckpointUnusable unless its sha256 and
    revision are the ones vouched for) - named by the tail record, with the chain after it
    folding meanwhile (``Tail``: it takes ``staging`` over). The sha256 the chain vouches for is
    the one the shipped bytes must hash to before any member keeps them."""
    from etcd_agent.chain.errors import CheckpointUnusable
    from etcd_agent.errors import AgentError
    from etcd_agent.pitr import report, workdirs
    from etcd_agent.pitr.members import Tail, record_path, write_record

    st = prep.start
    work = workdirs.work_dir(cfg, identities is not None)
    path = record_path(work, prep)
    if meanwhile is not None:  # the hosts opened and pre-checked while the snapshot is read
        meanwhile.start(path)
    onto = (f"checkpoint {st.name} (revision {st.revision}, inside the chain of {prep.entry.name})" if st
            else prep.entry.name)
    progress(f"restoring {onto} on every member; the delta chain after it up to revision {prep.plan.stop_revision} is "
             "folded meanwhile and written into the restored members once they serve (no throwaway etcd)")
    if st is None:
        src = base
    else:
        try:
            src = _archive_source(cfg, st.path, staging_parent, dry_run, identities)
        except (AgentError, OSError) as exc:
            msg = exc.message if isinstance(exc, AgentError) else str(exc)
            raise CheckpointUnusable(f"checkpoint {st.name} cannot be read: {msg}") from None
    tail: Optional[Tail] = None
    try:
        if src.identity is None:
            raise RefusedError(f"{src.path}: the snapshot's members could not be read; nothing touched")
        restored = max(1, src.revision or 0)
        first = prep.check.segments[0].header if prep.check.segments else None
        if st is not None:
            want: Optional[str] = st.checkpoint.sha256
            if restored != st.revision:
                raise CheckpointUnusable(f"checkpoint {st.name}: its snapshot is at revision {restored}, the chain "
                                         f"vouches for revision {st.revision}")
        else:  # the chain names its full backup's snapshot by sha256 (the one it continues)
            from_base = prep.entry.revision == prep.check.base_revision or restored == prep.check.base_revision
            want = first.base_sha256 if first is not None and first.base_sha256 and from_base else None
        if want and src.sha256 and src.sha256 != want:
            what = f"checkpoint {st.name}" if st is not None else os.path.basename(src.path)
            msg = (f"{what}: its snapshot is sha256 {src.sha256[:16]}..., the chain vouches for {want[:16]}...: "
                   "another backup's chain, or this file swapped or changed since; nothing touched")
            raise CheckpointUnusable(msg) if st is not None else RefusedError(msg)
        sha = src.sha256 or want  # unknown until shipped: then it must hash to what the chain vouches for
        lines = report.describe_tail(prep, restored)
        lines += [f"{'checkpoint' if st is not None else 'full backup'}: {x}" for x in src.checked]
        lines += _encryption_lines(prep) + ([prep.signatures] if prep.signatures else [])
        if not dry_run:
            tail = Tail(prep, restored, work, staging)
            write_record(path, rec)
        return dataclasses.replace(src, path=path, sha256=sha, checked=tuple(lines), tail=tail, record=path,
                                   remove_on_close=None, lock=None, tail_to=prep.plan.stop_revision)
    except BaseException:
        if tail is not None:
            tail.close()
        if src is not base:
            src.close()
        raise


def _kept_tail(cfg: Config, spec: str, staging_parent: str, identities: Optional["Identities"],
               dry_run: bool) -> Optional[Source]:
    """``--from`` naming the record of a point-in-time restore that loads its tail into the
    restored members (what its journals name): the same restore, prepared again from the record."""
    from etcd_agent.pitr.members import RECORD_SUFFIX, read_record
    from etcd_agent.pitr.replay import Target
    from etcd_agent.pitr.workdirs import in_work_dir

    path = os.path.abspath(spec)
    if not path.endswith(RECORD_SUFFIX) or not in_work_dir(cfg, path) or not os.path.isfile(path):
        return None
    rec = read_record(path)
    return open_pitr_source(cfg, rec.backup, Target.to_revision(rec.revision), staging_parent, identities=identities,
                            checkpoints=rec.checkpoints, accept_unsigned=rec.accept_unsigned, dry_run=dry_run,
                            members=True)


def _encryption_lines(prep: "Prepared") -> List[str]:
    sealed = [s.sealed for s in prep.plan.segments if s.sealed is not None]
    if not sealed:
        return []
    signed = {f.signature for f in sealed}
    return [f"point in time: {len(sealed)} encrypted segment(s) decrypted into a private staging dir (removed "
            f"once replayed), each authenticated chunk by chunk and checked whole; seals signed: "
            f"{', '.join(sorted(signed))}"]


def _kept_replay(cfg: Config, spec: str) -> Optional[Source]:
    """``--from`` naming a replay a crashed point-in-time restore left (its journal names it)."""
    from etcd_agent.pitr import prepare as pitr
    from etcd_agent.pitr import report, workdirs

    found = pitr.kept_result(cfg, spec)
    if found is None:
        return None
    path, res = found
    held = workdirs.lock(cfg)
    try:
        base = open_source(cfg, _base_of(cfg, path), os.path.dirname(path), hash_now=False)
        try:
            lines = report.describe(None, res, reused=True) + [f"full backup: {x}" for x in base.checked]
        finally:
            base.close()
        src = _replayed(path, res, base, lines)
    except BaseException:
        held.release()
        raise
    src.lock = held
    return src


def _base_of(cfg: Config, kept: str) -> str:
    name = os.path.basename(kept).rsplit(".to-", 1)[0]
    return os.path.join(cfg.backup.dir, name)


def _chain_matches(prep: "Prepared", base: Source) -> None:
    """Every segment used was captured from the cluster the full backup's signed manifest names."""
    m = base.archive.manifest if base.archive is not None else None
    if m is None or base.archive is None or base.archive.signature != "valid" or not m.cluster_id:
        return
    want = int(m.cluster_id, 16)
    other = sorted({f"{s.header.cluster_id:x}" for s in prep.plan.segments
                    if s.header.cluster_id and s.header.cluster_id != want})
    if other:
        raise RefusedError(f"the delta chain of {prep.entry.name} was captured from cluster {', '.join(other)}, "
                           f"the full backup is of cluster {m.cluster_id}; nothing touched")


def _replayed(path: str, res: "ReplayResult", base: Source, lines: List[str]) -> Source:
    from etcd_agent.etcd.snapdb import read_identity

    if base.identity is None:
        raise RefusedError(f"{base.path}: the full backup's members could not be read; nothing touched")
    h = hashlib.sha256()
    with open_regular(path) as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    replayed = read_identity(path)
    if replayed.revision != res.snapshot_revision:
        raise RefusedError(f"{path}: the replayed snapshot is at revision {replayed.revision}, the replay reported "
                           f"{res.snapshot_revision}; nothing touched")
    # the data is the replay's; whose it is, the full backup's members say (see the module doc)
    ident = dataclasses.replace(base.identity, last_revision=replayed.last_revision)
    lines.append(f"identity judged on the full backup's members ({len(base.identity.members)}); the replayed db "
                 "lists only the throwaway replay member")
    return Source(path=path, kind="agent", size=os.path.getsize(path), sha256=h.hexdigest(),
                  revision=res.snapshot_revision, etcd_version=base.etcd_version, identity=ident,
                  checked=tuple(lines), snapshot_path=path, remove_on_close=path)
