"""A delta chain: its segments followed from the full backup's revision, and where it stops.

``check_chain`` follows the links (revisions contiguous, the same chain id, each header naming
the previous file's sha256) and returns the good prefix with the first gap, damaged file or
broken link as a ``ChainStop``: nothing at or after it is ever trusted. Whose chain a segment is
comes from its content (the base sha256 every segment names), never from its file name: another
full backup's chain, and a file that is no segment at all, are passed over and named.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from etcd_agent.chain import sign as segsign
from etcd_agent.chain.errors import NotASegment, SegmentCorrupt, SegmentForged
from etcd_agent.chain.reader import read_header, read_summary, verify_segment
from etcd_agent.chain.seal import verify_sealed
from etcd_agent.chain.segments import (
    MAX_SEGMENT,
    SegmentHeader,
    SegmentInfo,
    is_sealed,
    ms_to_datetime,
    name_time_ms,
    parse_name,
)
from etcd_agent.fs import open_regular
from etcd_agent.typedjson import Document, JsonObject, Text

# an encrypted segment's path -> its info, opened with the key (``segseal.open_sealed``)
Opener = Callable[[str], SegmentInfo]


@dataclass(frozen=True)
class BaseBackup:
    """The full backup a chain must continue, beyond its revision: its snapshot db's sha256
    ("" unknown) and when it was taken (Unix ms, 0 unknown)."""

    sha256: str = ""
    time_ms: int = 0


def continues(h: SegmentHeader, base: Optional[BaseBackup]) -> bool:
    """Can the chain whose first segment has header ``h`` continue the full backup ``base``?

    Two full backups can share a revision: etcd 3.4 restores keep the snapshot's revision, so the
    backup taken after a restore has the revision of the one restored from, and a chain of the
    cluster as it was before the restore must never be taken for the new one's. A chain names
    its backup's snapshot sha256; one written before chains did (or a backup whose hash is not
    known) is judged by time: a chain only continues a backup taken before it started."""
    if base is None:
        return True
    if h.base_sha256 and base.sha256:
        return h.base_sha256 == base.sha256
    return not base.time_ms or h.start_time_ms >= base.time_ms


@dataclass(frozen=True)
class ChainStop(Document):
    """Where and why a chain stops being usable; nothing at or after ``at_revision`` is trusted."""

    kind: Annotated[str, Text(16, r"[a-z-]+")]  # "gap" | "corrupt" | "mismatch" | "future" | "forged" (``segsign``)
    reason: Annotated[str, Text(16 * 1024)]
    at_revision: int
    path: Annotated[Optional[str], Text(4096)]
    last_good_revision: int
    last_good_time_ms: Optional[int]

    def to_json(self) -> JsonObject:
        return {
            "kind": self.kind,
            "reason": self.reason,
            "at_revision": self.at_revision,
            "path": self.path,
            "last_good_revision": self.last_good_revision,
            "last_good_time": ms_to_datetime(self.last_good_time_ms).isoformat() if self.last_good_time_ms else None,
            "last_good_time_ms": self.last_good_time_ms,
        }


@dataclass(frozen=True)
class ChainCheck:
    base_revision: int
    segments: Tuple[SegmentInfo, ...]
    stop: Optional[ChainStop]
    lost: Tuple[str, ...] = field(default=())  # segment files of this chain after the stop
    # files at this base passed over by their content, and why: the first segment of another
    # full backup's chain, a file that is no segment at all (never a gap: nothing of this chain)
    passed: Tuple[Tuple[str, str], ...] = field(default=())
    chosen_because: str = ""  # why its first segment is taken to continue the full backup
    begins_at: int = 0  # a partial chain (``check_chain``'s ``begins_at``): its first revision here; 0 whole

    @property
    def end_revision(self) -> int:
        return self.segments[-1].end_revision if self.segments else self.base_revision

    @property
    def end_time_ms(self) -> Optional[int]:
        return self.segments[-1].footer.end_time_ms if self.segments else None

    def to_json(self) -> Dict[str, Any]:
        return {
            "base_revision": self.base_revision,
            "end_revision": self.end_revision,
            "segments": len(self.segments),
            "stop": self.stop.to_json() if self.stop else None,
            "lost": list(self.lost),
            "passed_over": [{"path": p, "why": w} for p, w in self.passed],
            "chosen_because": self.chosen_because,
            "begins_at": self.begins_at or None,
        }


def check_chain(
    paths: Iterable[str],
    start_revision: int,
    *,
    verify: bool = True,
    max_bytes: int = MAX_SEGMENT,
    base: Optional[BaseBackup] = None,
    not_after_ms: Optional[int] = None,
    opener: Optional[Opener] = None,
    verify_from: Optional[int] = None,
    key: Optional[bytes] = None,
    begins_at: Optional[int] = None,
) -> ChainCheck:
    """Follow the chain that starts after full backup revision ``start_revision``.

    Returns the good prefix and, if the chain does not run cleanly to its last segment, where
    and why it stops (a revision gap or missing segment, a corrupt file, a broken hash link).
    Segments of other chains among ``paths`` are ignored; a chain that cannot continue the full
    backup ``base`` (``continues``) and a file that does not begin as a segment are passed over,
    named in ``ChainCheck.passed``; a segment naming another base than its chain's first stops it.
    ``verify=False`` reads only headers and footers (cheap, for finding where a watcher resumes) and cannot see damage inside. With
    ``not_after_ms`` (a restore: now plus a margin) a segment dated after it - by its name, its
    footer or its mtime: a clock that jumped, or a planted file - stops the chain too: a time
    target could otherwise be met by a revision that happened later. Encrypted segments
    (``.seg.age``) are verified without their key (``segseal.verify_sealed``: no lease records,
    no events), or, with ``opener``, decrypted and verified whole by it. ``verify_from``: only
    segments that reach that revision are verified; the ones before it are followed by their
    headers and footers alone (a replay from a checkpoint reads nothing of them: see
    ``segments.Checkpoint``), and the first verified one's link to them is not checked.
    ``key`` (the manifest key) checks verified segments' signatures; with it or without, a
    segment less authenticated than one before it stops the chain as "forged" (``segsign``).
    ``begins_at``: a partial chain, its segments before that revision not here (a restore from the
    bucket fetches only what a replay from a checkpoint reads): it is followed from the segment
    starting there only if that one, verified whole, is signed with ``key`` and names ``base``'s
    snapshot sha256 - its signature covers its header, so the daemon wrote it after this very
    backup; its prev-sha link to the segments not here is not checked. The outline
    (``verify=False``) goes by the base sha256 its header names; what replays is verified.
    """
    walk = _Walk(_by_start(paths), start_revision, base,
                 _Loading(verify, max_bytes, not_after_ms, opener, verify_from, key), begins_at=begins_at or 0)
    while True:
        chosen, problems = walk.next_segment()
        if chosen is None:
            return walk.stopped(problems)
        walk.take(chosen)


def _by_start(paths: Iterable[str]) -> Dict[int, List[str]]:
    """The files named as segments, by the revision their name says they start at (sorted)."""
    by_start: Dict[int, List[str]] = {}
    for p in paths:
        rng = parse_name(os.path.basename(p))
        if rng is not None:
            by_start.setdefault(rng[0], []).append(p)
    for lst in by_start.values():
        lst.sort()
    return by_start


@dataclass(frozen=True)
class _Loading:
    """How ``check_chain`` reads each candidate (its keyword arguments)."""

    verify: bool
    max_bytes: int
    not_after_ms: Optional[int]
    opener: Optional[Opener]
    verify_from: Optional[int]
    key: Optional[bytes]

    def full(self, path: str) -> bool:
        """Is this file verified whole (else only its header and footer are read)?"""
        rng = parse_name(os.path.basename(path))
        return self.verify and (self.verify_from is None or rng is None or rng[1] >= self.verify_from)

    def load(self, path: str, full: bool) -> SegmentInfo:
        return _load_info(path, full, self.max_bytes, self.opener, self.key)


# what ``_Walk.judge`` makes of one candidate: "first" (the first segment of a chain that may
# continue the full backup), "fits" (links to the segment before), "" (not of this chain: passed
# over, or another base revision's), or why it stops the chain: "corrupt", "forged", "future",
# "mismatch" (with the reason)
_Verdict = Tuple[str, Optional[SegmentInfo], str]


@dataclass
class _Walk:
    """``check_chain``'s walk from the full backup's revision, one revision range at a time."""

    by_start: Dict[int, List[str]]
    start_revision: int
    base: Optional[BaseBackup]
    loading: _Loading
    good: List[SegmentInfo] = field(default_factory=list)
    used: Set[str] = field(default_factory=set)
    passed: List[Tuple[str, str]] = field(default_factory=list)
    foreign: Set[str] = field(default_factory=set)  # chain ids whose first segment continues another full backup
    because: str = ""
    prev: Optional[SegmentInfo] = None
    best: int = 0  # the best-proven origin of the segments followed (``segsign.rank``)
    begins_at: int = 0  # a partial chain's first revision (``check_chain``); 0: from the base

    @property
    def expect(self) -> int:
        return self.prev.end_revision + 1 if self.prev else (self.begins_at or self.start_revision + 1)

    def take(self, chosen: SegmentInfo) -> None:
        self.good.append(chosen)
        self.best = max(self.best, segsign.rank(chosen))
        self.used.add(chosen.disk_path)
        self.prev = chosen

    def next_segment(self) -> Tuple[Optional[SegmentInfo], List[Tuple[str, str, str]]]:
        """The segment that continues the chain at ``expect`` (None: it stops here), and the
        problems of the candidates that did not (kind, path, reason)."""
        problems: List[Tuple[str, str, str]] = []
        firsts: List[SegmentInfo] = []  # first segments that continue ``base`` (prev None)
        chosen: Optional[SegmentInfo] = None
        for p in [p for p in self.by_start.get(self.expect, []) if p not in self.used]:
            verdict, info, why = self.judge(p)
            if verdict == "first" and info is not None:
                firsts.append(info)
            elif verdict == "fits" and info is not None:
                # of two that fit (a forged twin beside a signed segment), the better-proven one
                if chosen is None or segsign.rank(info) > segsign.rank(chosen):
                    chosen = info
                if segsign.rank(chosen) == segsign.RANK["valid"]:
                    break
            elif verdict:
                problems.append((verdict, p, why))
        if firsts:
            chosen, self.because, others = _first(firsts, self.base)
            self.passed += others
        return chosen, problems

    def judge(self, p: str) -> _Verdict:
        """What this candidate at ``expect`` is to the chain followed so far."""
        anchor = self.prev is None and bool(self.begins_at)  # a partial chain's first: its signature decides
        full = self.loading.full(p) or (anchor and self.loading.verify)
        try:
            info = self.loading.load(p, full)
        except NotASegment as exc:
            self.passed.append((p, f"{exc.problem}: not a segment of any chain, whatever its name"))
            return "", None, ""
        except SegmentCorrupt as exc:
            return ("forged" if isinstance(exc, SegmentForged) else "corrupt"), None, exc.problem
        h = info.header
        if h.base_revision != self.start_revision:
            return "", None, ""  # another chain's segment that happens to start here
        ahead = _dated_after(p, info, self.loading.not_after_ms)
        if ahead:
            return "future", None, ahead
        if self.prev is None and self._passes_over(p, h):
            return "", None, ""
        forged = segsign.weaker(info, self.best)
        if forged:
            return "forged", None, forged
        why = self._anchored(info, full) if anchor else self._link(h, full)
        if why:
            return "mismatch", None, why
        return ("first" if self.prev is None else "fits"), info, ""

    def _passes_over(self, p: str, h: SegmentHeader) -> bool:
        """Before the chain's first segment: is this one of another full backup's chain (named in
        ``passed``, never replayed)?"""
        if h.seq == 0 and not continues(h, self.base):
            # the chain of another full backup at the same revision
            self.passed.append((p, f"the first segment of chain {h.chain_id[:8]}, which {names_base(h)}: "
                                   "another full backup's chain"))
            self.foreign.add(h.chain_id)
            return True
        if h.seq != 0 and _theirs(h, self.base, self.foreign):
            # the next segment of that chain (its first was idle, or ended before this one
            # starts): passed over too, not "not the first segment" - nothing of ours is lost
            self.passed.append((p, f"segment {h.seq} of chain {h.chain_id[:8]}, which {names_base(h)}: "
                                   "another full backup's chain"))
            return True
        return False

    def _anchored(self, info: SegmentInfo, full: bool) -> str:
        """Why a partial chain's first segment does not prove it continues the full backup ("" if
        it does): verified, signed with the manifest key, naming the backup's snapshot sha256."""
        h = info.header
        lacking = f"the earlier segments (revisions {self.start_revision + 1}..{self.begins_at - 1}) are not here"
        if not (self.base is not None and self.base.sha256 and h.base_sha256 == self.base.sha256):
            return f"{lacking} and it does not name this full backup's snapshot sha256 ({names_base(h)})"
        if full and (self.loading.key is None or info.signature != "valid"):
            return (f"{lacking} and it is {segsign.describe(info)}: only a segment signed with the manifest key "
                    "proves it continues this backup without them")
        return ""

    def _link(self, h: SegmentHeader, full: bool) -> str:
        """Why a segment with header ``h`` does not continue the segment before ("" if it does)."""
        prev = self.prev
        if prev is None:
            return "" if h.seq == 0 and h.prev_sha256 == "" else "is not the first segment of a chain"
        if not (h.chain_id == prev.header.chain_id and h.seq == prev.header.seq + 1 and (
                not full or not prev.sha256 or h.prev_sha256 == prev.sha256)):
            return (f"does not link to {os.path.basename(prev.path)} "
                    f"(chain {h.chain_id[:8]} seq {h.seq}, prev sha256 {h.prev_sha256[:12]}; "
                    f"expected chain {prev.header.chain_id[:8]} seq {prev.header.seq + 1}, "
                    f"sha256 {prev.sha256[:12] if prev.sha256 else '?'})")
        if h.base_sha256 != prev.header.base_sha256:
            # every segment names the full backup its events continue: one naming another is
            # not this chain's, however well it links
            return (f"{names_base(h)}, another full backup than its chain's first segment "
                    f"(which {names_base(prev.header)}): not replayed onto it")
        return ""

    def stopped(self, problems: List[Tuple[str, str, str]]) -> ChainCheck:
        """The result, now that nothing continues the chain at ``expect``: the first problem
        there, else a gap before a later file of this chain, else its clean end."""
        prev, expect = self.prev, self.expect
        last_rev = prev.end_revision if prev else self.start_revision
        last_time = prev.footer.end_time_ms if prev else None
        later = sorted(
            (s, p) for s, lst in self.by_start.items() if s > expect for p in lst
            if _same_chain(p, self.start_revision, prev, self.base, self.passed, self.foreign)
        )
        seen = tuple(self.passed)  # after ``later``: a file that is no segment was added to it
        if problems:
            kind, p, why = problems[0]
            stop = ChainStop(kind, f"{os.path.basename(p)}: {why}", expect, p, last_rev, last_time)
            lost = tuple(sorted({p for _k, p, _w in problems} | {p for _s, p in later}))
            return ChainCheck(self.start_revision, tuple(self.good), stop, lost, seen, self.because, self.begins_at)
        if later:
            nxt = later[0][0]
            reason = f"no segment covers revisions {expect}..{nxt - 1} (missing file); the next one starts at {nxt}"
            stop = ChainStop("gap", reason, expect, None, last_rev, last_time)
            return ChainCheck(self.start_revision, tuple(self.good), stop, tuple(p for _s, p in later), seen,
                              self.because, self.begins_at)
        return ChainCheck(self.start_revision, tuple(self.good), None, (), seen, self.because, self.begins_at)


