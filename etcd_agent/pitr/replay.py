"""Point-in-time replay, what it is asked and what it answers: the target, the plan, the result.

``Target`` is where a replay should stop (the newest point, a revision or a time); ``plan_replay``
decides from a checked chain (``segchain.check_chain``) where it does stop - the target, or the
last good point before a gap, a damaged segment or a broken link: nothing after a gap is ever
applied. It is pure but for reading verified segments again to place a revision or a time.
``ReplayResult`` is what a replay (``replayrun.replay``) reports, and what a restore keeps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, List, Optional, Sequence, Set, Tuple

from etcd_agent.chain.check import ChainCheck, ChainStop
from etcd_agent.chain.errors import ReplayError, SegmentCorrupt
from etcd_agent.chain.reader import read_header, read_segment
from etcd_agent.chain.segments import LeaseRecord, SegmentInfo, datetime_to_ms, ms_to_datetime
from etcd_agent.errors import BackupCorrupt
from etcd_agent.pitr.leases import LeaseFate
from etcd_agent.typedjson import Codec, Document, JsonObject, Text


@dataclass(frozen=True)
class Target(Document):
    """``newest`` | ``revision`` N | ``time`` T (Unix ms; from an aware datetime)."""

    ERROR = ReplayError

    kind: Annotated[str, Text(8, choices=("newest", "revision", "time"))]
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

    def to_json(self) -> JsonObject:
        return {"kind": self.kind, "revision": self.revision, "time_ms": self.time_ms}  # nulls too, as ever

    def violation(self) -> Optional[str]:
        if self.kind == "revision" and self.revision is None:
            return "a revision target names its revision"
        if self.kind == "time" and self.time_ms is None:
            return "a time target names its time"
        return None


# ---------------------------------------------------------------- result


@dataclass(frozen=True)
class LeaseOutcome(Document):
    REQUIRED = ("alive", "expired", "unknown", "keys_dropped", "keys_reattached")

    alive: int = 0  # leases in the result
    expired: int = 0  # leases expired by the target, revoked
    unknown: int = 0  # leases with no TTL observation (kept)
    keys_dropped: int = 0  # keys removed after the target because their lease had expired
    keys_reattached: int = 0  # keys moved to a lease with their remaining TTL
    fates: Tuple[LeaseFate, ...] = ()


def _read_time(v: Any) -> Optional[datetime]:
    try:
        return datetime.fromisoformat(v) if v else None  # "" as older agents may have left it
    except (TypeError, ValueError):
        raise ValueError("is not an ISO-8601 time") from None


def _read_phases(v: Any) -> Tuple[Tuple[str, float], ...]:
    if not isinstance(v, dict) or len(v) > 64 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(x, (int, float)) and not isinstance(x, bool)
            for k, x in v.items()):
        raise ValueError("must map each phase's name to its seconds")
    return tuple((k, float(x)) for k, x in v.items())


ISO_TIME = Codec(_read_time, lambda v: v.isoformat())
PHASES = Codec(_read_phases, lambda v: {k: round(x, 3) for k, x in v})  # {phase: seconds}, as people read it
MAX_TEXT = 16 * 1024


@dataclass(frozen=True)
class ReplayResult(Document):
    """What a replay did; kept beside the replayed db (``<kept>.json``), read again by a restore
    that resumes or is given the kept db: damage there is a corrupt backup."""

    ERROR = BackupCorrupt
    REQUIRED = ("leases",)

    snapshot_path: Annotated[str, Text(4096)]
    base_revision: int
    reached_revision: int
    reached_time: Annotated[Optional[datetime], ISO_TIME]
    events_applied: int
    revisions_applied: int
    segments_applied: int
    stopped_because: Annotated[str, Text(MAX_TEXT)]
    complete: bool  # the target was reached with a sound chain
    lost_after: Optional[ChainStop]  # what could not be used, when the chain is broken
    leases: LeaseOutcome = field(default_factory=LeaseOutcome)
    fixup_revisions: Tuple[int, ...] = ()
    snapshot_revision: int = 0  # revision of the saved snapshot (reached, or the last fix-up)
    snapshot_keys: int = 0  # bolt keys of the saved db: no longer counted (0), read from older kept replays
    seconds: float = 0.0
    replay_seconds: float = 0.0
    keys_loaded: int = 0  # keys the chain left changed (puts and deletes), written in the load
    load_revisions: Tuple[int, ...] = ()  # the load's transactions' revisions in the scratch store
    started_from: Annotated[str, Text(4096)] = ""  # the checkpoint the replay started from ("": the full backup itself)
    started_revision: int = 0  # the revision of the snapshot it started from
    # where the replay's time went, phase -> seconds (stage, fold, scratch restore, start, load,
    # defragment, save ...): the restore's JSON timings show them under "read: replay: "
    phases: Annotated[Tuple[Tuple[str, float], ...], PHASES] = ()


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
    records = tuple(r for s in segs for r in s.lease_records)
    end_rev, end_ms = check.end_revision, check.end_time_ms
    broken = check.stop
    short = f"the chain stops at revision {end_rev}: {broken.reason}" if broken else ""
    if target.kind == "newest":
        because = short or f"newest: end of the chain at revision {end_rev}"
        return Plan(check.base_revision, end_rev, end_ms, segs, records, broken is None, because, broken)
    if target.kind == "revision":
        assert target.revision is not None
        return _to_revision(check, records, short, target.revision)
    assert target.time_ms is not None
    return _to_time(check, records, short, target.time_ms)


def _to_revision(check: ChainCheck, records: Tuple[LeaseRecord, ...], short: str, n: int) -> Plan:
    """The plan for ``--to-revision n``: the segments up to it, or the whole chain when it ends
    before (``short``: why it stops, when it broke)."""
    segs, base, end_rev = check.segments, check.base_revision, check.end_revision
    if n < base:
        raise ReplayError(f"target revision {n} is before the full backup's revision {base}")
    if n > end_rev:
        because = short or f"the chain ends at revision {end_rev}, before the target revision {n}"
        return Plan(base, end_rev, check.end_time_ms, segs, records, False, because, check.stop)
    need = tuple(s for s in segs if s.start_revision <= n)
    t = _time_of_revision(need, n) if n > base else (segs[0].header.start_time_ms if segs else None)
    return Plan(base, n, t, need, records, True, f"target revision {n} reached", None)


def _to_time(check: ChainCheck, records: Tuple[LeaseRecord, ...], short: str, t_ms: int) -> Plan:
    """The plan for ``--to-time``: the segments that began by then, up to its last transaction
    committed by then; refused before the chain starts, the whole chain when it ends before."""
    segs, base, end_ms = check.segments, check.base_revision, check.end_time_ms
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
        return Plan(base, check.end_revision, end_ms, segs, records, False, because, check.stop)
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
        rev, note = _last_by(s, t_ms, rev)
        break
    return Plan(base, rev, t_ms, tuple(picked), records, True, f"target time reached at revision {rev}{note}", None)


def _last_by(s: SegmentInfo, t_ms: int, rev: int) -> Tuple[int, str]:
    """The revision of segment ``s``'s last transaction committed by ``t_ms`` (``rev``: the one
    before it) and, when the first one after it came in a batch, a note that its commit time is
    only bounded by its receipt."""
    for txn in reread(s).txns:
        if txn.time_ms > t_ms:
            if txn.catchup:
                return rev, (
                    f"; revision {txn.revision} on was received in a batch of the watch (or while "
                    "catching up after a reconnect), so its commit time is known only as no later "
                    "than its receipt: some of it may predate the target (--to-revision is exact)"
                )
            return rev, ""
        rev = txn.revision
    return rev, ""


def reread(info: SegmentInfo) -> Any:
    """A segment the chain check verified, read again for its events (damage now is a ReplayError)."""
    try:
        return read_segment(info.path)
    except SegmentCorrupt as exc:
        raise ReplayError(f"{exc.message} (it verified a moment ago: changed during the replay?)") from None


def _time_of_revision(segs: Sequence[SegmentInfo], n: int) -> Optional[int]:
    for s in segs:
        if s.start_revision <= n <= s.end_revision:
            for txn in reread(s).txns:
                if txn.revision == n:
                    return int(txn.time_ms)
    return None


def find_base(paths: Sequence[str], snapshot_revision: int) -> int:
    """The chain to use for a snapshot at ``snapshot_revision``: the one based exactly there, or
    else the newest chain based before it (the snapshot then overlaps the chain's first events).
    Chains are found by their first segments; a partial chain (no first segment here: fetched
    from the bucket after a checkpoint, ``check_chain``'s ``begins_at``) by the base its later
    ones name - else a replay from a checkpoint inside it would look for a chain based at the
    checkpoint and fold nothing."""
    bases: Set[int] = set()
    partial: Set[int] = set()
    for p in paths:
        try:
            h = read_header(p)
        except SegmentCorrupt:
            continue
        (bases if h.seq == 0 else partial).add(h.base_revision)
    # a partial chain at exactly this revision counts beside whole ones: the daemon's next full
    # backup after a restore from the bucket starts a whole chain, and the partial one of the
    # backup restored from must still be found
    if snapshot_revision in bases or snapshot_revision in partial:
        return snapshot_revision
    bases = bases or partial
    if not bases:
        return snapshot_revision
    earlier = [b for b in bases if b < snapshot_revision]
    if not earlier:
        raise ReplayError(
            f"no delta chain starts at or before the snapshot's revision {snapshot_revision} "
            f"(chains start after {', '.join(str(b) for b in sorted(bases))})"
        )
    return max(earlier)
