"""Which of a chain's segments a point-in-time restore from the bucket fetches (issue 33 item 8).

A replay that starts from a checkpoint reads nothing of the chain before the segment holding that
checkpoint's lease census (``segments.Checkpoint.leases_from``): ``pitr.prepare`` verifies from
there on and follows the earlier segments by their headers and footers alone, to link the chain
to its full backup. With the manifest key those earlier segments need not be fetched at all: the
first segment fetched is taken only if its signature checks and it names the full backup's
snapshot sha256 (``check_chain``'s ``begins_at``), which its signature covers with the rest of its
header - the daemon wrote it after this very backup - and the later ones link to it by sha256.

What is fetched is chosen here from the listing (the segments' names carry their revisions) and
the footers of a few segments from the checkpoint's revision on, each one ranged read of its last
bytes (``reader.footer_from_tail``), until one names the checkpoint: the segment that vouches for
it says where its lease census is. Nothing read here is trusted: it only decides what to fetch;
the fetched run is checked from its content (``stagedchecks``), and if it turns out not to hold
what the replay needs, the restore fetches the rest (``frombucket``). Without the key, or when
anything here cannot be read or found, the whole chain is fetched, as before.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from etcd_agent.bucket import fetch, layout
from etcd_agent.errors import AgentError
from etcd_agent.fs import size_text

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.bucket.client import Bucket
    from etcd_agent.chain.segments import Checkpoint

log = logging.getLogger(__name__)

MAX_FOOTERS = 8  # footers read to find the segment that vouches for the checkpoint


@dataclass(frozen=True)
class Cut:
    """The chain's segments split where the replay from ``checkpoint`` begins to read them."""

    fetched: Tuple[fetch.Wanted, ...]  # from the segment holding the lease census on
    left: Tuple[fetch.Wanted, ...]  # before it: not fetched
    checkpoint: str
    leases_from: int

    def line(self) -> str:
        first, last = _range(self.left[0]), _range(self.left[-1])
        return (f"{len(self.left)} segment(s), revisions {first[0]}..{last[1]}, "
                f"{size_text(sum(w.size for w in self.left))}: before checkpoint {self.checkpoint}'s lease census "
                f"(revision {self.leases_from}) - a replay from it reads nothing of them; the fetched run is "
                "taken from its first segment's signature with the manifest key")


def _range(w: fetch.Wanted) -> Tuple[int, int]:
    from etcd_agent.chain.segments import parse_name

    rng = parse_name(w.file)
    assert rng is not None  # only segments that parse are cut (``cut``)
    return rng


def cut(b: "Bucket", segments: Sequence[fetch.Wanted], checkpoint: fetch.Wanted, revision: int) -> Optional[Cut]:
    """The segments from the one holding ``checkpoint``'s lease census on (the checkpoint at
    ``revision``, by its object's metadata: a claim, checked against the footers), or None: fetch
    them all (an encrypted chain, a name that does not parse, no footer among the first
    ``MAX_FOOTERS`` from ``revision`` on naming the checkpoint, anything unreadable)."""
    from etcd_agent.chain.segments import parse_name

    segs = [w for w in segments if w.kind == layout.SEGMENT]
    ranges = [parse_name(w.file) for w in segs]
    if not segs or any(r is None for r in ranges) or any(w.file.endswith(".age") for w in segs):
        return None
    order = sorted(zip(ranges, segs), key=lambda x: (x[0], x[1].file))
    cands = [w for r, w in order if r is not None and r[1] >= revision][:MAX_FOOTERS]
    found: Optional["Checkpoint"] = None
    for w in cands:
        cps = _checkpoints(b, w)
        if cps is None:
            return None
        found = next((c for c in cps if c.name == checkpoint.file and c.revision == revision), None)
        if found is not None:
            break
    if found is None:
        log.info("no footer of the %d segment(s) after revision %d names %s: the whole chain is fetched",
                 len(cands), revision, checkpoint.file)
        return None
    census = found.leases_from
    kept = [w for r, w in order if r is not None and r[1] >= census]
    left = [w for r, w in order if r is not None and r[1] < census]
    if not left:
        return None
    return Cut(tuple(kept), tuple(left), checkpoint.file, census)


def _checkpoints(b: "Bucket", w: fetch.Wanted) -> Optional[Tuple["Checkpoint", ...]]:
    """The checkpoints segment ``w``'s footer names, from one ranged read of its last bytes;
    None when it cannot be read (the caller fetches the whole chain)."""
    from etcd_agent.chain.errors import SegmentCorrupt
    from etcd_agent.chain.reader import TAIL_BYTES, footer_from_tail

    want = min(w.size, TAIL_BYTES)
    if want <= 0:
        return None
    try:
        with b.within(want), b.errors(f"reading the footer of {b.where(w.name)}"):
            body = b.client.get_object(Bucket=b.bucket, Key=b.key(w.name), Range=f"bytes=-{want}")["Body"]
            try:
                tail = body.read(want + 1)
            finally:
                body.close()
        if len(tail) != want:
            return None
        return footer_from_tail(b.where(w.name), tail, w.size).checkpoints
    except (AgentError, SegmentCorrupt) as exc:
        log.info("%s: %s: the whole chain is fetched", w.name, exc)
        return None


def without_key(segments: Sequence[fetch.Wanted]) -> List[str]:
    """The plan's line when the whole chain is fetched for want of the key."""
    n = sum(1 for w in segments if w.kind == layout.SEGMENT)
    if not n:
        return []
    return [f"all {n} segment(s) of the chain fetched: without the manifest key (--key-file) their signatures "
            "cannot be checked, so the chain is followed from the full backup, segment by segment"]