def names_base(h: SegmentHeader) -> str:
    """What a segment's header says of the full backup it continues, for a sentence."""
    if h.base_sha256:
        return f"names the full backup with snapshot sha256 {h.base_sha256[:12]}... (revision {h.base_revision})"
    return f"names only revision {h.base_revision} (written before chains named their full backup's sha256)"


def _first(firsts: List[SegmentInfo], base: Optional[BaseBackup]) -> Tuple[SegmentInfo, str, List[Tuple[str, str]]]:
    """The first segment of the chain that continues ``base`` among several that may (two chains
    at one revision), why, and the others passed over. A sha256 match is proof; then the
    better-proven (``segsign.rank``: a forged twin beside a signed segment is not taken); then the
    chain that started soonest after the backup was taken (the daemon starts its chain right
    after its backup: a later one continues a later backup at the same revision)."""
    def rank(i: SegmentInfo) -> Tuple[bool, int, int, str]:
        exact = bool(base is not None and base.sha256 and i.header.base_sha256 == base.sha256)
        return (not exact, -segsign.rank(i), i.header.start_time_ms, i.path)

    order = sorted(firsts, key=rank)
    best, h = order[0], order[0].header
    name = os.path.basename(best.path)
    if base is not None and base.sha256 and h.base_sha256 == base.sha256:
        why = f"its first segment {name} names this full backup's snapshot sha256 {base.sha256[:12]}..."
    elif base is not None and base.sha256 == "" and h.base_sha256:
        why = (f"its first segment {name} {names_base(h)}; this backup's snapshot sha256 is not known here (no "
               "check recorded, no signed manifest), so it is matched by time: the chain started after it was taken")
    else:
        why = f"its first segment {name} {names_base(h)}, matched by revision and time"
    if len(order) > 1:
        why += (f"; of {len(order)} chains that could continue it, the one that names its sha256, then the "
                "best-proven, then the one that started first after it")
    others = [(o.path, f"the first segment of chain {o.header.chain_id[:8]}, which also {names_base(o.header)} but "
                       + (f"is less proven ({segsign.describe(o)}) than {name} ({segsign.describe(best)})"
                          if segsign.rank(o) < segsign.rank(best) else
                          f"started later ({ms_to_datetime(o.header.start_time_ms).isoformat()})")
                       + ": not the chain replayed") for o in order[1:]]
    return best, why, others


