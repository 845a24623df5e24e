"""A replay carried out: a full snapshot plus its delta chain, replayed to a target, saved anew.

``replay(full_snapshot, segment_paths, target, output=...)``:

1. check the chain from the snapshot's revision (every segment read and verified; or take the
   check the caller just made) and decide the stop point (``replay.plan_replay``): the target,
   or the last good point before a gap, a damaged segment or a broken link - nothing after a
   gap is ever applied;
2. fold every revision up to the stop into the key space it leaves behind (``keyspace``: the
   last write per key, bounded in memory, spilled to a file in the replay's private dir),
   reading each segment verified again and checked to be the very bytes the chain check saw;
3. restore the snapshot into a throwaway loopback etcd (``scratch``) while 2 runs (the fold in
   a thread; the member started from the main thread, so that it dies with a killed run), its
   revision bumped past the chain's end (and a restore's margin beyond); once folded, grant the
   leases the chain's puts attached keys to, and write the key space's changes in large transactions - not one
   transaction per original revision: the store is at the target's state, with new revisions;
4. apply the lease rule (``leases``) at the stop point's time; if keys must go because their
   lease had expired by then, or must move to a lease with their remaining TTL (leases that
   came with the full snapshot cannot be given a new TTL in place), that is one more
   transaction, reported as ``fixup_revisions``;
5. ``snapshot save`` the result to ``output`` (0600), check it with ``snapshot status``.

What the restored data keeps (see docs/delta-segments.md, "What a replay keeps"): every key and
value at the target, the lease ids with the rule's TTLs; keys the chain never touched keep their
create/mod revision and version. A key the chain wrote gets a mod revision of the load (above any
revision of the original cluster, so no stale compare-and-swap can match it), its create
revision if the full snapshot held it, else the load's (in the original creation order), and a
version counted from the snapshot's.

Leases granted for the load keep their original ids and get the TTL they had left at the
target; a keep-alive stream holds every lease of the scratch store until the snapshot is saved,
so nothing expires on the scratch member's own clock.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from etcd_agent.chain.check import ChainCheck, check_chain
from etcd_agent.chain.errors import CheckpointUnusable, ReplayError, SegmentCorrupt
from etcd_agent.chain.reader import RawEvent, scan_segment
from etcd_agent.errors import RefusedError
from etcd_agent.etcd.client import free_share
from etcd_agent.pitr import keyspace
from etcd_agent.pitr.leasefix import LeaseKeeper
from etcd_agent.pitr.leases import MIN_TTL
from etcd_agent.pitr.loadtail import LOAD_BYTES, SCRATCH, Batches, Limits, replay_result, target_ms, write_tail
from etcd_agent.pitr.replay import Plan, ReplayResult, Target, find_base, plan_replay
from etcd_agent.scratch.machine import etcd_flags
from etcd_agent.scratch.member import ScratchEtcd, ScratchOptions, start_scratch

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities

log = logging.getLogger(__name__)

# the load's transactions built ahead while the throwaway member starts (their ops hold copies of
# the values: bounded beyond the key space's own memory)
PREBUILD_BYTES = 2 * LOAD_BYTES
# how far past the chain's end the loaded revisions start: the margin a restore bumps by
# (restore.plan.BUMP_REVISION), since the original may have gone on after the chain's end
LOAD_MARGIN = 1_000_000_000


# ---------------------------------------------------------------- replay


def _snapshot_file(full_snapshot: str, workdir: str,
                   identities: Optional["Identities"] = None) -> Tuple[str, Optional[str]]:
    """The snapshot db itself: a plain file as is; a backup tarball (the agent's or a runbook's)
    read with the one bounded reader, its snapshot staged in ``workdir`` and checked on the way
    (etcd's trailer, bbolt meta, the manifest's sizes and sha256); an encrypted one decrypted
    there with ``identities``. Returns (path, sha256 of its bytes as read; None for a bare db)."""
    from etcd_agent.backup.reader import open_archive
    from etcd_agent.backup.tarstream import sniff
    from etcd_agent.fs import open_regular

    with open_regular(full_snapshot, follow_symlinks=True) as fh:  # a full backup or a checkpoint: the backup dir's
        head = fh.read(512)
    if sniff(head) == "unknown":
        return full_snapshot, None  # a bare snapshot db
    arc = open_archive(full_snapshot, staging_dir=workdir, extract=True, need_plaintext=True, identities=identities)
    # the staged copy lives in the archive's private stage dir under workdir; move it out of it so
    # the caller owns one file (closing the archive removes the stage)
    dest = os.path.join(workdir, "full.db")
    try:
        src = arc.plaintext()[0]
        os.rename(src.path, dest)
    finally:
        arc.close()
    return dest, src.sha256


def _own_chain(full_snapshot: str, got: Optional[str], restored: int, check: ChainCheck, from_base: bool) -> None:
    """The chain names exactly this snapshot (the sha256 of the bytes just read) when it names
    one: the catalogue may not have known the backup's sha256 (no check recorded, no signed
    manifest) and matched the chain by time, or the file may have been swapped since it was
    checked; the content decides before anything is replayed. ``from_base``: the restore planned
    this snapshot as the chain's own full backup, so it is compared whatever revision it holds (a
    swapped one of another revision looks like a backup taken inside the chain); otherwise only
    when it is at the chain's base (a backup taken inside the chain is not the one it names)."""
    first = check.segments[0].header if check.segments else None
    if first is None or not first.base_sha256 or got is None or got == first.base_sha256:
        return
    if not from_base and check.base_revision != restored:
        return
    raise RefusedError(f"{os.path.basename(full_snapshot)}'s snapshot (revision {restored}) is sha256 {got[:16]}..., "
                       f"but the delta chain's first segment {os.path.basename(check.segments[0].disk_path)} names "
                       f"the full backup with snapshot sha256 {first.base_sha256[:16]}...: another backup's chain, or "
                       "this file swapped or changed since it was checked; nothing replayed, nothing touched")


