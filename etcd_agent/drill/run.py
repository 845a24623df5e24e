"""Restore drills: a backup restored into a throwaway etcd on loopback and checked against itself.

A backup nobody has restored is a hope. A drill restores one (``latest`` by default, ``--from``
as ``restore --from`` resolves it) into ``delta.scratch``'s throwaway single-member etcd - its
own random loopback ports, its own 0700 dir under ``[drill] dir``, a fresh token, run as
``[etcd] user`` at ``[drill] nice``/``ionice`` with ``gomaxprocs`` cores - and never talks to the
live member. It checks, in order, and stops at the first failure with one sentence saying why:

1. the archive, through the one bounded reader, hashed in full: every sha256 against the
   manifest (a claim of the writer's when the signature is valid, worth nothing otherwise),
   etcd's own sha256 trailer, the bbolt meta pages, the snapshot's identity from its own db;
2. ``snapshot status`` of the staged snapshot (bbolt's page check): its revision and entry count
   must be those this agent reads from the db, and those the signed manifest claims;
3. the restore (``snapshot restore``, as etcd itself verifies the trailer) and the start;
4. the restored member, at the snapshot's revision: the revision it serves, its leases, every key
   (keys only, paged) as a count and an order-free digest of key, create and mod revision,
   version and lease, and a random sample of values;
5. the same from the snapshot file offline (``etcd/snapkeys``, with no etcd involved): the count,
   the digest and the sampled records must be equal.

Then the member is stopped and its dir removed. What passed is printed as ``ok:`` lines, what a
drill cannot prove as ``not proven:``; the result is kept per backup (``backup list``), in this
host's state and metrics (``drillrecord``), and in the check cache: a drill that read every byte
makes the file verified, one whose archive failed the reader quarantines it (as ``backup verify``
does); a failure of etcd or the tools is the drill's, never held against the file.

The drill's own work (hashing, the offline scan) runs at the same low priority (``drillhost``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import shutil
import socket
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional, Tuple

from etcd_agent.backup import checks
from etcd_agent.backup.checks import SYSTEM_WALL_CLOCK, WallClock
from etcd_agent.config import Config
from etcd_agent.drill import record as drillrecord
from etcd_agent.drill.host import LOCK, STAGE_PREFIX, lowered_priority, prepare_dir, sweep
from etcd_agent.drill.report import DrillFailed, DrillReport
from etcd_agent.drill.served import compare, read_member
from etcd_agent.errors import (
    AgentError,
    BackupCorrupt,
    IdentityRefused,
    Interrupted,
    RefusedError,
    UsageError,
)
from etcd_agent.state.locks import OperationLock

if TYPE_CHECKING:  # pragma: no cover - the age code only for an encrypted backup
    from etcd_agent.age import Identities

log = logging.getLogger(__name__)

SPACE_MARGIN = 64 << 20


# ---------------------------------------------------------------- the drill


def run_drill(
    cfg: Config,
    spec: str = "latest",
    *,
    clock: WallClock = SYSTEM_WALL_CLOCK,
    cancel: Optional[Callable[[], bool]] = None,
    rng: Optional[random.Random] = None,
    progress: Optional[Callable[[str], None]] = None,
    identities: Optional["Identities"] = None,
) -> DrillReport:
    """Drill the backup ``spec`` names; the report says what passed, or why not. ``identities``
    decrypt an encrypted backup (without them its drill fails, saying what it needs).

    Raises BusyError (another drill on this host: nothing done), and UsageError / RefusedError
    for a ``spec`` other than ``latest`` that names no usable backup, or identities that open no
    backup (the caller's mistake, not a failed drill); every other problem is a failed drill,
    recorded and returned."""
    d = _Drill(cfg, spec, clock, cancel, rng or random.Random(secrets.randbits(64)), progress, identities)
    try:
        prepare_dir(cfg.drill.dir)
    except RefusedError as exc:  # a drill that cannot run proves nothing: it fails, and says why
        d.report.step, d.report.problem = "preparing its dir", exc.message
        log.warning("restore drill failed while preparing its dir: %s", exc.message)
        d.keep()
        return d.report
    with OperationLock(os.path.join(cfg.drill.dir, LOCK), "drill"):
        for n in sweep(cfg.drill.dir):
            log.info("removed %s left in %s by a drill that died", n, cfg.drill.dir)
        with lowered_priority(cfg.drill.nice, cfg.drill.ionice):
            d.run()
    if not d.report.interrupted:
        d.keep()
    return d.report


class _Drill:
    def __init__(self, cfg: Config, spec: str, clock: WallClock, cancel: Optional[Callable[[], bool]],
                 rng: random.Random, progress: Optional[Callable[[str], None]],
                 identities: Optional["Identities"] = None) -> None:
        self.cfg = cfg
        self.identities = identities
        self.spec = spec
        self.clock = clock
        self.cancel = cancel
        self.rng = rng
        self.say = progress or (lambda s: None)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + cfg.drill.timeout
        self.member = self._local_member()
        self.user = cfg.drill.user or cfg.etcd.user
        self.report = DrillReport(spec=spec, started=clock.now().timestamp(), host=self.member or socket.gethostname())
        self.entry: Any = None
        self.before: Optional[os.stat_result] = None
        self.arc: Any = None
        self.ident: Any = None

    def _local_member(self) -> Optional[str]:
        from etcd_agent.locality import local_members

        if self.cfg.local.name is not None:  # the daemon's own member, or [local] name
            return self.cfg.local.name
        try:
            found = local_members(self.cfg)
        except AgentError:
            return None
        return found[0].name if found else None

    # -- time

    def left(self) -> float:
        rest = self.deadline - time.monotonic()
        if rest <= 0:
            raise DrillFailed(f"it ran past its timeout ([drill] timeout = {self.cfg.drill.timeout:g}s)")
        return rest

    def check(self) -> None:
        if self.cancel is not None and self.cancel():
            raise Interrupted("the drill was interrupted (the agent is stopping)")
        self.left()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.check()
        self.report.step = what
        self.say(what)
        t = time.monotonic()
        try:
            yield
        finally:
            self.report.steps[what] = time.monotonic() - t

    # -- the run

    def run(self) -> None:
        r = self.report
        scratch: Any = None
        stage: Optional[str] = None
        try:
            try:
                with self.step("resolving the backup"):
                    self.resolve()
            except (UsageError, RefusedError) as exc:
                if self.spec != "latest":
                    raise  # the caller named no usable backup: their mistake, not a failed drill
                raise DrillFailed(exc.message) from None  # no good backup at all: the backups are wrong
            stage = tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=self.cfg.drill.dir)
            with self.step("reading the archive"):
                self.read(stage)
            with self.step("checking the snapshot offline"):
                status, entries = self.snapshot_status()
            with self.step("restoring and starting etcd"):
                scratch = self.start()
            with self.step("reading the restored member"):
                api = read_member(scratch, entries, self.expected_revision(), self.report, self.cfg.drill.sample_keys,
                                  self.rng, self.check)
            with self.step("stopping the restored member"):
                where = scratch.dir
                scratch.stop()
                scratch = None
                if os.path.exists(where):
                    raise DrillFailed(f"the scratch dir {where} is still there after the member stopped")
                r.checked.append("the throwaway member stopped, its dir removed")
            with self.step("comparing with the snapshot file"):
                compare(api, self.report, self.arc, self.ident, self.check)
            r.ok = True
            r.step = "done"
        except Interrupted:
            r.interrupted = True
        except DrillFailed as exc:
            r.problem = _sentence(exc)
            r.content_failure = exc.content
        except (UsageError, RefusedError):
            raise
        except AgentError as exc:  # etcd would not restore or start, a tool failed, etcd did not answer
            r.problem = _sentence(exc)
        finally:
            if scratch is not None:
                scratch.stop()
            if self.arc is not None:
                self.arc.close()
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)
            r.duration = time.monotonic() - self.t0
        name = r.backup or f"--from {self.spec}"
        if r.ok:
            log.info("restore drill of %s passed in %.1fs: revision %s, %s keys, %s sampled", name, r.duration,
                     r.revision, r.keys, r.sample)
        elif not r.interrupted:
            log.warning("restore drill of %s failed while %s: %s", name, r.step, r.problem)

    def resolve(self) -> None:
        from etcd_agent.backup.catalog import resolve_from

        entry = resolve_from(self.cfg, self.spec)
        self.entry = entry
        self.report.backup, self.report.path = entry.name, entry.path
        self.before = os.stat(entry.path)

    def read(self, stage: str) -> None:
        from etcd_agent.backup.keys import local_key
        from etcd_agent.backup.reader import open_archive

        r = self.report
        size = self.before.st_size if self.before is not None else 0
        free = shutil.disk_usage(self.cfg.drill.dir).free
        if free < 2 * size + SPACE_MARGIN:
            raise DrillFailed(f"not enough space in {self.cfg.drill.dir} for a drill of the {size}-byte backup "
                              f"({free} bytes free; about twice the snapshot is needed)")
        try:
            self.arc = open_archive(self.entry.path, staging_dir=stage, hash_snapshot=True,
                                    key=local_key(self.cfg).key, extract=True, identities=self.identities)
        except IdentityRefused:
            raise  # the key given opens nothing here (or is open to others): the caller's mistake
        except (BackupCorrupt, RefusedError) as exc:
            if isinstance(exc, RefusedError) and exc.message.startswith("not enough space"):
                raise DrillFailed(exc.message) from None
            raise DrillFailed(f"the archive is bad: {exc.details[0] if exc.details else exc.message}",
                              content=True) from None
        a = self.arc
        r.kind, r.signature = a.kind, a.signature
        if a.signature == "invalid":
            raise DrillFailed("its manifest was changed after it was signed (signature invalid)", content=True)
        r.checked += list(a.checked)
        r.not_proven += [n for n in a.not_checked if not n.startswith("manifest signature INVALID")]
        self.ident = a.identity
        if a.snapshot is None and a.sealed is not None:
            # the masters hold only the public keys: the daemon's drill (or one by hand without
            # the key) checked the ciphertext above, and cannot restore what it cannot read
            raise DrillFailed(f"its snapshot is encrypted ({a.sealed.describe()}) and this drill has no key to open "
                              f"it: run `etcd-agent drill --from {self.entry.name} --identity FILE` with the secret "
                              "key of one of its recipients, where such a key is kept")

    def snapshot_status(self) -> Tuple[Dict[str, Any], Dict[str, int]]:
        from etcd_agent.etcd.snapdb import read_identity
        from etcd_agent.etcd.tools import snapshot_status
        from etcd_agent.hosts.local import LocalHost
        from etcd_agent.state.pins import pinned_config

        r, a, ident = self.report, self.arc, self.ident
        pcfg = pinned_config(self.cfg, self.member) if self.member else self.cfg
        try:
            st = snapshot_status(LocalHost(), pcfg, a.snapshot.path, timeout=min(600.0, self.left()))
        except BackupCorrupt as exc:
            raise DrillFailed(exc.message.replace(a.snapshot.path, "the staged snapshot")) from None
        counted = read_identity(a.snapshot.path, count_entries=True)
        entries = dict(counted.bucket_entries or ())
        total = sum(entries.values())
        if st.get("revision") != ident.revision:
            raise DrillFailed(f"`snapshot status` says revision {st.get('revision')}, the snapshot's db holds "
                              f"{ident.revision}")
        if st.get("totalKey") != total:
            raise DrillFailed(f"`snapshot status` counts {st.get('totalKey')} entries, this agent's reader of the "
                              f"db counts {total}")
        r.checked.append(f"`snapshot status` (bbolt's own page check): revision {ident.revision}, {total} entries, "
                         f"hash {st.get('hash')} - the revision and entry count this agent reads from the db")
        m = a.manifest
        if m is not None and a.signature == "valid":
            if m.revision != ident.revision:
                raise DrillFailed(f"the signed manifest says revision {m.revision}, the snapshot holds {ident.revision}")
            claim = m.snapshot.get("status") if isinstance(m.snapshot, dict) else None
            if isinstance(claim, dict):
                for k in ("revision", "totalKey", "hash"):
                    if claim.get(k) != st.get(k):
                        raise DrillFailed(f"the signed manifest recorded `snapshot status` {k} {claim.get(k)}, "
                                          f"the snapshot gives {st.get(k)}", content=True)
                r.checked.append("revision, entry count and hash equal the `snapshot status` the signed manifest "
                                 "recorded when the backup was written")
            else:
                r.checked.append(f"revision {ident.revision} is the one the signed manifest claims")
                # the writer streams the snapshot into the archive and never has it as a file of its
                # own (backups written before 2026-12 recorded one for compressed archives: held above)
                r.not_proven.append("the writer recorded no `snapshot status` (it checks the stream instead): its key "
                                    "count and hash are the snapshot's own (the signed sha256 stands for its bytes)")
        else:
            r.not_proven.append(f"revision, entry count and hash are the snapshot's own (`snapshot status`, its db): "
                                f"{'no manifest' if m is None else 'the manifest is ' + str(a.signature)}, "
                                "so no signed claim to hold them against")
        return st, entries

    def start(self) -> Any:
        from etcd_agent.errors import CommandError
        from etcd_agent.etcd.tools import version_of
        from etcd_agent.hosts.local import LocalHost
        from etcd_agent.scratch.member import EtcdBinaries, ScratchOptions, start_scratch
        from etcd_agent.state.pins import pinned_config

        r, dr = self.report, self.cfg.drill
        pcfg = pinned_config(self.cfg, self.member) if self.member else self.cfg
        e = pcfg.etcd
        try:
            version = version_of(LocalHost(), e.binary, timeout=min(30.0, self.left()))
        except (CommandError, OSError) as exc:
            raise DrillFailed(f"cannot run {e.binary}: {getattr(exc, 'message', exc)}") from None
        r.etcd_version = version
        free = shutil.disk_usage(dr.dir).free
        need = int(self.arc.snapshot.size * 1.2) + SPACE_MARGIN
        if free < need:
            raise DrillFailed(f"not enough space in {dr.dir} to restore the {self.arc.snapshot.size}-byte snapshot "
                              f"({free} bytes free, {need} needed)")
        opts = ScratchOptions(
            binaries=EtcdBinaries(etcd=e.binary, etcdutl=e.etcdutl or e.etcdctl, etcdctl=e.etcdctl),
            parent_dir=dr.dir, user=self.user, nice=dr.nice or None,
            ionice=None if dr.ionice == "none" else dr.ionice, gomaxprocs=dr.gomaxprocs or None,
            start_timeout=min(120.0, self.left()), restore_timeout=self.left(),
            # --unsafe-no-fsync came with 3.5; a throwaway member's writes need no fsync
            unsafe_no_fsync=_at_least(version, (3, 5, 0)),
            quota_bytes=max(8 << 30, 2 * self.arc.snapshot.size),
            # a db copied from a data dir has no trailer for the restore to verify
            skip_hash_check=not self.ident.has_trailer,
        )
        s = start_scratch(self.arc.snapshot.path, opts, name="drill")
        import pwd

        uid = os.stat(s.data_dir).st_uid
        try:
            who = pwd.getpwuid(uid).pw_name
        except KeyError:
            who = f"uid {uid}"
        r.run_as, r.endpoint = who, s.endpoint
        prio = [f"nice {dr.nice}" if dr.nice else "", f"ionice {dr.ionice}" if dr.ionice != "none" else "",
                f"GOMAXPROCS={dr.gomaxprocs}" if dr.gomaxprocs else ""]
        r.checked.append(f"restored (`snapshot restore`{'' if self.ident.has_trailer else ', no trailer to verify'}) "
                         f"and started: etcd {version} as {who} on {s.endpoint}, "
                         f"{', '.join(p for p in prio if p) or 'normal priority'}, in its own dir {s.dir}")
        if self.user != who:
            r.not_proven.append(f"that it starts as {self.user}: it ran as {who}")
        if not self.ident.has_trailer:
            r.not_proven.append("the snapshot has no sha256 trailer (a db copied from a data dir): etcd could not "
                                "verify it on restore")
        return s

    def expected_revision(self) -> int:
        """The revision a member restored from the snapshot serves: the last one in its key bucket;
        never below a compaction point the db records (etcd's store revision is at least that)."""
        i = self.ident
        rev = max(i.revision, i.finished_compact_revision or 0, i.scheduled_compact_revision or 0)
        return rev or 1  # an empty store starts at revision 1

    # -- what is kept

    def keep(self) -> None:
        r = self.report
        rec = r.record()
        if self.entry is not None and self.before is not None:
            d = os.path.dirname(os.path.abspath(self.entry.path))
            if d == os.path.abspath(self.cfg.backup.dir):
                drillrecord.record_backup(d, self.entry.path, rec, self.before)
                self._check_cache(d)
        drillrecord.record_host(self.cfg, rec)

    def _check_cache(self, d: str) -> None:
        """A drill that read every byte is a check of the file; an archive the reader refused is
        quarantined; anything else (etcd, the tools, the space) is not held against the file."""
        r, before = self.report, self.before
        assert before is not None and self.entry is not None
        if not (r.ok or r.content_failure):
            return
        try:
            if checks.stamp_of(os.stat(self.entry.path)) != checks.stamp_of(before):
                return
        except OSError:
            return
        a, ident = self.arc, self.ident
        c = checks.Check(stamp=checks.stamp_of(before), ok=r.ok, how="drill", at=r.started,
                         kind=r.kind or self.entry.kind, revision=ident.revision if ident is not None else None,
                         sha256=a.snapshot.sha256 if a is not None else None,
                         member_ids=tuple(m.id_hex for m in ident.members) if ident is not None else (),
                         problem=None if r.ok else r.problem, signature=r.signature)
        checks.record(d, self.entry.name, c)


def _at_least(version: str, want: Tuple[int, int, int]) -> bool:
    from etcd_agent.etcd.versions import parse

    try:
        return parse(version).key >= want
    except ValueError:
        return False


def _sentence(exc: AgentError) -> str:
    """One line: the message, with the first detail when the message alone says too little."""
    msg = exc.message.rstrip(".")
    if exc.details and len(msg) < 60:
        msg += f" ({exc.details[-1].strip()[:200]})"
    return msg
