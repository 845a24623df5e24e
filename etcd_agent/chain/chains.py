"""The delta chains in a backup dir: what each holds, which full backup it continues, and pruning.

A chain is the segments of one chain id that continue one full backup: their headers name its
revision (``base_revision``) and its snapshot's sha256 (``base_sha256``; chains written before
that are matched by revision and time, ``segchain.continues``). Two chains can share a base
revision (an etcd 3.4 restore keeps the revision: the cluster before it and after it), so a
chain is found by its full backup (``Scan.for_full``), never by the revision alone. A full
backup and its chain go together: retention decides about full backups (``backup.retention``),
and a chain is kept exactly when a full backup it continues is kept (or when the daemon's watch
is writing at its base right now); a chain whose full backup is gone (deleted by hand, pruned
before chains existed) is reported and pruned with that reason. Files named like segments whose
header cannot be read are kept while a kept full backup could need them (their revisions reach
past the oldest kept one), then pruned.

Listing reads only headers and footers (``read_summary``); a restore verifies every byte.
"""
from __future__ import annotations

import fcntl
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from etcd_agent.chain.check import BaseBackup, ChainCheck, ChainStop, check_chain, continues
from etcd_agent.chain.errors import NotASegment, SegmentCorrupt
from etcd_agent.chain.reader import read_header, read_summary
from etcd_agent.chain.segments import (
    Checkpoint,
    SegmentHeader,
    SegmentInfo,
    is_sealed,
    list_segments,
    ms_to_datetime,
    parse_name,
)
from etcd_agent.errors import ProtocolError
from etcd_agent.fs import regular_fd, size_text
from etcd_agent.safejson import loads
from etcd_agent.typedjson import Document

log = logging.getLogger(__name__)

# measured point-in-time restore cost per event (bench/pitr_bench.py, two shared cores, 1 KiB
# values: 600,000 events added 16 s to the plain restore, 100,000 added 6 s); a restore's
# estimate, not a promise
REPLAY_EVENTS_PER_SECOND = 80000.0  # measured ~100,000/s of 1 KiB (bench/pitr_bench.py), with margin
WATCHER_LOCK = ".delta-watcher.lock"
MAX_HOLDER = 4096  # the watch's holder record: a few short fields


@dataclass(frozen=True)
class WatcherHolder(Document):
    """The one field of the watcher lock's holder record (``state.locks.Holder``, which this
    room is below) that a listing takes: the base revision of the chain being written."""

    base_revision: Optional[int] = None