def _as_planned(planned: Plan, plan: Plan, restored: int) -> None:
    """The replay's own plan (it checks the chain again when the check it was handed has another
    base) must be the one the operator was shown: else the restore would write another revision
    than asked - less, when the chain changed since - and report success."""
    reached = max(restored, plan.stop_revision)
    if (reached, plan.stop_revision, plan.complete, plan.base_revision) == (
            planned.stop_revision, planned.stop_revision, planned.complete, planned.base_revision):
        return
    raise ReplayError(f"the replay's own plan reaches revision {reached} from the chain after revision "
                      f"{plan.base_revision} ({plan.because}), the prepared plan revision {planned.stop_revision} "
                      f"from the chain after revision {planned.base_revision} ({planned.because}): the chain changed "
                      "since it was checked; nothing replayed")


def _checkpoint_file(path: str, workdir: str, identities: Optional["Identities"], sha256: str,
                     revision: int) -> str:
    """A checkpoint's snapshot, staged as ``_snapshot_file`` does, and only if it is what the chain
    vouches for: exactly that sha256 (of the bytes just read, not a manifest's claim) and that
    revision (read from its own db). Anything else: CheckpointUnusable, nothing kept."""
    from etcd_agent.errors import AgentError

    name = os.path.basename(path)
    try:
        snap, got = _snapshot_file(path, workdir, identities)
    except (AgentError, OSError) as exc:
        msg = exc.message if isinstance(exc, AgentError) else str(exc)
        raise CheckpointUnusable(f"checkpoint {name} cannot be read: {msg}") from None
    if got != sha256:
        raise CheckpointUnusable(f"checkpoint {name}: its snapshot's sha256 is {(got or 'unknown')[:16]}..., the chain "
                                 f"vouches for {sha256[:16]}...: not the backup the chain was taken with")
    rev = _snapshot_revision(snap)
    if rev != revision:
        raise CheckpointUnusable(f"checkpoint {name}: its snapshot is at revision {rev}, the chain vouches for "
                                 f"revision {revision}")
    return snap


def _snapshot_revision(path: str) -> int:
    """The snapshot's revision, read from its bbolt pages (what etcd serves once restored; an
    empty store's snapshot says 0 where the server says 1)."""
    from etcd_agent.errors import BackupCorrupt
    from etcd_agent.etcd.snapdb import read_identity

    try:
        return max(1, read_identity(path).revision)
    except (BackupCorrupt, OSError, ValueError) as exc:
        raise ReplayError(f"cannot read the revision of the full backup's snapshot {path}: {exc}") from None


