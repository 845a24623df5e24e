"""The daemon's restore drills: when (a pure rule), where (one master at a time), and the record.

``decide(last, every, now)`` is the schedule: a pure function of the cluster's last drill and
``[drill] every``. The last drill is the cluster's, not this host's: whichever master ran it
writes its ``DrillRecord`` to ``/etcd-agent/drill/last`` (so does ``etcd-agent drill``). A
master that finds a drill due takes the cluster-wide etcd lock ``/etcd-agent/locks/drill``
(like ``maintain()``; its lease outlasts the drill's timeout), reads the record again under it -
another master may have drilled meanwhile - and only then drills its newest good backup. So
two daemons make one drill per period, and a busy lock means another master is at it.

The drill runs on a thread of its own: a drill takes as long as a restore of the backup, and
the daemon must go on healing its member meanwhile. Stopping the daemon cancels it between
steps; the throwaway etcd is stopped and its dir removed either way (or swept by the next
drill when the daemon was killed).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from etcd_agent.backup.checks import SYSTEM_WALL_CLOCK, WallClock
from etcd_agent.drill.record import DrillRecord, parse_record
from etcd_agent.errors import AgentError, BusyError

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config
    from etcd_agent.drill.report import DrillReport
    from etcd_agent.etcd.client import EtcdClient

log = logging.getLogger(__name__)

DRILL_LOCK = "/etcd-agent/locks/drill"
RECORD_KEY = "/etcd-agent/drill/last"
CLOCK_MARGIN = 300.0  # a record dated further in the future comes from a master whose clock is off
RETRY = 60.0  # after etcd could not be asked, or the lock was busy
MAX_RECORD = 64 * 1024


@dataclass(frozen=True)
class Schedule:
    due: bool
    reason: str
    next_at: Optional[float] = None  # unix time the next drill is due, when it is not due now


def _span(seconds: float) -> str:
    s = abs(seconds)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}min"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def decide(last: Optional[DrillRecord], every: float, now: float) -> Schedule:
    """Is a drill due at ``now`` (unix time), given the cluster's ``last`` drill? Pure."""
    if every <= 0:
        return Schedule(False, "scheduled drills are off ([drill] every = 0)")
    if last is None:
        return Schedule(True, "no drill of this cluster is recorded")
    age = now - last.at
    if age < -CLOCK_MARGIN:
        return Schedule(True, f"the last drill is dated {_span(age)} in the future (the clock of {last.host or 'a master'} "
                              "is off): not trusted")
    what = f"the last drill ({last.backup} on {last.host or '?'}, {'passed' if last.ok else 'FAILED'})"
    if age >= every:
        return Schedule(True, f"{what} started {_span(age)} ago; one is due every {_span(every)}")
    return Schedule(False, f"{what} started {_span(max(age, 0.0))} ago; the next is due in {_span(every - age)}",
                    next_at=last.at + every)


def read_record(client: "EtcdClient") -> Optional[DrillRecord]:
    """The cluster's last drill (None: none recorded, or not a record)."""
    from etcd_agent import safejson

    raw = client.get(RECORD_KEY)
    if raw is None:
        return None
    try:
        return parse_record(safejson.loads(raw, max_bytes=MAX_RECORD), f"drill record {RECORD_KEY} in etcd")
    except ValueError:
        log.warning("the drill record %s in etcd is damaged; treated as none", RECORD_KEY)
        return None


def write_record(client: "EtcdClient", rec: DrillRecord) -> None:
    import json

    client.put(RECORD_KEY, json.dumps(rec.to_json(), sort_keys=True).encode())


def tell_cluster(cfg: "Config", report: "DrillReport") -> Optional[str]:
    """Record a drill run outside the daemon (``etcd-agent drill``) as the cluster's last one, so
    the schedule counts it; best effort (None, or why it could not)."""
    from etcd_agent.etcd.client import EtcdClient

    try:
        with EtcdClient.from_config(cfg, timeout=3.0) as c:
            write_record(c, report.record())
    except AgentError as exc:
        return exc.message
    return None


