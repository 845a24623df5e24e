"""Where each off-host copy lives in the bucket: keyed by content, so that two chains never share
a prefix.

Under the configured prefix::

    chains/<key>/<full backup name>                 the full backup that starts the chain
    chains/<key>/<segment name>                     its delta segments
    chains/<key>/checkpoints/<checkpoint name>      the checkpoints taken inside it

``<key>`` is the sha256 of the full backup's snapshot db, as its signed manifest and every segment
of its chain name it (``chain.BaseBackup``); for a full backup whose snapshot digest is not
known (a runbook tarball without a manifest) it is the archive file's own sha256, and such a
backup has no chain to go with it. Two chains that continue the same revision (an etcd 3.4
restore keeps the revision) have different keys; the same backup copied twice has one.

Copies made before this layout are still read, as **legacy**: full backups at the top of the
prefix, and segments under ``delta-<base revision, 16 digits>/``. Nothing new is written there.
``reach`` says how far a chain's segments in the bucket continue its full backup, by their names.
Pure: names in, names out.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from etcd_agent.backup.archive import parse_name as parse_backup_name
from etcd_agent.chain.segments import parse_name as parse_segment_name

CHAINS = "chains/"
CHECKPOINTS = "checkpoints/"
KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_CHAIN_RE = re.compile(r"^chains/([0-9a-f]{64})/(checkpoints/)?([^/]+)$")
_LEGACY_DELTA_RE = re.compile(r"^delta-(\d{16})/([^/]+)$")

FULL = "full"
SEGMENT = "segment"
CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class Placed:
    """What an object name under the prefix holds."""

    kind: str  # full | segment | checkpoint
    file: str  # the local file name it is a copy of
    key: str = ""  # the chain's key ("" for a legacy copy)
    legacy_revision: Optional[int] = None  # a legacy segment's delta-<revision>/

    @property
    def legacy(self) -> bool:
        return not self.key


def chain_dir(key: str) -> str:
    if not KEY_RE.match(key):
        raise ValueError(f"not a chain key (64 lowercase hex digits): {key!r}")
    return f"{CHAINS}{key}/"


def full_name(key: str, file: str) -> str:
    return chain_dir(key) + file


def segment_name(key: str, file: str) -> str:
    return chain_dir(key) + file


def checkpoint_name(key: str, file: str) -> str:
    return chain_dir(key) + CHECKPOINTS + file


def place(name: str) -> Optional[Placed]:
    """What ``name`` (relative to the prefix) is a copy of; None for anything else (never ours)."""
    m = _CHAIN_RE.match(name)
    if m:
        key, in_checkpoints, file = m.group(1), bool(m.group(2)), m.group(3)
        if parse_backup_name(file) is not None:
            return Placed(CHECKPOINT if in_checkpoints else FULL, file, key)
        if not in_checkpoints and parse_segment_name(file) is not None:
            return Placed(SEGMENT, file, key)
        return None
    if "/" not in name and parse_backup_name(name) is not None:
        return Placed(FULL, name)
    m = _LEGACY_DELTA_RE.match(name)
    if m and parse_segment_name(m.group(2)) is not None:
        return Placed(SEGMENT, m.group(2), legacy_revision=int(m.group(1)))
    return None


@dataclass(frozen=True)
class Reach:
    """What a chain's copies in the bucket reach, by their names alone (their bytes are checked
    when fetched): a point-in-time restore from the bucket gets at most to ``revision``."""

    segments: int
    checkpoints: int
    revision: Optional[int]  # the last revision reached without a missing segment (None: not past the backup)
    gap_after: Optional[int] = None  # a segment is missing after this revision, before later ones

    def describe(self) -> str:
        what = f"{self.segments} segment(s), {self.checkpoints} checkpoint(s) in the bucket"
        if self.revision is None:
            return f"{what}; a point-in-time restore from the bucket reaches no revision past the full backup"
        gap = f"; a segment is missing after revision {self.gap_after}" if self.gap_after is not None else ""
        return f"{what}; a point-in-time restore from the bucket reaches revision {self.revision}{gap}"

    def to_json(self) -> Dict[str, Optional[int]]:
        return {"segments": self.segments, "checkpoints": self.checkpoints, "revision": self.revision,
                "gap_after": self.gap_after}


def reach(names: Iterable[str], base_revision: Optional[int]) -> Reach:
    """How far the segments among ``names`` (a chain's objects under the prefix) continue the full
    backup at ``base_revision`` without a gap: each one starts where the one before ended, the
    first right after the backup (unknown base: the first segment is taken as the start)."""
    spans: List[Tuple[int, int]] = []
    checkpoints = 0
    for n in names:
        p = place(n)
        if p is None:
            continue
        if p.kind == CHECKPOINT:
            checkpoints += 1
        elif p.kind == SEGMENT:
            rng = parse_segment_name(p.file)
            if rng is not None:
                spans.append(rng)
    spans.sort()
    expect = base_revision + 1 if base_revision is not None else (spans[0][0] if spans else 0)
    reached: Optional[int] = None
    for start, end in spans:
        if start < expect:
            continue  # one already counted (an encrypted and a plain copy of the same span)
        if start > expect:
            return Reach(len(spans), checkpoints, reached, expect - 1)
        reached, expect = end, end + 1
    return Reach(len(spans), checkpoints, reached)