def _check_bump(options: ScratchOptions) -> None:
    """The load needs etcdutl's --bump-revision (3.5.10+); say so before anything starts."""
    from etcd_agent.errors import CommandError
    from etcd_agent.etcd.tools import version_of
    from etcd_agent.etcd.versions import BUMP_MIN_ETCDUTL, can_bump
    from etcd_agent.hosts.local import LocalHost

    try:
        version = version_of(LocalHost(), options.binaries.etcdutl, tool=True)
    except CommandError as exc:
        if exc.result is None or not exc.result.ok:
            raise ReplayError(f"cannot run {options.binaries.etcdutl} version: {exc}") from None
        version = ""  # it ran, and named no version: said below as an unknown one
    if not can_bump(version):
        need = ".".join(str(x) for x in BUMP_MIN_ETCDUTL)
        raise ReplayError(
            f"a point-in-time replay needs etcdutl {need}+ (--bump-revision) for its throwaway member; "
            f"{options.binaries.etcdutl} is {version or 'of an unknown version'}"
        )


def replay(
    full_snapshot: str,
    segment_paths: Sequence[str],
    target: Target,
    *,
    output: str,
    options: Optional[ScratchOptions] = None,
    min_ttl: int = MIN_TTL,
    unknown_lease_ttl: int = 60,
    check: Optional[ChainCheck] = None,
    memory_bytes: int = keyspace.DEFAULT_MEMORY,
    identities: Optional["Identities"] = None,
    checkpoint: Optional[Tuple[str, int]] = None,
    stop: Optional[threading.Event] = None,
    planned: Optional[Plan] = None,
    from_base: bool = False,
) -> ReplayResult:
    """Replay ``segment_paths`` onto ``full_snapshot`` up to ``target``; save the result to
    ``output``. ``check``: the chain as the caller just checked it (its segments are verified
    again as they are read, and must be those very bytes). A broken chain is reported in the
    result (``complete`` False, ``lost_after``); other failures raise ReplayError / ScratchError.
    ``identities``: decrypt an encrypted full backup (its chain comes opened in ``check``).
    ``checkpoint``: ``full_snapshot`` is a checkpoint inside the chain, which vouches for its
    (snapshot sha256, revision); CheckpointUnusable if it is not exactly that (before anything
    is started), and the replay folds only the chain after it. ``stop``: once set, the replay
    ends after its current step, before the save (ReplayError; its member stopped, its dir gone):
    a restore whose hosts refused meanwhile. ``planned``: the plan the caller made and showed
    (``pitr.prepare``); a replay whose own plan is another is refused before anything is loaded.
    ``from_base``: ``full_snapshot`` is the full backup the chain continues (not one taken inside
    it): refused unless its bytes hash to the sha256 the chain names, whatever its revision."""
    t0 = time.monotonic()
    if os.path.exists(output):
        raise ReplayError(f"{output} exists; a replay never overwrites a file")
    options = options or ScratchOptions()
    work = tempfile.mkdtemp(prefix="etcd-replay-", dir=options.parent_dir)  # 0700
    lap = Laps(stop)
    # the two tools' checks run while the snapshot is staged and the chain folded
    probes = ThreadPoolExecutor(max_workers=2, thread_name_prefix="replay-probe")
    try:
        bump_ok = probes.submit(_check_bump, options)
        probes.submit(etcd_flags, options.binaries.etcd)
        got: Optional[str] = None
        if checkpoint is not None:
            snap = _checkpoint_file(full_snapshot, work, identities, *checkpoint)
        else:
            snap, got = _snapshot_file(full_snapshot, work, identities)
        if checkpoint is not None or got is not None:
            # staged by the backup reader, which hashed every byte and checked etcd's sha256
            # trailer on the way (and a checkpoint's sha256 is the one its chain vouches for):
            # etcdutl's own check would read the snapshot once more for nothing. A bare db keeps it
            options = dataclasses.replace(options, skip_hash_check=True)
        lap("stage")
        restored = _snapshot_revision(snap)
        base = find_base(segment_paths, restored)
        if check is None or check.base_revision != base:
            check = check_chain(segment_paths, base)
        _own_chain(full_snapshot, got, restored, check, from_base and checkpoint is None)
        plan = plan_replay(check, target)
        if planned is not None:
            _as_planned(planned, plan, restored)
        log.info("replaying %d segment(s) onto revision %d, stopping at %d (%s)", len(plan.segments), restored,
                 plan.stop_revision, plan.because)
        if restored < plan.base_revision:
            raise ReplayError(f"the snapshot is at revision {restored}, before its chain's base {plan.base_revision}")
        lap("plan")
        # the loaded keys get revisions above anything the original cluster may have reached (the
        # chain's end, and as far again as a restore's own bump allows for). Decided from the plan,
        # before the fold: a revision after the snapshot's holds events (the writer records none
        # without; a crafted one would only leave the result's revision higher, nothing loaded)
        bump = check.end_revision - restored + LOAD_MARGIN if plan.stop_revision > restored else 0
        with keyspace.KeySpace(work, memory_bytes=memory_bytes) as ks:
            # the chain is folded in a thread while this one restores and starts the throwaway
            # member (etcdutl's and etcd's processes): the fold's time is hidden behind theirs.
            # The member is started from this, the main thread: it then dies with a killed run
            folding = Folding(plan, restored, ks)
            s: Optional[ScratchEtcd] = None
            try:
                if bump:
                    bump_ok.result()  # a ReplayError before etcdutl is asked for what it cannot do
                lap("etcdutl version (its wait)")
                s = start_scratch(snap, options, name="replay", bump_revision=bump)
                lap("scratch restore and start")
                segs, fold_seconds, batches = folding.result()
                lap("fold (its wait)")
                lap.detail({"fold": fold_seconds}, "")  # its own time (and the load's first transactions built), hidden
                lap.detail(s.timings, "scratch: ")
                res = _run(s, plan, ks, batches, restored, bump, segs, output, t0, fold_seconds, min_ttl,
                           unknown_lease_ttl, lap)
            finally:
                folding.abandon()  # done already, unless something failed before it was
                if s is not None:
                    s.stop()
            lap("scratch stop")
        return dataclasses.replace(res, started_revision=restored, phases=lap.phases(),
                                   started_from=os.path.basename(full_snapshot) if checkpoint is not None else "")
    finally:
        probes.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(work, ignore_errors=True)


