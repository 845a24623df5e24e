"""Where a delta chain stands: the next segment's position, a watcher's status, and resuming.

``ChainPosition`` is what the next segment's header needs (chain id, sequence, previous sha256);
``find_resume_point`` reads it back from the segments already on disk, so a restarted watcher
continues its chain instead of starting a new one. ``WatcherStatus`` is a watcher's state as the
daemon reports it (metrics, logs); ``WatchOptions`` how it closes segments and when it gives up;
``member_break`` / ``cancel_error`` what a member's header or a canceled watch mean for the chain.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Optional, Tuple

from etcd_agent.chain import sign as segsign
from etcd_agent.chain.check import BaseBackup, check_chain, verified
from etcd_agent.chain.errors import ChainBroken, SegmentCorrupt
from etcd_agent.chain.segments import SegmentHeader, SegmentInfo, list_segments
from etcd_agent.etcd.rpc import StreamEnded
from etcd_agent.typedjson import Document, Text

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import X25519Recipient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainPosition:
    """Where the next segment of a chain starts."""

    chain_id: str
    seq: int
    base_revision: int
    next_revision: int
    prev_sha256: str
    start_time_ms: int
    cluster_id: int = 0
    base_sha256: str = ""  # the full backup's snapshot this chain continues ("" unknown)

    @classmethod
    def new(cls, base_revision: int, now_ms: int, base_sha256: str = "") -> "ChainPosition":
        return cls(secrets.token_hex(16), 0, base_revision, base_revision + 1, "", now_ms, base_sha256=base_sha256)

    @classmethod
    def after(cls, info: SegmentInfo) -> "ChainPosition":
        h = info.header
        return cls(
            h.chain_id, h.seq + 1, h.base_revision, info.end_revision + 1, info.sha256,
            info.footer.end_time_ms, h.cluster_id, h.base_sha256,
        )

    def with_cluster(self, cluster_id: int) -> "ChainPosition":
        return dataclasses.replace(self, cluster_id=cluster_id)

    def header(self, endpoint: str) -> SegmentHeader:
        """The header of the segment that starts here, written by a watch of ``endpoint``."""
        return SegmentHeader(
            chain_id=self.chain_id, seq=self.seq, base_revision=self.base_revision, start_revision=self.next_revision,
            prev_sha256=self.prev_sha256, start_time_ms=self.start_time_ms, cluster_id=self.cluster_id,
            endpoint=endpoint, base_sha256=self.base_sha256,
        )


@dataclass(frozen=True)
class WatcherStatus(Document):
    """A watcher's state. Times are Unix ms (0: not known yet)."""

    state: Annotated[str, Text(32)]  # "starting" | "watching" | "reconnecting" | "stopped" | "broken"
    chain_id: Annotated[str, Text(64)]
    base_revision: int
    next_revision: int
    captured_revision: int  # written to a segment, closed or still open
    segments_written: int
    last_segment: Annotated[Optional[str], Text(4096)]
    broken: Annotated[Optional[str], Text(16 * 1024)]
    durable_revision: int = 0  # the end of the newest closed segment (on disk, visible)
    durable_time_ms: int = 0  # ... and its end time
    newest_event_ms: int = 0  # when the newest captured revision was received
    covered_ms: int = 0  # every revision committed before this time is captured (confirmed)
    member_revision: int = 0  # the member's revision at the last check
    member_checked_ms: int = 0
    reconnects: int = 0


@dataclass(frozen=True)
class WatchOptions:
    """How a watcher closes segments and when it gives up (seconds unless named otherwise)."""

    close_seconds: float = 5.0
    close_bytes: int = 4 * 1024 * 1024
    # > 0: a short watch this often, read until it has delivered the member's revision at its
    # creation, then canceled (``[backup.delta] batch_seconds``); 0: one streaming watch
    batch_seconds: float = 0.0
    idle_seconds: float = 60.0
    progress_timeout: float = 3.0
    heartbeat_seconds: float = 10.0
    silence_timeout: float = 45.0
    max_outage: float = 300.0
    rpc_timeout: float = 5.0
    max_message: int = 1024 * 1024 * 1024
    fragment: bool = False
    queue_size: int = 4096
    lease_refresh_limit: int = 10000
    # encrypt every segment to these age recipients ([backup] encrypt_to) and sign its seal with
    # the manifest key (``segseal``); () writes plain segments, their footers signed (``segsign``)
    recipients: Tuple["X25519Recipient", ...] = ()
    sign_key: Optional[bytes] = field(default=None, repr=False)


