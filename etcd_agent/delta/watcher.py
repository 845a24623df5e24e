"""DeltaWatcher: a watch on the local etcd member, written into a chain of delta segments.

The watch covers the whole keyspace from the revision after the newest full backup (or from the
end of that backup's chain already in the directory: a restarted watcher resumes it). Every
response is decoded, grouped by revision (one TXN record per revision: a transaction never
spans two segments), and appended to the open segment.

Coverage is confirmed by revision, not by watch progress requests: at time t the watcher reads
the member's current revision H (a serializable count-only Range); once the watch has delivered
H, every revision this member had applied before t is in the chain. (etcd answers a progress
request only when the watch is synced - while catching up it drops it - and a request-capable
stream is a bidirectional one, which costs more CPU per message in grpc's Python API than the
server-streaming call used here.) The same check is the liveness test: behind H and not
advancing for ``silence_timeout`` means a stuck stream, which is reconnected.

A segment is closed

- every ``close_seconds`` when it holds events: right after revision H of a check made then,
  with end time t and ``confirmed`` set; if H is not delivered within ``progress_timeout``
  (a long catch-up), at the last event, unconfirmed;
- at once when it reaches ``close_bytes`` (at a revision boundary, unconfirmed);
- every ``idle_seconds`` when nothing happened: an empty, confirmed segment, so the chain's time
  coverage and the lease TTLs keep moving forward.

Fragments: off by default. etcd 3.5.16 splits a response into fragments with a loop that
recomputes the message size after every event it adds - quadratic in the events of one
response: a single 118,000-key revision stalled the member's watch sender for minutes (and its
shutdown) where the unfragmented 2.7 MB response went out at once. A new watch's first catch-up
batch is never fragmented anyway (etcd buffers it until the watch is announced, then sends it
whole), so the watcher accepts big messages (``max_message``, 1 GiB) instead. With
``fragment=True`` fragments are reassembled (bounded) before the revisions are cut.

Leases: a put with a lease id not seen before makes the watcher ask LeaseTimeToLive and record
the answer (``LeaseRecord``) right after that revision; at every close each live lease is asked
again; at the start of a run every existing lease (LeaseLeases) is recorded.

Never a silent gap: a compacted start revision, a revision the stream skips, a cluster id that
changes, a member whose revision is behind the chain (restored/replaced data), or a member
unreachable for ``max_outage`` seconds all raise ``ChainBroken(at_revision, reason)``. Any other
stream failure reconnects and resumes from the last written revision + 1.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

from etcd_agent.errors import EtcdError
from etcd_agent.fs import ensure_private_dir
from etcd_agent.state.locks import OperationLock

from . import proto
from .errors import ChainBroken, DeltaError, SegmentCorrupt
from .rpc import EtcdRpc, StreamEnded
from .segments import (
    PUT,
    Event,
    LeaseRecord,
    SegmentHeader,
    SegmentInfo,
    SegmentWriter,
    Txn,
    check_chain,
    list_segments,
    read_segment,
    remove_stale_temps,
)

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import TlsSection

log = logging.getLogger(__name__)

LOCK_NAME = ".delta-watcher.lock"
MAX_FRAGMENTED = 512 * 1024 * 1024  # one response reassembled from fragments, at most


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

    @classmethod
    def new(cls, base_revision: int, now_ms: int) -> "ChainPosition":
        return cls(secrets.token_hex(16), 0, base_revision, base_revision + 1, "", now_ms)

    @classmethod
    def after(cls, info: SegmentInfo) -> "ChainPosition":
        h = info.header
        return cls(
            h.chain_id, h.seq + 1, h.base_revision, info.end_revision + 1, info.sha256,
            info.footer.end_time_ms, h.cluster_id,
        )

    def with_cluster(self, cluster_id: int) -> "ChainPosition":
        return ChainPosition(
            self.chain_id, self.seq, self.base_revision, self.next_revision, self.prev_sha256,
            self.start_time_ms, cluster_id,
        )


@dataclass(frozen=True)
class WatcherStatus:
    state: str  # "starting" | "watching" | "reconnecting" | "stopped" | "broken"
    chain_id: str
    base_revision: int
    next_revision: int
    captured_revision: int
    segments_written: int
    last_segment: Optional[str]
    broken: Optional[str]

    def to_json(self) -> Dict[str, Any]:
        return {
            "state": self.state,
            "chain_id": self.chain_id,
            "base_revision": self.base_revision,
            "next_revision": self.next_revision,
            "captured_revision": self.captured_revision,
            "segments_written": self.segments_written,
            "last_segment": self.last_segment,
            "broken": self.broken,
        }

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "WatcherStatus":
        return cls(
            str(d["state"]), str(d["chain_id"]), int(d["base_revision"]), int(d["next_revision"]),
            int(d["captured_revision"]), int(d["segments_written"]), d.get("last_segment"), d.get("broken"),
        )


def find_resume_point(out_dir: str, base_revision: int) -> Optional[ChainPosition]:
    """The end of the chain of ``base_revision`` already in ``out_dir`` (None: no chain yet).

    Links are followed by headers and footers only (cheap); the last segment is then read in
    full, and if it is damaged the one before it is tried: a resumed chain only ever continues
    from a segment that verifies. (``check_chain`` before a restore verifies every link.)
    """
    check = check_chain(list_segments(out_dir), base_revision, verify=False)
    if check.stop is not None:
        log.warning("delta chain of revision %d in %s: %s", base_revision, out_dir, check.stop.reason)
    for info in reversed(check.segments):
        try:
            return ChainPosition.after(read_segment(info.path).info)
        except SegmentCorrupt as exc:
            log.warning("cannot resume after %s: %s; trying the segment before it", info.path, exc.problem)
    return None


class DeltaWatcher:
    """Watch ``endpoint`` from full backup revision ``start_revision`` into segments in ``out_dir``.

    ``run(stop)`` blocks until ``stop`` is set (returns) or the chain breaks (raises
    ChainBroken); ``start()``/``stop()``/``join()`` run it on a thread of its own.
    """

    def __init__(
        self,
        endpoint: str,
        start_revision: int,
        out_dir: str,
        *,
        tls: "Optional[TlsSection]" = None,
        close_seconds: float = 5.0,
        close_bytes: int = 4 * 1024 * 1024,
        idle_seconds: float = 60.0,
        progress_timeout: float = 3.0,
        heartbeat_seconds: float = 10.0,
        silence_timeout: float = 45.0,
        max_outage: float = 300.0,
        rpc_timeout: float = 5.0,
        max_message: int = 1024 * 1024 * 1024,
        fragment: bool = False,
        queue_size: int = 4096,
        lease_refresh_limit: int = 10000,
        on_segment: Optional[Callable[[SegmentInfo], None]] = None,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.base_revision = start_revision
        self.out_dir = out_dir
        self.tls = tls
        self.close_seconds = close_seconds
        self.close_bytes = close_bytes
        self.idle_seconds = idle_seconds
        self.progress_timeout = progress_timeout
        self.heartbeat_seconds = heartbeat_seconds
        self.silence_timeout = silence_timeout
        self.max_outage = max_outage
        self.rpc_timeout = rpc_timeout
        self.max_message = max_message
        self.fragment = fragment
        self.queue_size = queue_size
        self.lease_refresh_limit = lease_refresh_limit
        self.on_segment = on_segment
        self._wall_ms = wall_ms
        self._mono = monotonic

        self.pos = ChainPosition.new(start_revision, wall_ms())
        self._writer: Optional[SegmentWriter] = None
        self._mu = threading.Lock()  # the stream reader's handling vs. the timers and the finish
        self._created = False
        self._finished = False
        self._period_start = monotonic()
        self._last_event_ms = self.pos.start_time_ms
        self._last_advance = monotonic()
        self._catchup_until = 0
        self._fragments: List[Event] = []
        self._fragment_bytes = 0
        # the pending coverage check: (member revision H, wall ms before asking, monotonic)
        self._check: Optional[Tuple[int, int, float]] = None
        self._closing = False  # close the segment once the check's H is delivered
        self._last_check = 0.0
        self._covered_ms = 0  # every revision committed before this time is written ...
        self._covered_rev = 0  # ... and this was the last revision when it was confirmed
        # leases: last record of each lease known alive; ids to look up again; records waiting
        # for a segment to be written into
        self._leases: Dict[int, LeaseRecord] = {}
        self._lookup_again: Set[int] = set()
        self._pending_records: List[LeaseRecord] = []
        self._leases_listed = False
        self._outage_since: Optional[float] = None

        self.segments_written = 0
        self.responses = 0  # watch responses handled (counters for tests and metrics)
        self.fragments = 0
        self.reconnects = 0
        self.last_segment: Optional[SegmentInfo] = None
        self.state = "starting"
        self.broken: Optional[ChainBroken] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None

    # ------------------------------------------------------------ thread wrapper

    def start(self) -> None:
        self._thread = threading.Thread(target=self._thread_main, name="delta-watcher", daemon=True)
        self._thread.start()

    def _thread_main(self) -> None:
        try:
            self.run(self._stop)
        except BaseException as exc:  # surfaced by join()
            self._error = exc

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the watcher to close its segment and stop; raise what ended it, if anything."""
        self._stop.set()
        self.join(timeout)

    def join(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise DeltaError(f"delta watcher did not stop within {timeout:g}s")
        if self._error is not None:
            raise self._error

    @property
    def captured_revision(self) -> int:
        """The last revision written to a segment (closed or still open)."""
        return self._last_revision()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> WatcherStatus:
        return WatcherStatus(
            self.state, self.pos.chain_id, self.base_revision, self.pos.next_revision, self.captured_revision,
            self.segments_written, self.last_segment.path if self.last_segment else None,
            self.broken.message if self.broken else None,
        )

    # ------------------------------------------------------------ main loop

    def run(self, stop: threading.Event) -> None:
        ensure_private_dir(self.out_dir)
        lock = OperationLock(os.path.join(self.out_dir, LOCK_NAME), "delta watch").acquire()
        try:
            remove_stale_temps(self.out_dir)
            resumed = find_resume_point(self.out_dir, self.base_revision)
            if resumed is not None:
                self.pos = resumed
                self._last_event_ms = resumed.start_time_ms
                log.info("resuming delta chain %s at revision %d (segment %d)", resumed.chain_id[:8],
                         resumed.next_revision, resumed.seq)
            else:
                self.pos = ChainPosition.new(self.base_revision, self._wall_ms())
                log.info("new delta chain %s from revision %d", self.pos.chain_id[:8], self.pos.next_revision)
            self._period_start = self._mono()
            self._loop(stop)
        except ChainBroken as exc:
            self.broken = exc
            self.state = "broken"
            log.error("%s", exc.message)
            raise
        finally:
            try:
                self._finish()
            finally:
                if self.state != "broken":
                    self.state = "stopped"
                lock.release()

    def _loop(self, stop: threading.Event) -> None:
        backoff = 0.5
        while not stop.is_set():
            try:
                self._session(stop)
                return
            except ChainBroken:
                raise
            except EtcdError as exc:
                if "larger than max" in exc.message:
                    # etcd 3.5 sends a new watch's first catch-up batch (up to 1000 revisions)
                    # unfragmented; one bigger than we accept would come again on every retry
                    raise ChainBroken(
                        self._last_revision() + 1,
                        f"etcd's catch-up response exceeds {self.max_message} bytes ({exc.message})",
                    ) from None
                self.state = "reconnecting"
                self.reconnects += 1
                now = self._mono()
                if self._outage_since is None:  # the last session had connected: a new outage
                    self._outage_since = now
                    backoff = 0.5
                down = now - self._outage_since
                if down >= self.max_outage:
                    raise ChainBroken(
                        self._last_revision() + 1,
                        f"the member at {self.endpoint} could not be watched for {down:.0f}s ({exc.message})",
                    ) from None
                log.warning("delta watch on %s: %s; reconnecting from revision %d", self.endpoint, exc.message,
                            self._last_revision() + 1)
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _session(self, stop: threading.Event) -> None:
        """One watch stream. Responses are handled on the stream's reader thread (under
        ``self._mu``); this thread runs the timers and waits - always with a deadline."""
        rpc = EtcdRpc(
            self.endpoint, tls=self.tls, timeout=self.rpc_timeout, max_message=self.max_message,
            single_threaded_streams=True,
        )
        stream = None
        try:
            self._check_member(rpc.header())
            if not self._leases_listed:
                self._record_all_leases(rpc)
            with self._mu:
                self._created = False
                self._fragments, self._fragment_bytes = [], 0
                self._check = None
                self._closing = False
                self._last_advance = self._mono()
                start = self._last_revision() + 1
            create = proto.encode_watch_create(
                b"\0", b"\0", start_revision=start, progress_notify=True, fragment=self.fragment
            )
            stream = rpc.watch(create, queue_size=self.queue_size, handler=lambda raw: self._on_response(raw, rpc))
            self._await_created(stream)
            self._outage_since = None
            self.state = "watching"
            while not stop.is_set():
                if stream.done.wait(0.25):
                    raise stream.failure or StreamEnded("watch stream ended")
                self._timers(rpc)
        finally:
            if stream is not None:
                stream.close()
            rpc.close()

    def _decode(self, raw: bytes) -> proto.WatchMessage:
        try:
            return proto.decode_watch_response(raw)
        except ValueError as exc:
            raise StreamEnded(f"malformed watch response ({exc})") from None

    def _check_member(self, hdr: proto.Header, last: Optional[int] = None) -> None:
        """``hdr`` was read after revision ``last`` had been captured (default: now)."""
        last = self._last_revision() if last is None else last
        if self.pos.cluster_id and hdr.cluster_id and hdr.cluster_id != self.pos.cluster_id:
            raise ChainBroken(
                last + 1,
                f"the member now belongs to cluster {hdr.cluster_id:x}, not {self.pos.cluster_id:x} "
                "(restored from a backup, or another cluster)",
            )
        if hdr.revision < last:
            raise ChainBroken(
                last + 1,
                f"the member is at revision {hdr.revision}, behind the chain's {last} "
                "(etcd was restored or the member's data replaced)",
            )
        if not self.pos.cluster_id:
            self.pos = self.pos.with_cluster(hdr.cluster_id)

    def _await_created(self, stream: Any) -> None:
        wait = max(self.rpc_timeout * 2, 10.0)
        deadline = self._mono() + wait
        while not self._created:
            if stream.done.wait(0.05):
                raise stream.failure or StreamEnded("watch stream ended before it was created")
            if self._mono() > deadline:
                raise StreamEnded(f"etcd did not confirm the watch within {wait:g}s")

    def _canceled(self, msg: proto.WatchMessage) -> None:
        nxt = self._last_revision() + 1
        if msg.compact_revision or "compacted" in msg.cancel_reason:
            raise ChainBroken(
                nxt,
                f"etcd has compacted its history up to revision {msg.compact_revision or '?'}: "
                f"revisions {nxt}..{max(nxt, msg.compact_revision - 1)} are gone",
                compact_revision=msg.compact_revision or None,
            )
        raise StreamEnded(f"etcd canceled the watch: {msg.cancel_reason or 'no reason given'}")

    # ------------------------------------------------------------ responses (reader thread)

    def _last_revision(self) -> int:
        if self._writer is not None:
            return self._writer.last_revision
        return self.pos.next_revision - 1

    def _on_response(self, raw: bytes, rpc: EtcdRpc) -> None:
        """One WatchResponse, on the stream's reader thread. Raising ends the stream (a
        reconnect or, for ChainBroken, the end of the run)."""
        msg = self._decode(raw)
        with self._mu:
            if self._finished:
                return
            if not self._created:
                if msg.created:
                    if msg.canceled:
                        self._canceled(msg)
                    # revisions up to the store's current one were committed before this moment:
                    # their receive time is only an upper bound of their commit time
                    self._catchup_until = msg.header.revision
                    self._created = True
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
            self._fragments.extend(msg.events)
            self._fragment_bytes += sum(len(e.key) + len(e.value) for e in msg.events)
            if self._fragment_bytes > MAX_FRAGMENTED:
                raise StreamEnded(f"a fragmented watch response exceeds {MAX_FRAGMENTED} bytes")
            return
        events = msg.events
        if self._fragments:
            events = tuple(self._fragments) + events
            self._fragments, self._fragment_bytes = [], 0
        if not events:
            # etcd's own progress notification (progress_notify, every 10 min when idle)
            if msg.header.revision > self._last_revision():
                raise StreamEnded(
                    f"progress at revision {msg.header.revision} but events only up to {self._last_revision()}"
                )
            return
        now_ms = self._wall_ms()
        self._last_event_ms = max(self._last_event_ms, now_ms)
        self._last_advance = self._mono()
        i, n = 0, len(events)
        while i < n:
            rev = events[i].mod_revision
            j = i + 1
            while j < n and events[j].mod_revision == rev:
                j += 1
            self._append(Txn(rev, now_ms, events[i:j], rev <= self._catchup_until), rpc)
            i = j
            self._confirm(rpc)  # may close the segment right after the checked revision
        if self._writer is not None and self._writer.size >= self.close_bytes:
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
            if ev.kind == PUT and ev.lease and ev.lease not in self._leases and ev.lease not in self._lookup_again:
                self._observe(rpc, ev.lease)
        self._flush_records()

    # ------------------------------------------------------------ coverage and timers

    def _confirm(self, rpc: Optional[EtcdRpc]) -> None:
        """(Locked) if the pending check's revision has been delivered: coverage confirmed up to
        the check's time; close the segment there if a close is due."""
        if self._check is None:
            return
        want, t_ms, _at = self._check
        last = self._last_revision()
        if last < want:
            return
        self._check = None
        self._covered_ms = max(self._covered_ms, t_ms)
        self._covered_rev = last
        if self._closing:
            self._closing = False
            self._close_segment(rpc, t_ms, confirmed=True)

    def _timers(self, rpc: EtcdRpc) -> None:
        """(Caller thread) start a coverage check when a close or a heartbeat is due; give up
        waiting for one after ``progress_timeout``; detect a stuck stream."""
        now = self._mono()
        with self._mu:
            has_events = self._writer is not None and self._writer.txns > 0
            due = now - self._period_start >= (self.close_seconds if has_events else self.idle_seconds)
            pending = self._check
            if pending is not None and now - pending[2] > self.progress_timeout:
                if self._closing:
                    self._closing = False
                    if has_events:  # a long catch-up: close at the last event, unconfirmed
                        self._close_segment(rpc, self._last_event_ms, confirmed=False)
                    else:
                        self._restart_period()
                behind = self._last_revision() < pending[0]
                if behind and now - self._last_advance > self.silence_timeout:
                    raise StreamEnded(
                        f"the member is at revision {pending[0]} but the watch delivered nothing for "
                        f"{now - self._last_advance:.0f}s (at {self._last_revision()})"
                    )
                if not behind or now - pending[2] > self.silence_timeout:
                    self._check = None
            start = self._check is None and (due or now - self._last_check >= self.heartbeat_seconds)
            captured = self._last_revision()
        if not start:
            return
        t_ms = self._wall_ms()  # before asking: every revision applied before t_ms is <= H
        hdr = rpc.header()
        with self._mu:
            self._check_member(hdr, captured)
            self._last_check = self._mono()
            self._check = (hdr.revision, t_ms, self._last_check)
            self._closing = due
            if self._last_revision() < hdr.revision:
                self._last_advance = max(self._last_advance, self._last_check)
            self._confirm(rpc)

    def _restart_period(self) -> None:
        self._period_start = self._mono()

    # ------------------------------------------------------------ segments

    def _ensure_writer(self) -> SegmentWriter:
        if self._writer is None:
            p = self.pos
            header = SegmentHeader(
                chain_id=p.chain_id, seq=p.seq, base_revision=p.base_revision, start_revision=p.next_revision,
                prev_sha256=p.prev_sha256, start_time_ms=p.start_time_ms, cluster_id=p.cluster_id,
                endpoint=self.endpoint,
            )
            self._writer = SegmentWriter(self.out_dir, header)
        return self._writer

    def _close_segment(self, rpc: Optional[EtcdRpc], end_ms: int, *, confirmed: bool) -> None:
        if rpc is not None:
            self._refresh_leases(rpc)
        writer = self._ensure_writer()
        self._flush_records()
        info = writer.close(end_ms, confirmed=confirmed)
        self._writer = None
        self.pos = ChainPosition.after(info)
        self.segments_written += 1
        self.last_segment = info
        self._restart_period()
        log.debug("closed %s (%d events)", os.path.basename(info.path), info.footer.events)
        if self.on_segment is not None:
            self.on_segment(info)

    def _finish(self) -> None:
        """On stop or break: keep what was captured (it is whole revisions) in a closed segment."""
        with self._mu:
            self._finished = True
            writer = self._writer
            if writer is None:
                return
            try:
                if writer.txns or writer.leases:
                    confirmed = self._covered_rev == writer.last_revision and self._covered_ms >= writer.last_time_ms
                    end = self._covered_ms if confirmed else self._last_event_ms
                    self._close_segment(None, end, confirmed=confirmed)
                else:
                    writer.abort()
                    self._writer = None
            except BaseException:
                writer.abort()
                self._writer = None
                raise

    # ------------------------------------------------------------ leases

    def _observe(self, rpc: EtcdRpc, lease_id: int) -> Optional[LeaseRecord]:
        try:
            ttl = rpc.lease_ttl(lease_id)
        except EtcdError as exc:
            log.warning("LeaseTimeToLive %x failed (%s); asking again at the next segment close", lease_id,
                        exc.message)
            self._lookup_again.add(lease_id)
            return None
        self._lookup_again.discard(lease_id)
        alive = ttl.ttl >= 0
        rec = LeaseRecord(lease_id, ttl.granted_ttl if alive else -1, ttl.ttl if alive else -1, self._wall_ms())
        if alive:
            self._leases[lease_id] = rec
        else:
            self._leases.pop(lease_id, None)
        self._pending_records.append(rec)
        return rec

    def _record_all_leases(self, rpc: EtcdRpc) -> None:
        for lid in rpc.lease_list():
            self._observe(rpc, lid)
        self._leases_listed = True

    def _refresh_leases(self, rpc: EtcdRpc) -> None:
        ids = list(self._leases)[: self.lease_refresh_limit] + sorted(self._lookup_again)
        for lid in ids:
            self._observe(rpc, lid)
        if len(self._leases) > self.lease_refresh_limit:
            # refresh the rest next time: the ones just asked go to the back
            for lid in ids[: self.lease_refresh_limit]:
                rec = self._leases.pop(lid, None)
                if rec is not None:
                    self._leases[lid] = rec

    def _flush_records(self) -> None:
        if self._pending_records:
            writer = self._ensure_writer()
            for rec in self._pending_records:
                writer.add_lease(rec)
            self._pending_records = []