class Folding:
    """``_fold`` of the plan into ``ks`` in a thread of its own, then the load's first transactions
    built (``Batches.prebuild``: up to ``PREBUILD_BYTES``, and only while the key space is all in
    memory - its spill file is not read from two threads); ``result()`` waits for it: (segments
    used, seconds, the load's transactions); ``abandon()`` stops the fold at its next revision
    and waits for that."""

    def __init__(self, plan: Plan, restored: int, ks: keyspace.KeySpace, limits: Limits = SCRATCH) -> None:
        self._cancel = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-fold")
        self._fut = self._pool.submit(self._run, plan, restored, ks, limits)
        self._pool.shutdown(wait=False)

    def _run(self, plan: Plan, restored: int, ks: keyspace.KeySpace, limits: Limits) -> Tuple[int, float, "Batches"]:
        t = time.monotonic()
        used = _fold(plan, restored, ks, self._cancel)
        batches = Batches(ks, restored, limits)
        if not ks.spilled:
            batches.prebuild(PREBUILD_BYTES)
        return used, time.monotonic() - t, batches

    def result(self) -> Tuple[int, float, "Batches"]:
        return self._fut.result()

    def abandon(self) -> None:
        self._cancel.set()
        with contextlib.suppress(BaseException):
            self._fut.result()


class Laps:
    """Where a replay's time goes: ``lap(name)`` adds the seconds since the previous lap to
    ``name``; ``detail`` names a dict of finer steps timed elsewhere (the scratch member's),
    read when the phases are taken. Each lap is also where a set ``stop`` ends the replay, until
    ``stop`` is dropped (the save: a result written is kept, and reused by the next run)."""

    def __init__(self, stop: Optional[threading.Event] = None) -> None:
        self._t = time.monotonic()
        self._seconds: Dict[str, float] = {}
        self._detail: List[Tuple[str, Dict[str, float]]] = []
        self.stop = stop

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self._seconds[name] = self._seconds.get(name, 0.0) + now - self._t
        self._t = now
        if self.stop is not None and self.stop.is_set():
            raise ReplayError(f"the replay was stopped after its step {name!r}: the restore was refused meanwhile")

    def detail(self, timings: Dict[str, float], prefix: str) -> None:
        self._detail.append((prefix, timings))

    def phases(self) -> Tuple[Tuple[str, float], ...]:
        out = dict(self._seconds)
        for prefix, timings in self._detail:
            out.update((f"{prefix}{k}", v) for k, v in timings.items())
        return tuple((k, round(v, 3)) for k, v in out.items())  # as the result's JSON keeps them