@dataclass(frozen=True)
class ChainSummary:
    """One chain (the segments of one chain id after one full backup), from headers and footers."""

    base_revision: int
    paths: Tuple[str, ...]  # every segment file of this base, in revision order
    usable: int  # of those, how many link up cleanly from the base (the rest follow a stop)
    end_revision: int  # the last revision the usable segments reach
    start_time_ms: Optional[int]
    end_time_ms: Optional[int]
    events: int  # in the usable segments: what a restore to their end replays
    revisions: int
    bytes: int  # every file of this chain
    stop: Optional[ChainStop] = None
    chain_id: str = ""
    first: Optional[SegmentHeader] = None  # the header of its first segment (None: not found)
    checkpoints: Tuple[Checkpoint, ...] = ()  # vouched for by its usable segments, in order
    events_after_checkpoint: Optional[int] = None  # events after the newest of them (None: none)
    begins_at: int = 0  # a partial chain (its first segments not here: ``check_chain``): its first revision
    named_base: str = ""  # a partial chain: the snapshot sha256 its earliest segment names
    # a partial chain: the time from which a replay of it reaches a time target (``served_floor``); 0: none
    floor_time_ms: int = 0

    @property
    def base_sha256(self) -> str:
        return self.first.base_sha256 if self.first is not None else self.named_base

    def continues(self, base: Optional[BaseBackup]) -> bool:
        """Does this chain continue the full backup ``base`` (at its base revision)? A partial
        chain continues none here: no watcher resumes it, no restore follows it without the key."""
        return self.first is not None and continues(self.first, base)

    def listed_under(self, base: Optional[BaseBackup]) -> bool:
        """Is it shown with the full backup ``base`` in a listing: it continues it, or it is a
        partial chain naming its snapshot sha256 (never an orphan beside it)."""
        return self.continues(base) or bool(self.begins_at and base is not None and base.sha256
                                            and self.named_base == base.sha256)

    @property
    def encrypted(self) -> int:
        """How many of its segments are encrypted (``.seg.age``)."""
        return sum(1 for p in self.paths if is_sealed(p))

    @property
    def replay_events(self) -> int:
        """What a restore to its end folds: the events after its newest checkpoint, or all."""
        return self.events if self.events_after_checkpoint is None else self.events_after_checkpoint

    @property
    def replay_seconds(self) -> float:
        return self.replay_events / REPLAY_EVENTS_PER_SECOND

    def describe(self) -> str:
        if not self.usable:
            what = "no usable segment"
        else:
            end = ms_to_datetime(self.end_time_ms).isoformat(timespec="seconds") if self.end_time_ms else "?"
            enc = f" ({self.encrypted} encrypted: a restore needs --identity)" if self.encrypted else ""
            cps = ""
            if self.checkpoints:
                cps = (f" from checkpoint {self.checkpoints[-1].name} (the newest of {len(self.checkpoints)} it vouches "
                       f"for; {self.replay_events} events after it)")
            part = (f" (a partial chain: from revision {self.begins_at}, earlier segments not here - fetched from "
                    "the bucket after a checkpoint; a restore uses it only with the manifest key)"
                    if self.begins_at else "")
            what = (f"{self.usable} segment(s){enc}, revisions {self.begins_at or self.base_revision + 1}.."
                    f"{self.end_revision}{part} "
                    f"(until {end}), {self.events} events, {size_text(self.bytes)}; a restore to its end replays "
                    f"~{self.replay_seconds:.0f}s{cps} (at ~{REPLAY_EVENTS_PER_SECOND:.0f} events/s)")
        if self.stop is not None:
            what += f"; BROKEN at revision {self.stop.at_revision}: {self.stop.reason}"
            if len(self.paths) > self.usable:
                what += f" ({len(self.paths) - self.usable} file(s) after it are not used)"
        return what

    def to_json(self) -> Dict[str, Any]:
        return {
            "base_revision": self.base_revision,
            "chain_id": self.chain_id,
            "base_sha256": self.base_sha256 or None,
            "segments": len(self.paths),
            "encrypted_segments": self.encrypted,
            "usable_segments": self.usable,
            "end_revision": self.end_revision,
            "start_time": ms_to_datetime(self.start_time_ms).isoformat() if self.start_time_ms else None,
            "end_time": ms_to_datetime(self.end_time_ms).isoformat() if self.end_time_ms else None,
            "events": self.events,
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "replay_events": self.replay_events,
            "revisions": self.revisions,
            "bytes": self.bytes,
            "replay_estimate_seconds": round(self.replay_seconds, 1),
            "stop": self.stop.to_json() if self.stop else None,
            "begins_at": self.begins_at or None,
        }


@dataclass(frozen=True)
class Scan:
    chains: Tuple[ChainSummary, ...]  # by base revision, then by when they started
    unreadable: Tuple[Tuple[str, str], ...] = field(default=())  # (path, problem): no header to go by
    # of those, files that do not begin as a segment does: named like one, no chain's (not damage)
    junk: Tuple[str, ...] = field(default=())

    def for_full(self, revision: int, base: Optional[BaseBackup]) -> Optional[ChainSummary]:
        """The chain continuing the full backup ``base`` at ``revision`` (the one a watcher
        resumes and a restore replays), or None."""
        return next((c for c in self.chains if c.base_revision == revision and c.continues(base)), None)


def scan(directory: str) -> Scan:
    """Every chain in ``directory``; never raises for a damaged file (it is reported)."""
    try:
        paths = list_segments(directory)
    except FileNotFoundError:
        return Scan(())
    by_chain: Dict[Tuple[int, str], List[str]] = {}
    firsts: Dict[Tuple[int, str], SegmentHeader] = {}
    unreadable: List[Tuple[str, str]] = []
    junk: List[str] = []
    for p in paths:
        try:
            header, _footer = read_summary(p)
        except SegmentCorrupt as exc:
            unreadable.append((p, exc.problem))
            if isinstance(exc, NotASegment):
                junk.append(p)
            continue
        k = (header.base_revision, header.chain_id)
        by_chain.setdefault(k, []).append(p)
        if header.seq == 0:
            firsts.setdefault(k, header)
    chains = []
    order = sorted(by_chain, key=lambda k: (k[0], firsts[k].start_time_ms if k in firsts else 0, k[1]))
    for k in order:
        base, ps = k[0], by_chain[k]
        check = check_chain(ps, base, verify=False)
        if k not in firsts and not check.segments:
            check = _partial_outline(ps, base, check)
        segs = check.segments
        size = 0
        for p in ps:
            try:
                size += os.path.getsize(p)
            except OSError:
                pass
        cps = tuple(c for s in segs for c in s.footer.checkpoints)
        newest = max((c.revision for c in cps), default=None)
        chains.append(ChainSummary(
            base_revision=base, paths=tuple(ps), usable=len(segs), end_revision=check.end_revision,
            start_time_ms=segs[0].header.start_time_ms if segs else None, end_time_ms=check.end_time_ms,
            events=sum(s.footer.events for s in segs), revisions=sum(s.footer.txns for s in segs), bytes=size,
            stop=check.stop, chain_id=k[1], first=firsts.get(k), checkpoints=cps,
            events_after_checkpoint=None if newest is None else events_after(segs, newest, check.end_revision),
            begins_at=check.begins_at, named_base=check.segments[0].header.base_sha256 if check.begins_at else "",
            floor_time_ms=_floor_ms(segs, check.begins_at),
        ))
    return Scan(tuple(chains), tuple(unreadable), tuple(junk))


