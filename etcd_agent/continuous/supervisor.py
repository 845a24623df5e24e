"""The daemon's continuous backup: one delta watch on this host's member, always continuing the
newest full backup here, never with a silent gap.

``DeltaSupervisor`` runs on a thread of its own, started and stopped with the daemon; the watch
runs on another (``DeltaWatcher``), off-host copies on a third (``bucket.copier``). Nothing it waits for (a
full backup of a big db, a slow bucket) can delay a daemon cycle, and no daemon cycle can delay
the watch. Every ``TICK`` seconds it looks and decides (``decision.decide``, pure):

- continuous backup disabled, or a restore journaled for this member: no watch (hands off, as
  the daemon's cycle is; the restored cluster gets a new chain afterwards);
- no full backup on this host, or the chain broke (compacted history, a long outage, a member
  restored or replaced), or the chain passed a bound of ``[backup.delta]``: a full backup now
  (``backup.service.take_backup``), then a new chain from its revision - said in the log, counted
  in the metrics, the break recorded beside the segments for restores to name;
- the cluster's membership (the member list the daemon's cycle asks) is no longer the one the
  newest full backup's snapshot holds (``membership.compare``): a full backup of the new one, and
  the running chain ends there (recorded like a break, for restores to name), backing off as
  breaks do when it keeps changing;
- a newer full backup appeared (cron): the watch moves to a new chain continuing it;
- the chain grew by ``checkpoint_ratio`` times its full backup's size since the last checkpoint: a
  checkpoint - a full backup taken inside the chain, which goes on - that the chain then vouches
  for (``DeltaWatcher.vouch``), so a point-in-time restore replays only what follows it;
- another daemon on this host holds the backup dir's watch (one-host clusters): standby.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Dict, Optional, Sequence, Tuple

from etcd_agent.chain import chains
from etcd_agent.chain.errors import ChainBroken
from etcd_agent.chain.segments import SegmentInfo
from etcd_agent.config import Config, Member
from etcd_agent.continuous import breaks, checkpoints, membership, reporting, status
from etcd_agent.continuous.copyqueue import CopyQueue
from etcd_agent.continuous.decision import BREAK_BACKOFF, STABLE_AFTER, Facts, Full, break_backoff, decide
from etcd_agent.continuous.membertrack import MembershipTracker
from etcd_agent.continuous.newestfull import NewestFull
from etcd_agent.continuous.position import WatcherStatus, WatchOptions
from etcd_agent.continuous.watcher import DeltaWatcher
from etcd_agent.errors import AgentError, BusyError
from etcd_agent.memory import release_freed_memory

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.bucket.copier import CopyStatus
    from etcd_agent.etcd.client import MemberInfo

log = logging.getLogger(__name__)

TICK = 1.0
TEXTFILE_EVERY = 5.0
RETRY_AFTER = 10.0  # a failed watcher start is tried again after this
BACKUP_RETRY = (2.0, 30.0)  # a failed full backup: again after 2 s, doubling up to 30 s


class DeltaSupervisor:
    """``start()`` / ``stop()``; ``status()`` for metrics. ``source()`` returns the daemon's current
    config and member (a reload takes effect at the next tick)."""

    def __init__(self, source: Callable[[], Tuple[Config, Member]], *, tick: float = TICK) -> None:
        self._source = source
        self.tick_seconds = tick
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._mu = threading.Lock()
        self.watcher: Optional[DeltaWatcher] = None
        self._full: Optional[Full] = None  # what the running watcher continues
        self._newest: Optional[Full] = None
        self._unusable = ""
        self._finder = NewestFull()
        self._broken = ""  # why the last watch could not go on, until a full backup is taken
        self._broken_reason = ""  # its metrics label
        self._retry_at = 0.0
        self._backup_failures = 0
        self._state = "starting"
        self._detail = ""
        self._totals = (0, 0, 0)  # the current chain: events, bytes, segments
        self._breaks_total: Optional[int] = None
        self._full_backups: Dict[str, int] = {}
        self._textfile_at = 0.0
        self._copies = CopyQueue(source)
        self._breaks_in_row = 0
        self._chain_started = 0.0  # monotonic: when the running chain's watcher started
        self._last_chain_backup = -BREAK_BACKOFF[1]  # monotonic: the last full backup taken for a break
        self._said_backoff = False
        # checkpoints of the running chain: its bytes since the last one (or since its start),
        # and when the last one was taken or tried (monotonic)
        self._cp_bytes = 0
        self._cp_at = 0.0
        self._members = MembershipTracker()

    # ------------------------------------------------------------ thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="delta-supervisor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._stop_watcher("the daemon stops")
        self._copies.stop()
        self._write_textfile(force=True)

    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad tick must not end continuous backup; the next one retries
                log.exception("delta supervisor tick failed")
                self._retry_at = time.monotonic() + RETRY_AFTER
            self._stop.wait(self.tick_seconds)

    # ------------------------------------------------------------ one tick

    def tick(self) -> str:
        from etcd_agent.state import markers

        cfg, me = self._source()
        self._copies.follow(cfg)
        self._follow_encryption(cfg)
        if self._breaks_total is None:
            self._breaks_total = status.read_breaks(cfg.backup.dir)[0] if os.path.isdir(cfg.backup.dir) else 0
            from etcd_agent.backup.lean import sweep_at_start

            sweep_at_start(cfg)  # a checkpoint's stage a killed daemon left (plaintext, when encrypted)
        restoring = bool(markers.read_restore(cfg, me.name))
        self._collect_watcher(cfg, restoring)
        facts = self._look(cfg, restoring)
        action, why = decide(facts)
        if action in ("stop", "none", "wait"):
            self._hold(action, why, facts)
        else:
            self._act(action, why, cfg, me)
        self._write_textfile(cfg)
        return action

    def _look(self, cfg: Config, restoring: bool) -> Facts:
        """What this tick sees (``decide``'s input); the newest full backup looked up when a watch
        may run."""
        enabled = cfg.backup.delta.enabled
        change = membership.Change()
        if enabled and not restoring:
            self._newest, self._unusable = self._finder.look(cfg)
            change = self._follow_membership()
        return Facts(
            enabled=enabled, restore_in_progress=restoring, newest=self._newest, newest_unusable=self._unusable,
            watching_base=self._full.revision if self.watcher is not None and self._full else None,
            broken=self._broken, over_bounds=self._over_bounds(cfg), retry_wait=time.monotonic() < self._retry_at,
            breaks_in_row=self._breaks_in_row, backoff_left=self._backoff_left(),
            checkpoint_due=self._checkpoint_due(cfg), membership=self._members.pending,
            membership_half_done=change.half_done, half_done_for=self._members.half_done_for(),
        )

    def _hold(self, action: str, why: str, facts: Facts) -> None:
        """stop, none, wait: no backup taken, no watch started; the state says why."""
        if action == "stop":
            self._stop_watcher(why)
            self._state, self._detail = ("disabled" if not facts.enabled else "paused"), why
        elif action == "none" and facts.membership:  # a membership backup held back: the status says why
            self._detail = why
        elif action == "none" and self.watcher is None:
            self._state, self._detail = ("disabled" if not facts.enabled else
                                         "paused" if facts.restore_in_progress else self._state), why
        elif action == "wait" and facts.backoff_left > 0 and not facts.retry_wait:
            self._state, self._detail = "backoff", why
            if not self._said_backoff:
                log.warning("delta: %s", why)
                self._said_backoff = True

    def _act(self, action: str, why: str, cfg: Config, me: Member) -> None:
        """backup, rebase, start, checkpoint."""
        if action == "backup":
            self._full_backup(cfg, me, why)
        elif action == "rebase":
            log.info("delta: %s", why)
            self._stop_watcher(why)
            self._start_watcher(cfg, me)
            self._prune(cfg)
        elif action == "start":
            self._start_watcher(cfg, me)
        elif action == "checkpoint":
            self._checkpoint(cfg, me, why)

    def copies(self) -> "Optional[CopyStatus]":
        """The copy queue's status (None while [backup.remote] is disabled)."""
        return self._copies.status()

    def _follow_encryption(self, cfg: Config) -> None:
        """A changed ``[backup] encrypt_to`` (a reload): the open segment is closed as it was begun
        and the chain goes on, its next segments to the new recipients (or in the clear)."""
        w = self.watcher
        if w is None or not w.running:
            return
        from etcd_agent.backup.service import recipients_of

        if tuple(w.opt.recipients) != tuple(recipients_of(cfg)):
            log.info("delta: [backup] encrypt_to changed: the watch closes its segment and goes on with the new "
                     "setting")
            self._stop_watcher("encrypt_to changed")

    def _collect_watcher(self, cfg: Config, restoring: bool = False) -> None:
        """If the watcher thread ended: why (a break is recorded and counted)."""
        w = self.watcher
        if w is None or w.running:
            if w is not None:
                self._state = w.state
            return
        self.watcher = None
        try:
            w.join(0)
            self._state = "stopped"
        except ChainBroken as exc:
            self._on_break(cfg, w, exc, restoring)
        except BusyError as exc:
            self._state, self._detail = "standby", exc.message
            self._retry_at = time.monotonic() + RETRY_AFTER
            log.debug("delta: %s", exc.message)
        except AgentError as exc:
            self._state, self._detail = "stopped", exc.message
            log.warning("delta watch on %s ended: %s; starting it again in %.0fs", w.endpoint, exc.message, RETRY_AFTER)
            self._retry_at = time.monotonic() + RETRY_AFTER

    def _backoff_left(self) -> float:
        if not self._broken and not self._members.pending:
            return 0.0
        return max(0.0, self._last_chain_backup + break_backoff(self._breaks_in_row) - time.monotonic())

    def _count_break(self) -> None:
        """One more break in a row, unless the chain had run long enough to count as sound."""
        ran = time.monotonic() - self._chain_started
        self._breaks_in_row = 1 if ran >= STABLE_AFTER else self._breaks_in_row + 1
        self._said_backoff = False

    def _on_break(self, cfg: Config, w: DeltaWatcher, exc: ChainBroken, restoring: bool = False) -> None:
        """``restoring``: a restore of this member is in progress (its marker is here): a member
        found replaced is that restore, which records itself as it finishes; recorded here too it
        would be a second boundary, taken for a restore by hand (the batched watch can see the
        restored member before the tick that stops it for the restore)."""
        self._count_break()
        if exc.restored and not restoring:
            self._record_boundary(cfg, w, exc)
        full = self._full.name if self._full else f"revision {w.base_revision}"
        if w.pos.seq == 0 and w.segments_written == 0 and exc.at_revision == w.base_revision + 1:
            # nothing was ever captured after this full backup: no chain broke, the backup is
            # just older than etcd's history (the daemon's first start, or a long stop before any)
            self._broken, self._broken_reason = f"{full} is older than etcd's history", "stale_full_backup"
            self._state, self._detail = "starting", exc.message
            log.info("delta: cannot start a chain from %s: %s; taking a full backup to start from", full, exc.message)
            return
        self._broken, self._broken_reason = "the chain broke", "chain_broken"
        self._state, self._detail = "broken", exc.message
        self._breaks_total = breaks.record_break(cfg, w, exc, self._breaks_total or 0)
        log.error("delta: CHAIN BROKEN (continuing %s): %s; taking a full backup and starting a new chain "
                  "(break #%d)", full, exc.message, self._breaks_total)

    def _record_boundary(self, cfg: Config, w: DeltaWatcher, exc: ChainBroken) -> None:
        """The member's data was replaced under the chain. A restore of the agent's records itself
        as it finishes; one it did not record (by hand: etcdutl, no journal) is recorded here, so
        the backups from before it are kept and listed as such (``backup.boundaries``)."""
        # since the chain's full backup: a watch restarted on it after the agent's restore (its
        # first segment newer than the restore's record) breaks for that same restore
        starts = [self._full.time] if self._full else []
        if w.pos.seq == 0:
            starts.append(w.pos.start_time_ms / 1000.0)
        breaks.record_by_hand(cfg, min(starts, default=0.0), exc)

    def saw_members(self, members: "Optional[Sequence[MemberInfo]]") -> None:
        """(The daemon's thread) the member list its cycle asked (None: no member answered)."""
        self._members.saw(members)

    def _follow_membership(self) -> membership.Change:
        """The cluster's members against the newest full backup's (``MembershipTracker.follow``); a
        new difference counted like a break, so that a membership that keeps changing backs off."""
        change, began = self._members.follow(self._newest, broken=bool(self._broken))
        if began:
            self._count_break()
        return change

    def _over_bounds(self, cfg: Config) -> str:
        if self.watcher is None:
            return ""
        d = cfg.backup.delta
        events, size, segs = self._totals
        if events > d.max_chain_events:
            return f"max_chain_events ({events} > {d.max_chain_events})"
        if size > d.max_chain_bytes:
            return f"max_chain_bytes ({size} > {d.max_chain_bytes})"
        if segs > d.max_chain_segments:
            return f"max_chain_segments ({segs} > {d.max_chain_segments})"
        return ""

    def _checkpoint_due(self, cfg: Config) -> str:
        w, full = self.watcher, self._full
        if w is None or full is None or not w.running or not w.pos.chain_id or w.vouches_pending:
            return ""  # no chain, or the last checkpoint is not vouched for yet
        with self._mu:
            grown = self._cp_bytes
        return checkpoints.due(cfg.backup.delta, grown, full.size, time.monotonic() - self._cp_at, full.name)

    # ------------------------------------------------------------ actions

    def _checkpoint(self, cfg: Config, me: Member, why: str) -> None:
        """A full backup inside the running chain (``checkpoints.take``)."""
        w = self.watcher
        if w is None:
            return
        log.info("delta: %s", why)
        self._cp_at = time.monotonic()  # taken or not, the next try waits checkpoint_min_seconds
        if checkpoints.take(cfg, me.name, w) is not None:
            with self._mu:
                self._cp_bytes = 0
            self._copies.nudge()
            self._full_backups["checkpoint"] = self._full_backups.get("checkpoint", 0) + 1

    def _full_backup(self, cfg: Config, me: Member, why: str) -> None:
        from etcd_agent.backup.outstream import low_memory
        from etcd_agent.backup.service import take_backup

        ending = "" if self._broken else self._members.pending  # what a membership backup ends the chain for
        reason = self._broken_reason if self._broken else "membership_changed" if ending else (
            "chain_bounds" if self.watcher is not None else "no_full_backup")
        log.info("delta: %s", why)
        try:
            with low_memory():
                res = take_backup(cfg, member=me.name, origin="daemon")  # the copy queue copies it
        except BusyError as exc:  # cron's backup (or a restore) holds the lock: its result will do
            log.info("delta: full backup deferred: %s", exc.message)
            self._retry_at = time.monotonic() + RETRY_AFTER / 2
            return
        except AgentError as exc:
            wait = min(BACKUP_RETRY[0] * 2 ** self._backup_failures, BACKUP_RETRY[1])
            self._backup_failures += 1
            # the daemon starts its own etcd as this thread starts: the first tries may find it starting
            level = logging.INFO if self._backup_failures <= 2 else logging.WARNING
            log.log(level, "delta: full backup failed: %s; trying again in %.0fs", exc.message, wait)
            self._retry_at = time.monotonic() + wait
            return
        finally:
            release_freed_memory()
        self._backup_failures = 0
        if self._broken or ending:
            self._last_chain_backup = time.monotonic()
        self._members.backed_up(for_change=bool(ending))
        self._full_backups[reason] = self._full_backups.get(reason, 0) + 1
        self._broken = self._broken_reason = ""
        self._finder.again()  # the new backup is the newest
        self._copies.nudge()
        log.info("delta: full backup %s (revision %s) taken; the next chain continues it", res.path, res.revision)
        w = self.watcher
        if w is not None:
            # the running chain ends here even when the new backup is at its base's revision (an
            # idle cluster): a chain continuing the old backup would keep ``--from latest`` on it
            self._stop_watcher(f"the next chain continues {os.path.basename(res.path)}")
            if ending:
                self._breaks_total = breaks.record_end(cfg, w, ending, self._breaks_total or 0)
            self._prune(cfg)

    def _start_watcher(self, cfg: Config, me: Member) -> None:
        full = self._newest
        assert full is not None
        d = cfg.backup.delta
        from etcd_agent.backup import keys
        from etcd_agent.backup.service import recipients_of

        recipients = tuple(recipients_of(cfg))
        # every segment (an encrypted one's seal, a plain one's footer) is signed with the manifest
        # key this host has: the full backup that starts each chain fetched or created it
        sign_key = keys.local_key(cfg).key
        if sign_key is None:
            log.warning("delta: no manifest key at %s: segments are written unsigned (a point-in-time restore then "
                        "needs --accept-unsigned-chain); the next full backup fetches it from etcd", keys.key_path(cfg))
        opts = WatchOptions(close_seconds=d.close_seconds, close_bytes=d.close_bytes, idle_seconds=d.idle_seconds,
                            batch_seconds=d.batch_seconds,
                            max_outage=d.max_outage, recipients=recipients, sign_key=sign_key)
        existing = chains.scan(cfg.backup.dir).for_full(full.revision, full.base)
        with self._mu:
            self._totals = (existing.events, existing.bytes, existing.usable) if existing else (0, 0, 0)
            self._cp_bytes = checkpoints.bytes_since(cfg, existing) if existing else 0
        self._cp_at = time.monotonic()  # a watch that just started waits checkpoint_min_seconds too
        self._copies.nudge()  # a new (or resumed) chain: its full backup first
        w = DeltaWatcher(me.client_url, full.revision, cfg.backup.dir, tls=cfg.tls if cfg.tls.client_enabled else None,
                         options=opts, on_segment=self._on_segment, base=full.base)
        self.watcher, self._full = w, full
        self._chain_started = time.monotonic()
        self._state, self._detail = "starting", f"continuing {full.name}"
        w.start()

    def _prune(self, cfg: Config) -> None:
        """Retention once the old chain is no longer written: the backup that just started the new
        chain pruned while the old one was still live, and kept it for that."""
        from etcd_agent.backup.service import prune_locked

        try:
            prune_locked(cfg, dry_run=False)
        except AgentError as exc:  # busy (cron) or a bad file: the next backup's prune does it
            log.debug("delta: prune after the new chain started: %s", exc.message)

    def _stop_watcher(self, why: str) -> None:
        w, self.watcher = self.watcher, None
        if w is None:
            return
        log.info("delta: stopping the watch (%s)", why)
        try:
            w.stop(timeout=60.0)
        except ChainBroken as exc:
            # not settled here: the next watch resumes this chain and meets the same break, which
            # is then recorded, counted and followed by a full backup like any other (_on_break).
            # Most often this is the restore the watch is being stopped for, seen by its last
            # batch: handled now, before that restore has recorded itself, it went uncounted
            # (and as a boundary it would have been taken for a restore by hand)
            log.info("delta: the watch met a chain break as it stopped (%s); the next watch meets it again",
                     exc.message)
        except AgentError as exc:
            log.warning("delta: the watch ended with: %s", exc.message)

    def _on_segment(self, info: SegmentInfo) -> None:
        """(The watcher's thread, under its lock: quick) a segment was closed."""
        with self._mu:
            e, b, n = self._totals
            self._totals = (e + info.footer.events, b + info.size, n + 1)
            if info.footer.events:  # what a replay folds; idle segments add nothing to fold
                self._cp_bytes += info.size
        self._copies.nudge()

    # ------------------------------------------------------------ status

    def status(self) -> status.DeltaStatus:
        cfg, _me = self._source()
        w, full = self.watcher, self._full
        ws: Optional[WatcherStatus] = w.status() if w is not None else None
        with self._mu:
            totals = self._totals
        st = reporting.base_status(
            cfg, state=ws.state if ws else self._state, detail=self._detail,
            base=full if (w is not None and full is not None) else self._newest,
            breaks_seen=self._breaks_total or 0, full_backups=dict(self._full_backups),
            breaks_in_row=self._breaks_in_row, backoff=self._backoff_left())
        if ws is not None:
            st = reporting.with_watch(st, ws, totals)
        elif cfg.backup.delta.enabled:
            st = reporting.with_chain_on_disk(st, cfg, self._newest)
        return reporting.with_copies(st, self.copies())

    def _write_textfile(self, cfg: Optional[Config] = None, *, force: bool = False) -> None:
        if cfg is None:
            cfg = self._source()[0]
        path = status.textfile_path(cfg)
        now = time.monotonic()
        if path is None or (not force and now - self._textfile_at < TEXTFILE_EVERY):
            return
        w = self.watcher
        if reporting.another_writes(cfg, w is not None and w.running):
            return
        self._textfile_at = now
        status.write_textfile(path, self.status(), self.copies())

