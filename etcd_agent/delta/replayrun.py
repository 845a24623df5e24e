"""A replay carried out: a full snapshot plus its delta chain, replayed to a target, saved anew.

``replay(full_snapshot, segment_paths, target, output=...)``:

1. check the chain from the snapshot's revision (every segment read and verified) and decide the
   stop point (``replay.plan_replay``): the target, or the last good point before a gap, a
   damaged segment or a broken link - nothing after a gap is ever applied;
2. restore the snapshot into a throwaway loopback etcd (``scratch``) and replay, one
   transaction per original revision, so the replayed store has the same revisions (every
   transaction's new revision is checked against the original; any divergence stops the
   replay with an error instead of producing a subtly different store);
3. apply the lease rule (``leases``) at the stop point's time; if keys must go because their
   lease had expired by then, or must move to a lease with their remaining TTL (leases that
   came with the full snapshot cannot be given a new TTL in place), that is one more
   transaction after the stop revision, reported as ``fixup_revisions``;
4. ``snapshot save`` the result to ``output`` (0600), check it with ``snapshot status``.

Leases granted during the replay keep their original ids and get the TTL they had left at the
target; a keep-alive stream holds every lease of the scratch store until the snapshot is saved,
so nothing expires on the scratch member's own clock.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

from etcd_agent.errors import EtcdError
from etcd_agent.etcd.pb.rpc_pb2 import RequestOp

from . import proto
from .errors import ReplayError
from .leases import MIN_TTL, LeaseFate, fate_of, lease_fates
from .replay import LeaseOutcome, Plan, ReplayResult, Target, find_base, plan_replay, reread
from .rpc import EtcdRpc, KeepAliveStream
from .scratch import ScratchEtcd, ScratchOptions, scratch_etcd
from .segchain import check_chain
from .segments import PUT, LeaseRecord, Txn, ms_to_datetime

log = logging.getLogger(__name__)

FIXUP_CHUNK = 10000


# ---------------------------------------------------------------- lease keeping during replay


class _LeaseKeeper:
    """Keeps every lease of the scratch store alive until the snapshot is saved: each is renewed
    when a third of its TTL has passed (checked every 0.25 s)."""

    def __init__(self, rpc: EtcdRpc) -> None:
        self._ka: KeepAliveStream = rpc.keepalive()
        self._ttl: Dict[int, int] = {}
        self._renewed: Dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delta-lease-keeper", daemon=True)
        self._thread.start()

    def hold(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            self._ttl[lease_id] = max(1, ttl)
            self._renewed[lease_id] = time.monotonic()

    def release(self, lease_id: int) -> None:
        with self._lock:
            self._ttl.pop(lease_id, None)
            self._renewed.pop(lease_id, None)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                due = [lid for lid, ttl in self._ttl.items() if now - self._renewed[lid] >= ttl / 3.0]
                for lid in due:
                    self._renewed[lid] = now
            if due:
                self._ka.renew(due)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ka.close()


# ---------------------------------------------------------------- replay


def _snapshot_file(full_snapshot: str, workdir: str) -> str:
    """The snapshot db itself: a plain file as is; a backup tarball (the agent's or a runbook's)
    read with the one bounded reader, its snapshot staged in ``workdir`` and checked on the way
    (etcd's trailer, bbolt meta, the manifest's sizes and sha256)."""
    from etcd_agent.backup.reader import open_archive
    from etcd_agent.backup.tarstream import sniff

    with open(full_snapshot, "rb") as fh:
        head = fh.read(512)
    if sniff(head) == "unknown":
        return full_snapshot  # a bare snapshot db
    # an encrypted full backup needs its identity; replay takes none yet, so it is refused here
    arc = open_archive(full_snapshot, staging_dir=workdir, extract=True, need_plaintext=True)
    # the staged copy lives in the archive's private stage dir under workdir; move it out of it so
    # the caller owns one file (closing the archive removes the stage)
    dest = os.path.join(workdir, "full.db")
    try:
        os.rename(arc.plaintext()[0].path, dest)
    finally:
        arc.close()
    return dest


def replay(
    full_snapshot: str,
    segment_paths: Sequence[str],
    target: Target,
    *,
    output: str,
    options: Optional[ScratchOptions] = None,
    min_ttl: int = MIN_TTL,
    unknown_lease_ttl: int = 60,
    compact_every: int = 10000,
) -> ReplayResult:
    """Replay ``segment_paths`` onto ``full_snapshot`` up to ``target``; save the result to
    ``output``. A broken chain is reported in the result (``complete`` False, ``lost_after``);
    other failures raise ReplayError / ScratchError."""
    t0 = time.monotonic()
    if os.path.exists(output):
        raise ReplayError(f"{output} exists; a replay never overwrites a file")
    options = options or ScratchOptions()
    work = tempfile.mkdtemp(prefix="etcd-replay-", dir=options.parent_dir)
    try:
        snap = _snapshot_file(full_snapshot, work)
        with scratch_etcd(snap, options, name="replay") as s:
            rpc = s.rpc
            restored = rpc.header().revision
            base = find_base(segment_paths, restored)
            check = check_chain(segment_paths, base)
            plan = plan_replay(check, target)
            log.info("replaying %d segment(s) onto revision %d, stopping at %d (%s)", len(plan.segments), restored,
                     plan.stop_revision, plan.because)
            return _run(s, plan, restored, output, t0, min_ttl, unknown_lease_ttl, compact_every)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(
    s: ScratchEtcd,
    plan: Plan,
    restored: int,
    output: str,
    t0: float,
    min_ttl: int,
    unknown_ttl: int,
    compact_every: int,
) -> ReplayResult:
    rpc = s.rpc
    if restored < plan.base_revision:
        raise ReplayError(f"the snapshot is at revision {restored}, before its chain's base {plan.base_revision}")
    at_ms = plan.stop_time_ms if plan.stop_time_ms is not None else int(time.time() * 1000)
    keeper = _LeaseKeeper(rpc)
    try:
        present: Dict[int, int] = {}  # lease id -> granted TTL in the scratch store
        snapshot_leases: Set[int] = set()
        for lid in rpc.lease_list():
            granted = rpc.lease_ttl(lid).granted_ttl
            present[lid] = granted
            snapshot_leases.add(lid)
            keeper.hold(lid, granted)
        t_replay = time.monotonic()
        applied_ev = applied_rev = applied_seg = 0
        fates_cache: Dict[int, LeaseFate] = {}
        records: Dict[int, List[LeaseRecord]] = {}
        for rec in plan.records:
            records.setdefault(rec.lease_id, []).append(rec)
        last_rev = compacted = restored
        for info in plan.segments:
            if info.end_revision <= restored:
                continue
            seg = reread(info)
            applied_seg += 1
            for txn in seg.txns:
                if txn.revision <= restored:
                    continue
                if txn.revision > plan.stop_revision:
                    break
                _apply(rpc, txn, present, fates_cache, records, at_ms, min_ttl, unknown_ttl, keeper)
                applied_ev += len(txn.events)
                applied_rev += 1
                last_rev = txn.revision
                if compact_every and applied_rev % compact_every == 0:
                    # keeps the scratch db lean; at last_rev - 1, so the newest revision's own
                    # events (a delete's tombstone) stay and `snapshot status` still names it
                    if last_rev - 1 > compacted:
                        rpc.compact(last_rev - 1)
                        compacted = last_rev - 1
        if last_rev != max(restored, plan.stop_revision) and plan.stop_revision > restored:
            raise ReplayError(f"replay ended at revision {last_rev}, expected {plan.stop_revision}")
        replay_seconds = time.monotonic() - t_replay
        outcome, fixups = _apply_lease_rule(rpc, present, snapshot_leases, plan.records, at_ms, min_ttl, keeper)
        final = rpc.header().revision
        if compact_every and final - 1 > compacted:
            rpc.compact(final - 1)
        status = s.snapshot_save(output)
    finally:
        keeper.close()
    snap_rev = status.revision
    expected = fixups[-1] if fixups else max(restored, plan.stop_revision)
    if snap_rev != expected:
        raise ReplayError(f"the saved snapshot is at revision {snap_rev}, expected {expected}")
    reached = max(restored, plan.stop_revision)
    return ReplayResult(
        snapshot_path=output,
        base_revision=plan.base_revision,
        reached_revision=reached,
        reached_time=ms_to_datetime(at_ms) if plan.stop_time_ms is not None else None,
        events_applied=applied_ev,
        revisions_applied=applied_rev,
        segments_applied=applied_seg,
        stopped_because=plan.because
        + (f" (the snapshot already held revisions up to {restored})" if restored > plan.base_revision else ""),
        complete=plan.complete,
        lost_after=plan.lost,
        leases=outcome,
        fixup_revisions=tuple(fixups),
        snapshot_revision=snap_rev,
        snapshot_keys=status.total_keys,
        seconds=time.monotonic() - t0,
        replay_seconds=replay_seconds,
    )


def _apply(
    rpc: EtcdRpc,
    txn: Txn,
    present: Dict[int, int],
    fates: Dict[int, LeaseFate],
    records: Dict[int, List[LeaseRecord]],
    at_ms: int,
    min_ttl: int,
    unknown_ttl: int,
    keeper: _LeaseKeeper,
) -> None:
    ops = []
    for ev in txn.events:
        if ev.kind == PUT:
            if ev.lease and ev.lease not in present:
                fate = fates.get(ev.lease)
                if fate is None:
                    fate = fate_of(ev.lease, records.get(ev.lease, ()), at_ms, min_ttl=min_ttl)
                    fates[ev.lease] = fate
                # an expired lease still holds its keys until the rule removes them at the end
                ttl = fate.ttl if fate.alive and fate.ttl is not None else (unknown_ttl if fate.alive else 60)
                _grant(rpc, ev.lease, ttl)
                present[ev.lease] = ttl
                keeper.hold(ev.lease, ttl)
            ops.append(proto.op_put(ev.key, ev.value, ev.lease))
        else:
            ops.append(proto.op_delete(ev.key))
    try:
        hdr = rpc.txn(ops, timeout=120.0)
    except EtcdError as exc:
        raise ReplayError(f"replaying revision {txn.revision} failed: {exc.message}") from None
    if hdr.revision != txn.revision:
        raise ReplayError(
            f"replaying revision {txn.revision} produced revision {hdr.revision}: the scratch store diverged "
            "from the original (a lease expired on the scratch member?)"
        )


def _grant(rpc: EtcdRpc, lease_id: int, ttl: int) -> None:
    try:
        rpc.lease_grant(ttl, lease_id)
    except EtcdError as exc:
        raise ReplayError(
            f"granting lease {lease_id:x} (TTL {ttl}s) on the scratch member failed: {exc.message}"
        ) from None


def _apply_lease_rule(
    rpc: EtcdRpc,
    present: Dict[int, int],
    snapshot_leases: Set[int],
    records: Sequence[LeaseRecord],
    at_ms: int,
    min_ttl: int,
    keeper: _LeaseKeeper,
) -> Tuple[LeaseOutcome, List[int]]:
    """Drop the keys of leases expired at ``at_ms``; move keys of snapshot leases whose TTL is
    longer than what they had left to a lease with the remaining TTL. Returns fix-up revisions."""
    fates = lease_fates(sorted(present), records, at_ms, min_ttl=min_ttl)
    ops: List[RequestOp] = []
    dropped = reattached = 0
    revoke: List[int] = []
    for lid, fate in fates.items():
        if not fate.alive:
            keys = rpc.lease_ttl(lid, keys=True).keys
            ops.extend(proto.op_delete(k) for k in keys)
            dropped += len(keys)
            revoke.append(lid)
        elif lid in snapshot_leases and fate.ttl is not None and fate.ttl < present[lid]:
            keys = rpc.lease_ttl(lid, keys=True).keys
            if keys:
                new_id, _ttl = rpc.lease_grant(fate.ttl)
                keeper.hold(new_id, fate.ttl)
                for k in keys:
                    ops.append(proto.op_put(k, b"", new_id, ignore_value=True))
                reattached += len(keys)
            revoke.append(lid)
    fixups: List[int] = []
    for i in range(0, len(ops), FIXUP_CHUNK):
        try:
            fixups.append(rpc.txn(ops[i : i + FIXUP_CHUNK], timeout=120.0).revision)
        except EtcdError as exc:
            raise ReplayError(f"applying the lease rule failed: {exc.message}") from None
    for lid in revoke:  # keyless now: revoking them writes no revision
        keeper.release(lid)
        rpc.lease_revoke(lid)
    alive = sum(1 for f in fates.values() if f.alive)
    outcome = LeaseOutcome(
        alive=alive,
        expired=sum(1 for f in fates.values() if not f.alive),
        unknown=sum(1 for f in fates.values() if f.ttl is None and f.alive),
        keys_dropped=dropped,
        keys_reattached=reattached,
        fates=tuple(fates.values()),
    )
    if dropped or reattached:
        log.info("lease rule: %d key(s) of expired leases dropped, %d moved to their remaining TTL (revision %s)",
                 dropped, reattached, ", ".join(str(r) for r in fixups))
    return outcome, fixups
