"""Point-in-time restore: a full snapshot plus its delta chain, replayed to a target, saved anew.

``replay(full_snapshot, segment_paths, target, output=...)``:

1. check the chain from the snapshot's revision (every segment read and verified) and decide the
   stop point: the target, or the last good point before a gap, a damaged segment or a broken
   link - nothing after a gap is ever applied;
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
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from etcd_agent.errors import EtcdError

from . import proto
from .errors import ReplayError, SegmentCorrupt
from .leases import MIN_TTL, LeaseFate, fate_of, lease_fates
from .rpc import EtcdRpc, KeepAliveStream
from .scratch import ScratchEtcd, ScratchOptions, scratch_etcd
from .segchain import ChainCheck, ChainStop, check_chain
from .segments import PUT, LeaseRecord, SegmentInfo, Txn, datetime_to_ms, ms_to_datetime
from .segreader import read_header, read_segment

log = logging.getLogger(__name__)

FIXUP_CHUNK = 10000


# ---------------------------------------------------------------- target


@dataclass(frozen=True)
class Target:
    """``newest`` | ``revision`` N | ``time`` T (Unix ms; from an aware datetime)."""

    kind: str
    revision: Optional[int] = None
    time_ms: Optional[int] = None

    @classmethod
    def newest(cls) -> "Target":
        return cls("newest")

    @classmethod
    def to_revision(cls, revision: int) -> "Target":
        return cls("revision", revision=revision)

    @classmethod
    def to_time(cls, when: datetime) -> "Target":
        return cls("time", time_ms=datetime_to_ms(when))

    @classmethod
    def parse(cls, text: str) -> "Target":
        """``newest``, a revision number, or an ISO-8601 time with its zone (``...Z``)."""
        t = text.strip()
        if t == "newest":
            return cls.newest()
        if t.isdigit():
            return cls.to_revision(int(t))
        try:
            when = datetime.fromisoformat(t.replace("Z", "+00:00"))
        except ValueError:
            raise ReplayError(f"target {text!r} is neither 'newest', a revision nor an ISO-8601 time") from None
        if when.tzinfo is None:
            raise ReplayError(f"target time {text!r} has no time zone; write it in UTC, e.g. {t}Z")
        return cls.to_time(when)

    def describe(self) -> str:
        if self.kind == "revision":
            return f"revision {self.revision}"
        if self.kind == "time":
            assert self.time_ms is not None
            return f"time {ms_to_datetime(self.time_ms).isoformat()}"
        return "newest"

    def to_json(self) -> Dict[str, Any]:
        return {"kind": self.kind, "revision": self.revision, "time_ms": self.time_ms}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Target":
        if d.get("kind") not in ("newest", "revision", "time"):
            raise ValueError(f"bad target kind {d.get('kind')!r}")
        return cls(d["kind"], d.get("revision"), d.get("time_ms"))


# ---------------------------------------------------------------- result


@dataclass(frozen=True)
class LeaseOutcome:
    alive: int = 0  # leases in the result
    expired: int = 0  # leases expired by the target, revoked
    unknown: int = 0  # leases with no TTL observation (kept)
    keys_dropped: int = 0  # keys removed after the target because their lease had expired
    keys_reattached: int = 0  # keys moved to a lease with their remaining TTL
    fates: Tuple[LeaseFate, ...] = ()

    def to_json(self) -> Dict[str, Any]:
        return {
            "alive": self.alive,
            "expired": self.expired,
            "unknown": self.unknown,
            "keys_dropped": self.keys_dropped,
            "keys_reattached": self.keys_reattached,
            "fates": [f.to_json() for f in self.fates],
        }

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "LeaseOutcome":
        return cls(
            int(d["alive"]), int(d["expired"]), int(d["unknown"]), int(d["keys_dropped"]),
            int(d["keys_reattached"]), tuple(LeaseFate.from_json(f) for f in d.get("fates", [])),
        )


@dataclass(frozen=True)
class ReplayResult:
    snapshot_path: str
    base_revision: int
    reached_revision: int
    reached_time: Optional[datetime]
    events_applied: int
    revisions_applied: int
    segments_applied: int
    stopped_because: str
    complete: bool  # the target was reached with a sound chain
    lost_after: Optional[ChainStop]  # what could not be used, when the chain is broken
    leases: LeaseOutcome = field(default_factory=LeaseOutcome)
    fixup_revisions: Tuple[int, ...] = ()
    snapshot_revision: int = 0  # revision of the saved snapshot (reached, or the last fix-up)
    snapshot_keys: int = 0
    seconds: float = 0.0
    replay_seconds: float = 0.0

    def to_json(self) -> Dict[str, Any]:
        return {
            "snapshot_path": self.snapshot_path,
            "base_revision": self.base_revision,
            "reached_revision": self.reached_revision,
            "reached_time": self.reached_time.isoformat() if self.reached_time else None,
            "events_applied": self.events_applied,
            "revisions_applied": self.revisions_applied,
            "segments_applied": self.segments_applied,
            "stopped_because": self.stopped_because,
            "complete": self.complete,
            "lost_after": self.lost_after.to_json() if self.lost_after else None,
            "leases": self.leases.to_json(),
            "fixup_revisions": list(self.fixup_revisions),
            "snapshot_revision": self.snapshot_revision,
            "snapshot_keys": self.snapshot_keys,
            "seconds": self.seconds,
            "replay_seconds": self.replay_seconds,
        }

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ReplayResult":
        when = d.get("reached_time")
        return cls(
            snapshot_path=str(d["snapshot_path"]),
            base_revision=int(d["base_revision"]),
            reached_revision=int(d["reached_revision"]),
            reached_time=datetime.fromisoformat(when) if when else None,
            events_applied=int(d["events_applied"]),
            revisions_applied=int(d["revisions_applied"]),
            segments_applied=int(d["segments_applied"]),
            stopped_because=str(d["stopped_because"]),
            complete=bool(d["complete"]),
            lost_after=ChainStop.from_json(d["lost_after"]) if d.get("lost_after") else None,
            leases=LeaseOutcome.from_json(d["leases"]),
            fixup_revisions=tuple(int(r) for r in d.get("fixup_revisions", [])),
            snapshot_revision=int(d.get("snapshot_revision", 0)),
            snapshot_keys=int(d.get("snapshot_keys", 0)),
            seconds=float(d.get("seconds", 0.0)),
            replay_seconds=float(d.get("replay_seconds", 0.0)),
        )


# ---------------------------------------------------------------- planning (pure but for reads)


@dataclass(frozen=True)
class Plan:
    base_revision: int
    stop_revision: int
    stop_time_ms: Optional[int]
    segments: Tuple[SegmentInfo, ...]  # to read, in order (the last may be applied in part)
    records: Tuple[LeaseRecord, ...]
    complete: bool
    because: str
    lost: Optional[ChainStop]


def plan_replay(check: ChainCheck, target: Target) -> Plan:
    """Where the replay stops, from a checked chain and the target."""
    segs = check.segments
    base = check.base_revision
    records = tuple(r for s in segs for r in s.lease_records)
    end_rev, end_ms = check.end_revision, check.end_time_ms
    broken = check.stop
    short = f"the chain stops at revision {end_rev}: {broken.reason}" if broken else ""
    if target.kind == "newest":
        because = short or f"newest: end of the chain at revision {end_rev}"
        return Plan(base, end_rev, end_ms, segs, records, broken is None, because, broken)
    if target.kind == "revision":
        n = target.revision
        assert n is not None
        if n < base:
            raise ReplayError(f"target revision {n} is before the full backup's revision {base}")
        if n > end_rev:
            because = short or f"the chain ends at revision {end_rev}, before the target revision {n}"
            return Plan(base, end_rev, end_ms, segs, records, False, because, broken)
        need = tuple(s for s in segs if s.start_revision <= n)
        t = _time_of_revision(need, n) if n > base else (segs[0].header.start_time_ms if segs else None)
        return Plan(base, n, t, need, records, True, f"target revision {n} reached", None)
    t_ms = target.time_ms
    assert t_ms is not None
    if segs and t_ms < segs[0].header.start_time_ms:
        raise ReplayError(
            f"target time {ms_to_datetime(t_ms).isoformat()} is before the chain starts "
            f"({ms_to_datetime(segs[0].header.start_time_ms).isoformat()}); nothing before the full "
            f"backup (revision {base}) can be restored"
        )
    if not segs or end_ms is None or t_ms > end_ms:
        because = short or (
            f"the chain covers up to {ms_to_datetime(end_ms).isoformat() if end_ms else 'nothing'}, "
            f"before the target time"
        )
        return Plan(base, end_rev, end_ms, segs, records, False, because, broken)
    picked: List[SegmentInfo] = []
    rev = base
    note = ""
    for s in segs:
        if s.header.start_time_ms > t_ms:
            break
        picked.append(s)
        if s.footer.end_time_ms <= t_ms:
            rev = s.end_revision
            continue
        seg = _read(s)
        for txn in seg.txns:
            if txn.time_ms > t_ms:
                if txn.catchup:
                    note = (
                        f"; revision {txn.revision} on was received while catching up after a reconnect, "
                        "so its commit time is known only as no later than its receipt: some of it may "
                        "predate the target"
                    )
                break
            rev = txn.revision
        break
    return Plan(base, rev, t_ms, tuple(picked), records, True, f"target time reached at revision {rev}{note}", None)


def _read(info: SegmentInfo) -> Any:
    try:
        return read_segment(info.path)
    except SegmentCorrupt as exc:
        raise ReplayError(f"{exc.message} (it verified a moment ago: changed during the replay?)") from None


def _time_of_revision(segs: Sequence[SegmentInfo], n: int) -> Optional[int]:
    for s in segs:
        if s.start_revision <= n <= s.end_revision:
            for txn in _read(s).txns:
                if txn.revision == n:
                    return int(txn.time_ms)
    return None


def find_base(paths: Sequence[str], snapshot_revision: int) -> int:
    """The chain to use for a snapshot at ``snapshot_revision``: the one based exactly there, or
    else the newest chain based before it (the snapshot then overlaps the chain's first events)."""
    bases: Set[int] = set()
    for p in paths:
        try:
            h = read_header(p)
        except SegmentCorrupt:
            continue
        if h.seq == 0:
            bases.add(h.base_revision)
    if snapshot_revision in bases or not bases:
        return snapshot_revision
    earlier = [b for b in bases if b < snapshot_revision]
    if not earlier:
        raise ReplayError(
            f"no delta chain starts at or before the snapshot's revision {snapshot_revision} "
            f"(chains start after {', '.join(str(b) for b in sorted(bases))})"
        )
    return max(earlier)


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
            seg = _read(info)
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
    ops: List[bytes] = []
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