def _dated_after(path: str, info: SegmentInfo, not_after_ms: Optional[int]) -> str:
    """Why ``path`` is dated after ``not_after_ms`` ("" when it is not, or nothing to compare)."""
    if not_after_ms is None:
        return ""
    limit = ms_to_datetime(not_after_ms).isoformat(timespec="seconds")
    named = name_time_ms(os.path.basename(path))
    if named is not None and named > not_after_ms:
        return f"dated in the future by its name ({ms_to_datetime(named).isoformat()}, after {limit})"
    if info.footer.end_time_ms > not_after_ms:
        return f"dated in the future by its own end time ({ms_to_datetime(info.footer.end_time_ms).isoformat()})"
    try:
        mtime_ms = os.stat(path).st_mtime * 1000
    except OSError:
        return ""
    if mtime_ms > not_after_ms:
        return f"modified in the future (mtime {ms_to_datetime(int(mtime_ms)).isoformat(timespec='seconds')}, after {limit})"
    return ""


def _load_info(path: str, verify: bool, max_bytes: int, opener: Optional[Opener] = None,
               key: Optional[bytes] = None) -> SegmentInfo:
    if verify and is_sealed(path):
        return opener(path) if opener is not None else verify_sealed(path, key=key)
    if verify:
        return verify_segment(path, max_bytes=max_bytes, key=key)
    header, footer = read_summary(path)
    return SegmentInfo(path, os.path.getsize(path), "", header, footer)