Runner = Callable[..., "DrillReport"]


class DrillScheduler:
    """Starts the drill thread when ``decide`` says so; ``tick`` is called from the daemon's cycle."""

    def __init__(self, clock: WallClock = SYSTEM_WALL_CLOCK, runner: Optional[Runner] = None) -> None:
        self.clock = clock
        self._runner = runner
        self._thread: Optional[threading.Thread] = None
        self._cancel = threading.Event()
        self._next_check = 0.0  # unix time: no need to ask etcd before then
        self.last_outcome: Optional[str] = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def tick(self, cfg: "Config", member: str) -> Optional[str]:
        """Start a drill if one is due (one sentence saying so), else None. Cheap when none is:
        etcd is asked again only once the last drill's period is over."""
        if cfg.drill.every <= 0 or self._cancel.is_set() or self.running:
            return None
        now = self.clock.now().timestamp()
        if now < self._next_check:
            return None
        from etcd_agent.etcd.client import EtcdClient

        try:
            with EtcdClient.from_config(cfg, timeout=2.0) as c:
                s = decide(read_record(c), cfg.drill.every, now)
        except AgentError as exc:
            log.debug("member %s: cannot read the drill record: %s", member, exc.message)
            self._next_check = now + RETRY
            return None
        if not s.due:
            self._next_check = s.next_at if s.next_at is not None else now + RETRY
            return None
        self._thread = threading.Thread(target=self._run, args=(cfg, member), name="restore-drill", daemon=True)
        self._thread.start()
        return f"restore drill due ({s.reason})"

    def _run(self, cfg: "Config", member: str) -> None:
        from etcd_agent.etcd.client import EtcdClient

        try:
            with EtcdClient.from_config(cfg, timeout=5.0) as c:
                # the lease outlasts the drill: a lock that expired mid-drill would let a second start
                with c.locked(DRILL_LOCK, ttl=int(cfg.drill.timeout) + 120, timeout=1):
                    s = decide(read_record(c), cfg.drill.every, self.clock.now().timestamp())
                    if not s.due:  # another master drilled while we waited for the lock
                        self.last_outcome = f"not drilling: {s.reason}"
                        log.info("member %s: %s", member, self.last_outcome)
                        return
                    report = self._drill(cfg)
                    if report.interrupted:
                        self.last_outcome = "drill interrupted"
                        return
                    write_record(c, report.record())
                    self.last_outcome = (f"drill of {report.backup} passed in {report.duration:.1f}s" if report.ok
                                         else f"drill FAILED: {report.problem}")
        except BusyError:
            self.last_outcome = "another master (or a drill by hand here) is drilling"
            log.info("member %s: restore drill skipped: %s", member, self.last_outcome)
            self._next_check = self.clock.now().timestamp() + RETRY
            return
        except AgentError as exc:
            self.last_outcome = f"drill not run: {exc.message}"
            log.warning("member %s: restore drill not run: %s", member, exc.message)
            self._next_check = self.clock.now().timestamp() + RETRY
            return
        except Exception:  # noqa: BLE001 - a crashed drill must not take the daemon's thread down silently
            log.exception("member %s: restore drill crashed", member)
            self._next_check = self.clock.now().timestamp() + RETRY
            return
        self._next_check = 0.0  # read the record anew: it names the drill just run

    def _drill(self, cfg: "Config") -> "DrillReport":
        if self._runner is not None:
            return self._runner(cfg, "latest", clock=self.clock, cancel=self._cancel.is_set)
        from etcd_agent.drill.run import run_drill

        return run_drill(cfg, "latest", clock=self.clock, cancel=self._cancel.is_set)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel a running drill and wait for it (its throwaway etcd is stopped on the way out)."""
        self._cancel.set()
        t = self._thread
        if t is not None and t.is_alive():
            t.join(timeout)
            if t.is_alive():
                log.warning("the restore drill did not stop within %.0fs; the next drill sweeps what it leaves", timeout)
