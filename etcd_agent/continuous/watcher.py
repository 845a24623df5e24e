"""DeltaWatcher: a watch on the local etcd member, written into a chain of delta segments.

The watch covers the whole keyspace from the revision after the newest full backup (or from the
end of that backup's chain already in the directory: a restarted watcher resumes it). Every
response is decoded, grouped by revision (one TXN record per revision: a transaction never
spans two segments), and appended to the open segment.

Coverage is confirmed by revision, not by watch progress requests (etcd drops those while a
watch catches up): at time t the watcher reads the member's revision H (a serializable
count-only Range); once the watch has delivered H, every revision applied before t is in the
chain. Behind H and not advancing for ``silence_timeout`` means a stuck stream: reconnected.

A segment is closed

- every ``close_seconds`` when it holds events: right after revision H of a check made then,
  with end time t and ``confirmed`` set; if H is not delivered within ``progress_timeout``
  (a long catch-up), at the last event, unconfirmed;
- at once when it reaches ``close_bytes`` (at a revision boundary, unconfirmed);
- every ``idle_seconds`` when nothing happened: an empty, confirmed segment, so the chain's time
  coverage and the lease TTLs keep moving forward.

Fragments are off by default (etcd 3.5.16 fragments quadratically; docs/delta-segments.md):
big messages (``max_message``, 1 GiB) are accepted instead; with ``fragment=True`` they are
reassembled (bounded; ``watchevents``, which also groups events by revision). Leases: see
``leasewatch``.

Never a silent gap: a compacted start revision, a revision the stream skips, a cluster id that
changes, a member whose revision is behind the chain (restored/replaced data), or a member
unreachable for ``max_outage`` seconds all raise ``ChainBroken(at_revision, reason)``. Any other
stream failure closes the open segment (what was captured is on disk at once), reconnects and
resumes from the last written revision + 1.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from etcd_agent.chain.check import BaseBackup
from etcd_agent.chain.errors import ChainBroken
from etcd_agent.chain.segments import PUT, Checkpoint, SegmentInfo, Txn
from etcd_agent.chain.vouching import Census, Vouching
from etcd_agent.chain.writer import SegmentWriter
from etcd_agent.continuous.leasewatch import LeaseTracker
from etcd_agent.continuous.position import (
    ChainPosition,
    WatcherStatus,
    WatchOptions,
    cancel_error,
    find_resume_point,
    member_break,
)
from etcd_agent.continuous.session import LOCK_NAME, OnItsThread, WatchRunner
from etcd_agent.continuous.watchevents import Fragments, by_revision, decode
from etcd_agent.errors import EtcdError
from etcd_agent.etcd import proto
from etcd_agent.etcd.rpc import EtcdRpc, StreamEnded

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import TlsSection

log = logging.getLogger(__name__)

__all__ = ["LOCK_NAME", "DeltaWatcher"]


class DeltaWatcher(OnItsThread):
    """Watch ``endpoint`` from full backup revision ``start_revision`` into segments in ``out_dir``.

    ``run(stop)`` blocks until ``stop`` is set (returns) or the chain breaks (raises
    ChainBroken); ``start()``/``stop()``/``join()`` run it on a thread of its own.
    """

    thread_name = "delta-watcher"

    def __init__(
        self,
        endpoint: str,
        start_revision: int,
        out_dir: str,
        *,
        tls: "Optional[TlsSection]" = None,
        options: Optional[WatchOptions] = None,
        on_segment: Optional[Callable[[SegmentInfo], None]] = None,
        base: Optional[BaseBackup] = None,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        monotonic: Callable[[], float] = time.monotonic,
        **overrides: Any,
    ) -> None:
        """``overrides``: WatchOptions fields (``close_seconds=0.5`` ...) over ``options``.
        ``base``: which full backup at ``start_revision`` the chain continues (its snapshot's
        sha256, written into every segment; only a chain of exactly that backup is resumed)."""
        super().__init__()
        self.endpoint = endpoint
        self.base_revision = start_revision
        self.base = base
        self.out_dir = out_dir
        self.tls = tls
        self.opt = dataclasses.replace(options or WatchOptions(), **overrides)
        self.on_segment = on_segment
        self._wall_ms = wall_ms
        self.monotonic = monotonic

        self.pos = ChainPosition.new(start_revision, wall_ms(), base.sha256 if base else "")
        self._writer: Optional[SegmentWriter] = None
        self._mu = threading.RLock()  # the stream reader's handling vs. the timers and the finish
        self.created = False
        self._finished = False
        self._period_start = monotonic()
        self._last_event_ms = self.pos.start_time_ms
        self._last_advance = monotonic()
        self._catchup_until = 0
        self._fragments = Fragments()
        # the pending coverage check: (member revision H, wall ms before asking, monotonic)
        self._check: Optional[Tuple[int, int, float]] = None
        self._watch_asked = 0.0  # monotonic: when the current watch's create request was sent
        self._vouching = Vouching()  # the daemon's checkpoints: censuses asked, vouches pending
        self._closing = False  # close the segment once the check's H is delivered
        self._last_check = 0.0
        self._covered_ms = 0  # every revision committed before this time is written ...
        self._covered_rev = 0  # ... and this was the last revision when it was confirmed
        self._leases = LeaseTracker(wall_ms, self.opt.lease_refresh_limit)
        self.member_revision = 0  # the member's revision at the last coverage check ...
        self.member_checked_ms = 0  # ... and when it was asked

        self.segments_written = 0
        self.responses = 0  # watch responses handled (counters for tests and metrics)
        self.fragments = 0
        self.reconnects = 0
        self.last_segment: Optional[SegmentInfo] = None
        self.state = "starting"
        self.broken: Optional[ChainBroken] = None

    def vouch(self, checkpoint: Checkpoint) -> None:
        """A full backup was just taken inside this chain: vouched for in a footer when ready
        (``vouching.Vouching``); never, if the watch ends first."""
        with self._mu:
            self._vouching.hand_over(checkpoint, self.monotonic())

    def lease_census(self, timeout: float = 30.0) -> Optional[int]:
        """Every lease the member has, observed (no refresh limit) into the open segment, for a
        checkpoint about to be taken: the chain's last revision then (``Checkpoint.leases_from``);
        None: not done within ``timeout``, the watch ended, or a lease could not be asked."""
        c = Census()
        with self._mu:
            if self._finished:
                return None
            self._vouching.ask(c)
        if not c.done.wait(timeout):
            with self._mu:
                self._vouching.forget(c)
            return None
        return c.revision

    def _run_censuses(self, rpc: EtcdRpc) -> None:
        """(The watch's thread) the lease censuses asked for since the last batch."""
        with self._mu:
            pending = self._vouching.take_censuses()
            if not pending:
                return
            rev: Optional[int] = None
            try:
                answers = [self._leases.observe(rpc, lid) for lid in rpc.lease_list()]
                self._flush_records()
                if all(a is not None for a in answers):
                    rev = self._last_revision()
            except EtcdError as exc:
                log.warning("delta: the lease census for a checkpoint failed: %s", exc.message)
            for c in pending:
                c.finish(rev)

    @property
    def vouches_pending(self) -> int:
        with self._mu:
            return self._vouching.pending

    @property
    def captured_revision(self) -> int:
        """The last revision written to a segment (closed or still open)."""
        return self._last_revision()

    def status(self) -> WatcherStatus:
        last = self.last_segment
        with self._mu:
            newest = self._last_event_ms if self._last_revision() > self.base_revision else 0
            covered = self._covered_ms
            if last is not None and last.footer.confirmed:
                covered = max(covered, last.footer.end_time_ms)
            return WatcherStatus(
                self.state, self.pos.chain_id, self.base_revision, self.pos.next_revision, self._last_revision(),
                self.segments_written, last.path if last else None, self.broken.message if self.broken else None,
                durable_revision=last.end_revision if last else self.pos.next_revision - 1,
                durable_time_ms=last.footer.end_time_ms if last else 0,
                newest_event_ms=newest, covered_ms=covered, member_revision=self.member_revision,
                member_checked_ms=self.member_checked_ms, reconnects=self.reconnects,
            )

    # ------------------------------------------------------------ main loop

    def run(self, stop: threading.Event) -> None:
        WatchRunner(self).run(stop)

    def resume(self) -> None:
        """(Run's start, under its lock) from the end of this backup's chain already in the
        directory, else a new chain."""
        resumed = find_resume_point(self.out_dir, self.base_revision, self.base, key=self.opt.sign_key)
        if resumed is not None:
            self.pos = resumed
            self._last_event_ms = resumed.start_time_ms
            log.info("resuming delta chain %s at revision %d (segment %d)", resumed.chain_id[:8],
                     resumed.next_revision, resumed.seq)
        else:
            self.pos = ChainPosition.new(self.base_revision, self._wall_ms(), self.base.sha256 if self.base else "")
            log.info("new delta chain %s from revision %d", self.pos.chain_id[:8], self.pos.next_revision)
        self._period_start = self.monotonic()

    def begin_session(self, rpc: EtcdRpc) -> None:
        """A new connection: the member checked (the same cluster, not behind the chain), its
        leases listed once, and no coverage check carried over from the last connection."""
        t_ms, hdr = self._wall_ms(), rpc.header()
        self._check_member(hdr)
        self.member_revision, self.member_checked_ms = hdr.revision, t_ms
        if not self._leases.listed:
            self._leases.record_all(rpc)
        with self._mu:
            self._check = None
            self._closing = False
            self._last_advance = self.monotonic()

    def next_watch(self, *, progress_notify: bool) -> Any:
        """The create request of the next watch (from the revision after the last one captured),
        its per-watch state reset."""
        with self._mu:
            self.created = False
            self._fragments.clear()
            start = self._last_revision() + 1
            self._watch_asked = self.monotonic()
        return proto.encode_watch_create(
            b"\0", b"\0", start_revision=start, progress_notify=progress_notify, fragment=self.opt.fragment
        )

    def caught_up(self) -> bool:
        """The watch created has delivered the revision the member had then (a batch's end)."""
        return self.created and self._last_revision() >= self._catchup_until

    def next_due(self) -> float:
        """(Monotonic) when the open segment's close or the next heartbeat check is due."""
        with self._mu:
            return min(self._period_start + self._period(), self._last_check + self.opt.heartbeat_seconds)

    def _has_events(self) -> bool:
        """(Locked) the open segment holds revisions."""
        return self._writer is not None and self._writer.txns > 0

    def _period(self) -> float:
        """(Locked) how long the open segment stays open: close_seconds with events, else idle_seconds."""
        return self.opt.close_seconds if self._has_events() else self.opt.idle_seconds

    def _check_member(self, hdr: proto.Header, last: Optional[int] = None) -> None:
        """``hdr`` was read after revision ``last`` had been captured (default: now)."""
        broken = member_break(self.pos, hdr.cluster_id, hdr.revision, self._last_revision() if last is None else last)
        if broken is not None:
            raise broken
        if not self.pos.cluster_id:
            self.pos = self.pos.with_cluster(hdr.cluster_id)

    def _canceled(self, msg: proto.WatchMessage) -> None:
        raise cancel_error(msg.compact_revision, msg.cancel_reason, self._last_revision() + 1)

    # ------------------------------------------------------------ responses (reader thread)

    def _last_revision(self) -> int:
        if self._writer is not None:
            return self._writer.last_revision
        return self.pos.next_revision - 1

    def on_response(self, raw: bytes, rpc: EtcdRpc) -> None:
        """One WatchResponse, on the stream's reader thread. Raising ends the stream (a
        reconnect or, for ChainBroken, the end of the run)."""
        msg = decode(raw, self.opt.max_message)
        with self._mu:
            if self._finished:
                return
            if not self.created:
                if msg.created:
                    if msg.canceled:
                        self._canceled(msg)
                    # the member as etcd creates the watch: the same cluster, not behind the chain.
                    # A batched watch is a new call on a channel gRPC reconnects by itself, so a
                    # member restored under it shows first here (a streaming watch's stream breaks
                    # instead and the reconnect checks it): without this a batch would go on to
                    # append the restored member's revisions past the chain's end to the chain
                    self._check_member(msg.header)
                    self._vouching.verified(self._watch_asked)
                    # revisions up to the store's current one were committed before this moment:
                    # their receive time is only an upper bound of their commit time
                    self._catchup_until = msg.header.revision
                    self.created = True
                return
            self._handle(msg, rpc)

    def _handle(self, msg: proto.WatchMessage, rpc: EtcdRpc) -> None:
        if msg.canceled:
            self._canceled(msg)
        if msg.created:
            return
        self.responses += 1
        if msg.fragment:
            self.fragments += 1
            self._fragments.add(msg.events)
            return
        events = self._fragments.whole(msg.events)
        if not events:
            # etcd's own progress notification (progress_notify, every 10 min when idle)
            if msg.header.revision > self._last_revision():
                raise StreamEnded(
                    f"progress at revision {msg.header.revision} but events only up to {self._last_revision()}"
                )
            return
        now_ms = self._wall_ms()
        self._last_event_ms = max(self._last_event_ms, now_ms)
        self._last_advance = self.monotonic()
        for txn in by_revision(events, now_ms, self._catchup_until):
            self._append(txn, rpc)
            self._confirm(rpc)  # may close the segment right after the checked revision
        if self._writer is not None and self._writer.size >= self.opt.close_bytes:
            self._close_segment(rpc, self._last_event_ms, confirmed=False)

    def _append(self, txn: Txn, rpc: EtcdRpc) -> None:
        last = self._last_revision()
        if txn.revision <= last:
            return  # already written (a resent response); never twice
        if txn.revision != last + 1:
            raise ChainBroken(
                last + 1,
                f"the watch skipped from revision {last} to {txn.revision}, which etcd never does: "
                "revisions in between are missing",
            )
        writer = self._ensure_writer()
        writer.add_txn(txn)
        for ev in txn.events:
            if ev.kind == PUT and ev.lease and self._leases.wants(ev.lease):
                self._leases.observe(rpc, ev.lease)
        self._flush_records()

    # ------------------------------------------------------------ coverage and timers

    def _confirm(self, rpc: Optional[EtcdRpc]) -> None:
        """(Locked) if the pending check's revision has been delivered: coverage confirmed up to
        the check's time; close the segment there if a close is due."""
        if self._check is None:
            return
        want, t_ms, at = self._check
        last = self._last_revision()
        if last < want:
            return
        self._check = None
        self._covered_ms = max(self._covered_ms, t_ms)
        self._covered_rev = last
        if self._closing:
            self._closing = False
            # the next period counts from this check, not from the end of the close: closing
            # (delivery of H, the lease refresh, the fsync) takes time, and counted from its end
            # the segments' end times drifted apart by close_seconds plus that, which is what a
            # disaster then lost (a write 5.04 s old lost at close_seconds = 5)
            self._close_segment(rpc, t_ms, confirmed=True, period_from=at)

    def timers(self, rpc: EtcdRpc) -> None:
        """(Caller thread) start a coverage check when a close or a heartbeat is due; give up
        waiting for one after ``progress_timeout``; detect a stuck stream."""
        self._run_censuses(rpc)
        now = self.monotonic()
        with self._mu:
            has_events = self._has_events()
            due = now - self._period_start >= self._period()
            pending = self._check
            if pending is not None and now - pending[2] > self.opt.progress_timeout:
                if self._closing:
                    self._closing = False
                    if has_events:  # a long catch-up: close at the last event, unconfirmed
                        self._close_segment(rpc, self._last_event_ms, confirmed=False)
                    else:
                        self._restart_period()
                behind = self._last_revision() < pending[0]
                if behind and now - self._last_advance > self.opt.silence_timeout:
                    raise StreamEnded(
                        f"the member is at revision {pending[0]} but the watch delivered nothing for "
                        f"{now - self._last_advance:.0f}s (at {self._last_revision()})"
                    )
                if not behind or now - pending[2] > self.opt.silence_timeout:
                    self._check = None
            start = self._check is None and (due or now - self._last_check >= self.opt.heartbeat_seconds)
            captured = self._last_revision()
        if not start:
            return
        t_ms = self._wall_ms()  # before asking: every revision applied before t_ms is <= H
        asked = self.monotonic()
        hdr = rpc.header()
        with self._mu:
            self._check_member(hdr, captured)
            self._vouching.verified(asked)
            self.member_revision, self.member_checked_ms = hdr.revision, t_ms
            self._last_check = self.monotonic()
            self._check = (hdr.revision, t_ms, self._last_check)
            self._closing = due
            if self._last_revision() < hdr.revision:
                self._last_advance = max(self._last_advance, self._last_check)
            self._confirm(rpc)

    def _restart_period(self, start: Optional[float] = None) -> None:
        self._period_start = self.monotonic() if start is None else start

    # ------------------------------------------------------------ segments

    def _ensure_writer(self) -> SegmentWriter:
        if self._writer is None:
            self._writer = SegmentWriter(self.out_dir, self.pos.header(self.endpoint),
                                         recipients=self.opt.recipients, sign_key=self.opt.sign_key)
        return self._writer

    def _close_segment(self, rpc: Optional[EtcdRpc], end_ms: int, *, confirmed: bool,
                       period_from: Optional[float] = None) -> None:
        """Checkpoints handed over before the member was last found the chain's own (asked after
        them), whose revision the segment reaches, are vouched for in its footer: whatever closes
        it (time, size, a stop), the chain had written that far and seen the same member after
        the backup."""
        if rpc is not None:
            self._leases.refresh(rpc)
        writer = self._ensure_writer()
        self._flush_records()
        ready = self._vouching.ready(writer.last_revision)
        try:
            info = writer.close(end_ms, confirmed=confirmed, checkpoints=ready)
        except BaseException:
            # it aborted itself (a full disk): its revisions are not in the chain, which ends at
            # the last closed segment; the next watch resumes there and captures them again
            self._writer = None
            raise
        if ready:
            log.info("delta chain %s vouches for checkpoint(s) %s in %s", self.pos.chain_id[:8],
                     ", ".join(f"{cp.name} (revision {cp.revision})" for cp in ready), os.path.basename(info.path))
        self._writer = None
        self.pos = ChainPosition.after(info)
        self.segments_written += 1
        self.last_segment = info
        self._restart_period(period_from)
        log.debug("closed %s (%d events)", os.path.basename(info.path), info.footer.events)
        if self.on_segment is not None:
            self.on_segment(info)

    def close_open_segment(self) -> None:
        """(Caller thread, the stream gone) close the open segment at its last event, unconfirmed."""
        with self._mu:
            writer = self._writer
            if writer is not None and (writer.txns or writer.leases):
                self._close_segment(None, max(self._last_event_ms, writer.last_time_ms), confirmed=False)

    def finish(self) -> None:
        """On stop or break: keep what was captured (it is whole revisions) in a closed segment;
        with nothing new captured, an empty one carries the confirmed coverage up to now (a chain
        that ends at a stop then covers the time until the stop)."""
        with self._mu:
            self._finished = True
            self._vouching.cancel_censuses()
            writer = self._writer
            if writer is not None and not writer.is_open:  # a failed write aborted it: nothing to close
                self._writer = writer = None
            idle_covered = self._covered_rev == self._last_revision() and self._covered_ms > self.pos.start_time_ms
            if writer is None:
                if idle_covered:
                    self._close_segment(None, self._covered_ms, confirmed=True)
                return
            try:
                if writer.txns or writer.leases:
                    confirmed = self._covered_rev == writer.last_revision and self._covered_ms >= writer.last_time_ms
                    end = self._covered_ms if confirmed else self._last_event_ms
                    self._close_segment(None, end, confirmed=confirmed)
                elif idle_covered:
                    self._close_segment(None, self._covered_ms, confirmed=True)
                else:
                    writer.abort()
                    self._writer = None
            except BaseException:
                if self._writer is not None:
                    writer.abort()
                    self._writer = None
                raise

    def _flush_records(self) -> None:
        records = self._leases.take_pending()
        if records:
            writer = self._ensure_writer()
            for rec in records:
                writer.add_lease(rec)