def find_resume_point(out_dir: str, base_revision: int, base: Optional[BaseBackup] = None, *,
                      key: Optional[bytes] = None) -> Optional[ChainPosition]:
    """The end of the chain continuing the full backup ``base`` (at ``base_revision``) already in
    ``out_dir`` (None: no chain yet). Only a chain that continues exactly that backup is resumed
    (``segchain.continues``): never one of another backup at the same revision, such as the
    chain of the cluster as it was before a restore.

    Links are followed by headers and footers only (cheap); the last segment is then read in
    full, and if it is damaged the one before it is tried: a resumed chain only ever continues
    from a segment that verifies. (``check_chain`` before a restore verifies every link.)

    ``key``: the manifest key the watcher signs with. What it writes next names the segment it
    resumes after by sha256, so its signature vouches for that segment and, by their links,
    every one before it (``segsign``): it resumes only after a segment signed with that key, and
    without a key never after signed ones. Otherwise ChainBroken: a new full backup starts a
    new chain, and the forged or unsigned tail is never signed over.
    """
    check = check_chain(list_segments(out_dir), base_revision, verify=False, base=base)
    if check.stop is not None:
        log.warning("delta chain of revision %d in %s: %s", base_revision, out_dir, check.stop.reason)
    for i in range(len(check.segments) - 1, -1, -1):
        try:
            last = verified(check.segments[i].path, key)
        except SegmentCorrupt as exc:
            log.warning("cannot resume after %s: %s; trying the segment before it", check.segments[i].path,
                        exc.problem)
            continue
        _vouch_for(last, check.segments[:i], key)
        return ChainPosition.after(last)
    return None


def _vouch_for(last: SegmentInfo, before: Tuple[SegmentInfo, ...], key: Optional[bytes]) -> None:
    """ChainBroken unless a watcher signing with ``key`` may continue the chain after ``last``."""
    name = os.path.basename(last.disk_path)
    if key is not None and last.signature != "valid":
        what = "not signed" if last.signature == "unsigned" else "not signed with this cluster's manifest key"
        raise ChainBroken(last.start_revision, f"the chain's last segment {name} is {what}: the next segment's "
                                               "signature would vouch for it")
    if key is None and (last.signature not in ("", "unsigned") or any(segsign.rank(s) for s in before)):
        raise ChainBroken(last.end_revision + 1, f"the chain up to {name} is signed and this host has no manifest "
                                                 "key: its next segments would be unsigned")


def member_break(pos: ChainPosition, cluster_id: int, revision: int, last: int) -> Optional[ChainBroken]:
    """Why a member whose header says (``cluster_id``, ``revision``), read after revision ``last``
    was captured, cannot continue the chain at ``pos`` (None: it can)."""
    if pos.cluster_id and cluster_id and cluster_id != pos.cluster_id:
        return ChainBroken(last + 1, f"the member now belongs to cluster {cluster_id:x}, not {pos.cluster_id:x} "
                                     "(restored from a backup, or another cluster)", restored=True)
    if revision < last:
        return ChainBroken(last + 1, f"the member is at revision {revision}, behind the chain's {last} "
                                     "(etcd was restored or the member's data replaced)", restored=True)
    return None


def cancel_error(compact_revision: int, cancel_reason: str, nxt: int) -> Exception:
    """What a canceled watch means: a break when history was compacted, else a reconnect."""
    if compact_revision or "compacted" in cancel_reason:
        return ChainBroken(
            nxt,
            f"etcd has compacted its history up to revision {compact_revision or '?'}: "
            f"revisions {nxt}..{max(nxt, compact_revision - 1)} are gone",
            compact_revision=compact_revision or None,
        )
    return StreamEnded(f"etcd canceled the watch: {cancel_reason or 'no reason given'}")