def verified(path: str, key: Optional[bytes] = None) -> SegmentInfo:
    """One segment checked as far as it can be here: a plain one whole, an encrypted one without
    its key (what a watcher resumes after: its sha256, header and footer); signatures with ``key``."""
    return _load_info(path, True, MAX_SEGMENT, key=key)


def _theirs(h: SegmentHeader, base: Optional[BaseBackup], foreign: Set[str]) -> bool:
    """Is this later segment (seq > 0) of a chain that continues another full backup, by the
    base sha256 it names or by its chain id (whose first segment did)?"""
    return h.chain_id in foreign or bool(base is not None and base.sha256 and h.base_sha256
                                         and h.base_sha256 != base.sha256)


def _same_chain(path: str, base_revision: int, prev: Optional[SegmentInfo], base: Optional[BaseBackup],
                passed: List[Tuple[str, str]], foreign: Set[str]) -> bool:
    """Could this later file belong to the chain being followed? Unreadable files count as yes:
    a damaged segment must be reported as lost, never skipped silently. A file that is no
    segment at all (not a segment's first bytes) is no; it goes to ``passed``, named."""
    try:
        h = read_header(path)
    except NotASegment as exc:
        passed.append((path, f"{exc.problem}: not a segment of any chain, whatever its name"))
        return False
    except SegmentCorrupt:
        return True
    if h.base_revision != base_revision:
        return False
    if prev is None:  # nothing followed yet: a later file of another backup's chain is not ours
        if h.seq == 0:
            return continues(h, base)
        return not _theirs(h, base, foreign)
    return h.chain_id == prev.header.chain_id


def tail_sha256(path: str) -> str:
    """sha256 of a whole file (what the next segment's header must name)."""
    h = hashlib.sha256()
    try:
        with open_regular(path) as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot read: {exc.strerror or exc}") from None
    return h.hexdigest()


def describe(segments: Sequence[SegmentInfo]) -> str:
    if not segments:
        return "no segments"
    a, b = segments[0], segments[-1]
    return (
        f"{len(segments)} segment(s), revisions {a.start_revision}..{b.end_revision}, "
        f"{ms_to_datetime(a.header.start_time_ms).isoformat()} .. {ms_to_datetime(b.footer.end_time_ms).isoformat()}"
    )