def _fold(plan: Plan, restored: int, ks: keyspace.KeySpace, cancel: Optional[threading.Event] = None) -> int:
    """Every revision after the snapshot up to the stop, read from verified segments, folded into
    ``ks``. Returns the segments used.

    Each segment is read and checked whole again (``scan_segment``: as strictly as
    ``read_segment``, digest first) and must be the very bytes the chain check saw; its
    revisions go straight from the scan into the key space, no Txn/Event objects between."""
    used = 0
    stop = plan.stop_revision

    def sink(rev: int, _time_ms: int, _flags: int, evs: Optional[List[RawEvent]]) -> None:
        if cancel is not None and cancel.is_set():
            raise ReplayError("the replay was abandoned while it folded the chain")
        if restored < rev <= stop:
            assert evs is not None
            ks.apply_raw(rev, evs)

    for info in plan.segments:
        if info.end_revision <= restored:
            continue
        try:
            got = scan_segment(info.path, sink)
        except SegmentCorrupt as exc:  # as replay.reread says it
            raise ReplayError(f"{exc.message} (it verified a moment ago: changed during the replay?)") from None
        checked = info.content_sha256  # an opened encrypted segment: its plaintext copy's
        if checked and got.sha256 != checked:
            raise ReplayError(f"{info.path} changed since the chain was checked (sha256 {got.sha256[:12]}, "
                              f"checked {checked[:12]})")
        used += 1
    want = max(restored, plan.stop_revision)
    got_rev = ks.last_revision or restored
    if got_rev != want:
        raise ReplayError(f"replay ended at revision {got_rev}, expected {want}")
    return used


DEFRAGMENT_FREE_SHARE = 0.5  # the replayed db is defragmented when more than this share of it is free pages


def _worth_defragmenting(size: int, in_use: int) -> bool:
    """Whether the replayed db's free pages (``size - in_use`` of ``size`` bytes) are worth a
    defragmentation: more than ``DEFRAGMENT_FREE_SHARE`` of the file. A status that makes no sense
    (in use more than the file, nothing in use) is defragmented, as before this rule."""
    share = free_share(size, in_use)
    return share is None or share > DEFRAGMENT_FREE_SHARE


def _run(
    s: ScratchEtcd,
    plan: Plan,
    ks: keyspace.KeySpace,
    batches: Batches,
    restored: int,
    bump: int,
    segments_applied: int,
    output: str,
    t0: float,
    fold_seconds: float,
    min_ttl: int,
    unknown_ttl: int,
    lap: Optional["Laps"] = None,
) -> ReplayResult:
    lap = lap or Laps()
    lap("scratch restore and start")
    rpc = s.rpc
    at_ms = target_ms(plan)
    start_rev = rpc.header().revision
    if start_rev != restored + bump:
        raise ReplayError(f"the scratch member starts at revision {start_rev}, expected {restored + bump}")
    keeper = LeaseKeeper(rpc)
    try:
        w = write_tail(rpc, plan, ks, batches, start_rev=start_rev, at_ms=at_ms, min_ttl=min_ttl,
                       unknown_ttl=unknown_ttl, keeper=keeper, lap=lap)
        final = rpc.header().revision
        # keeps the saved db lean (the snapshot's overwritten values go); at final - 1, so the
        # newest revision's own events (a delete's tombstone) stay and `snapshot status` names it
        if final - 1 > start_rev:
            rpc.compact(final - 1, physical=True)
        lap("compact")
        # and without the free pages the full backup or checkpoint brought along (a cluster's db
        # file only grows: compaction frees pages, only a defragmentation gives them back): every
        # member then ships, restores and starts only the data. A db mostly in use (a lean
        # checkpoint and a short tail) is not rewritten: copying its data costs more than
        # shipping its few free pages (docs/delta-segments.md, "The replayed db defragmented only when mostly free")
        size, in_use = rpc.db_sizes()
        worth = _worth_defragmenting(size, in_use)
        if worth:
            rpc.defragment(timeout=600.0)
        lap("defragment" if worth else "defragment skipped (mostly in use)")
        log.info("replayed db: %d bytes, %d in use: %s", size, in_use,
                 "defragmented" if worth else "not defragmented (mostly in use)")
        # no `snapshot status` (another process reading the whole db): the revision is read from
        # the saved db's own pages, as the restore reads it again before shipping it
        lap.stop = None  # from here the replay ends whole: a stop now would only waste it
        s.save(output)
        saved = _snapshot_revision(output)
        lap("save")
    finally:
        keeper.close()
    if saved != final:
        raise ReplayError(f"the saved snapshot is at revision {saved}, expected {final}")
    return replay_result(plan, ks, w, restored=restored, segments=segments_applied, at_ms=at_ms,
                         fold_seconds=fold_seconds, snapshot_path=output, snapshot_revision=saved,
                         seconds=time.monotonic() - t0)