def _partial_outline(paths: Sequence[str], base: int, check: ChainCheck) -> ChainCheck:
    """A chain without its first segments (a restore from the bucket fetched those after a
    checkpoint, ``bucket.partial``), outlined from its earliest file by the base its header names:
    for a listing only (a restore follows it only with the manifest key, ``check_chain``)."""
    starts = sorted((r[0], p) for p, r in ((p, parse_name(os.path.basename(p))) for p in paths) if r is not None)
    if not starts:
        return check
    try:
        h = read_header(starts[0][1])
    except SegmentCorrupt:
        return check
    if not h.base_sha256 or h.start_revision <= base + 1:
        return check
    run = check_chain(paths, base, verify=False, base=BaseBackup(h.base_sha256), begins_at=h.start_revision)
    return run if run.segments else check


def served_floor(segments: Sequence[SegmentInfo], begins_at: int) -> Optional[Tuple[Checkpoint, int]]:
    """A partial chain's floor: the oldest checkpoint a replay of what is here can start from (its
    lease census here) and the time from which it serves a time target - the end of the first
    segment reaching its revision (a restore takes a checkpoint for a time target only once a
    segment reaching it had closed: ``pitr.prepare.choose_start``). None: it serves none."""
    served = [c for s in segments for c in s.footer.checkpoints if c.served_from(begins_at)]
    if not served:
        return None
    cp = min(served, key=lambda c: c.revision)
    at = next((s.footer.end_time_ms for s in segments if s.end_revision >= cp.revision), None)
    return None if at is None else (cp, at)


def _floor_ms(segments: Sequence[SegmentInfo], begins_at: int) -> int:
    found = served_floor(segments, begins_at) if begins_at else None
    return found[1] if found is not None else 0


def events_after(segments: Sequence[SegmentInfo], revision: int, stop: int) -> int:
    """The events of ``segments`` after ``revision`` and up to ``stop``, from their footers: a
    segment that straddles either counts its revisions' share (an estimate, for plans and listings)."""
    total = 0
    for seg in segments:
        lo, hi = max(seg.start_revision, revision + 1), min(seg.end_revision, stop)
        if hi >= lo and seg.footer.txns:
            total += seg.footer.events * (hi - lo + 1) // max(seg.end_revision - seg.start_revision + 1, 1)
    return total


def active_base(directory: str) -> Optional[int]:
    """The base revision of the chain a watcher is writing in ``directory`` now (its lock is
    held, and its holder record says so), or None."""
    path = os.path.join(directory, WATCHER_LOCK)
    try:
        fd = regular_fd(path)  # a FIFO planted as the lock file must not hang every listing
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raw = os.pread(fd, MAX_HOLDER, 0)
            try:
                rec = loads(raw.decode("utf-8", "replace") or "{}", max_bytes=MAX_HOLDER)
                return WatcherHolder.from_json(rec, f"watcher lock {path}").base_revision
            except (ValueError, ProtocolError):  # an older agent's plain-text record, or damage
                return None
        return None  # nobody holds it
    finally:
        os.close(fd)


# ---------------------------------------------------------------- pruning (the plan is pure)


@dataclass(frozen=True)
class FullRef:
    """A full backup as the chain plan sees it."""

    name: str
    revision: Optional[int]
    keep: bool
    good: bool = True  # False: quarantined (never deleted: its chain stays with it)
    reason: str = ""
    base: Optional[BaseBackup] = None  # its snapshot's sha256 and time (None: matched by revision)


@dataclass(frozen=True)
class ChainDecision:
    base_revision: int
    keep: bool
    reason: str
    paths: Tuple[str, ...]
    chain_id: str = ""

    @property
    def label(self) -> str:
        return f"delta chain after revision {self.base_revision} ({len(self.paths)} segment(s))"


def plan_prune(scan_: Scan, fulls: Sequence[FullRef], *, active: Optional[int] = None) -> List[ChainDecision]:
    """One decision per chain (and one for the unreadable files that may go), each with its reason."""
    out = [_chain_decision(c, fulls, active) for c in scan_.chains]
    if scan_.unreadable:
        out += _unreadable_decisions(scan_.unreadable, fulls)
    return out


def _chain_decision(c: ChainSummary, fulls: Sequence[FullRef], active: Optional[int]) -> ChainDecision:
    """A chain is kept with a kept full backup it continues, or while the daemon writes it."""
    same = [f for f in fulls if f.revision == c.base_revision and _goes_with(c, f)]
    kept = [f for f in same if f.keep]
    if kept:
        return ChainDecision(c.base_revision, True, f"continues {kept[0].name} (kept)", c.paths, c.chain_id)
    if c.base_revision == active:
        return ChainDecision(c.base_revision, True, "being written by the daemon's watch right now", c.paths,
                             c.chain_id)
    if same:
        gone = same[0]
        why = f"its full backup {gone.name} is pruned" + (f" ({gone.reason})" if gone.reason else "")
        return ChainDecision(c.base_revision, False, why, c.paths, c.chain_id)
    return ChainDecision(
        c.base_revision, False,
        f"orphaned: no full backup here that it continues (revision {c.base_revision}: deleted by hand, "
        "or never finished); without it the segments restore nothing", c.paths, c.chain_id)


def _goes_with(c: ChainSummary, f: FullRef) -> bool:
    """Is ``c`` the chain of the full backup ``f`` (at its revision)? A partial chain has no first
    segment to tell: it goes with the backup whose snapshot sha256 its earliest segment names,
    never with another at that revision (which would keep it after its own is pruned, or prune
    it with the other); by revision alone only when neither digest is known."""
    if c.first is not None:
        return c.continues(f.base)
    if c.named_base and f.base is not None and f.base.sha256:
        return c.named_base == f.base.sha256
    return True


def _unreadable_decisions(unreadable: Sequence[Tuple[str, str]], fulls: Sequence[FullRef]) -> List[ChainDecision]:
    """Unreadable files go only when they lie wholly before the oldest kept full backup."""
    kept_revs = [f.revision for f in fulls if f.keep and f.revision is not None]
    oldest = min(kept_revs) if kept_revs else None
    doomed, stay, alien = [], [], []
    for p, _why in unreadable:
        rng = parse_name(os.path.basename(p))
        if not _regular(p):
            alien.append(p)
        elif oldest is not None and rng is not None and max(rng) < oldest:
            doomed.append(p)
        else:
            stay.append(p)
    out: List[ChainDecision] = []
    if doomed:
        out.append(ChainDecision(-1, False, f"unreadable segments entirely before the oldest kept full backup "
                                            f"(revision {oldest}): nothing can use them", tuple(doomed)))
    if stay:
        out.append(ChainDecision(-1, True, "unreadable segments kept: a kept full backup may need them "
                                           "(`backup list` names the damage)", tuple(stay)))
    if alien:  # a directory, FIFO, device or symlink: not written by the agent, not its to remove
        out.append(ChainDecision(-1, True, "not regular files, named like segments: never written as one, "
                                           "never deleted (`backup list` names them; remove them by hand)",
                                 tuple(alien)))
    return out


def _regular(path: str) -> bool:
    """Is ``path`` itself (not what a symlink names) a regular file? A vanished one counts as
    regular: deleting it is a no-op."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def apply(decisions: Iterable[ChainDecision]) -> List[str]:
    """Delete the segments of every chain decided against; returns the files removed."""
    removed = []
    for d in decisions:
        if d.keep:
            continue
        log.info("pruning %s: %s", d.label, d.reason)
        for p in d.paths:
            try:
                os.unlink(p)
                removed.append(p)
            except FileNotFoundError:
                pass
            except IsADirectoryError:  # made a directory since the plan (which keeps those)
                log.warning("not pruning %s: a directory, not a segment", p)
    return removed
