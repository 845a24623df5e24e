"""The hosts opened, locked and pre-checked while the source is read (issue 35 item 10).

A point-in-time restore's source is a replay (``pitr.replayrun``: a throwaway etcd restored,
started, loaded, defragmented, saved: seconds), and the hosts' sessions, locks and pre-checks
(read-only, nothing touched) take a good part of a second more. They run at the same time:

- the source's opener runs in the main thread (the replay's throwaway etcd must be started from
  it to die with a killed run: ``pdeath``), and calls ``Meanwhile.start`` once the source's own
  checks passed (``pitr.prepare``: a chain it refuses is refused in one sentence before any
  session opens or any lock is taken);
- ``HostsAhead`` then opens every host's session, takes the locks and gathers the pre-check's facts
  (and the running cluster's evidence) in a thread of its own;
- what needs the source (the room for its size, its identity, a resume of the same snapshot) is
  judged once both are done, in the main thread, as before. A refusal that holds whatever the
  source turns out to be (a busy host, an unreachable one, a host refused by
  ``precheck.standing_problems``) sets ``Meanwhile.stop``: the replay stops at its next step,
  its throwaway member stopped and its work dirs removed, and the hosts' refusal is the error.
  A dry run is never stopped: it reports every host whatever they say.

An opener that never calls ``start`` (a plain restore: its source is read at once) gets the hosts
opened after it, as before.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from etcd_agent.errors import RefusedError
from etcd_agent.restore.host.facts import NodeFacts
from etcd_agent.restore.orchestrator.precheck import standing_problems

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.restore.orchestrator.orchestrate import Restore

log = logging.getLogger(__name__)

Facts = Tuple[Dict[str, NodeFacts], Dict[str, List[str]]]  # member -> facts; member -> problems


@dataclass(frozen=True)
class Meanwhile:
    """What a source's opener is handed: ``start(name)`` once its own checks passed and the long
    part begins (``name``: the file it will offer, which a busy refusal of another run names);
    ``stop``: set when the hosts refuse already, the opener then ends as soon as it can."""

    start: Callable[[str], None]
    stop: threading.Event


class HostsAhead:
    """One restore's hosts, opened and pre-checked in a thread while the source is read."""

    def __init__(self, restore: "Restore") -> None:
        self.r = restore
        self.stop = threading.Event()  # the hosts refuse whatever the source: the opener stops
        self._quit = threading.Event()  # the source failed: no pre-check is asked for
        self._fut: "Optional[Future[Facts]]" = None
        self._overlapped = False
        self._done_at: Optional[float] = None
        self._early: List[str] = []  # the refusal's lines, found without the source

    @property
    def meanwhile(self) -> Meanwhile:
        return Meanwhile(self.start, self.stop)

    def start(self, name: str) -> None:
        """The opener's call: open the hosts in a thread while it goes on (once)."""
        self._begin(name, overlapped=True)

    def _begin(self, name: str, overlapped: bool) -> None:
        if self._fut is not None:
            return
        self._overlapped = overlapped
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="restore-hosts")
        self._fut = pool.submit(self._open, name)
        pool.shutdown(wait=False)

    def _open(self, name: str) -> Facts:
        r = self.r
        try:
            r.open_hosts(name)
            if self._quit.is_set():
                return {}, {}
            t = time.monotonic()
            # what the running cluster says of itself (read-only), asked while the hosts pre-check
            ev = ThreadPoolExecutor(max_workers=1, thread_name_prefix="restore-evidence")
            r.evidence = ev.submit(r.cluster.evidence)
            ev.shutdown(wait=False)
            facts, problems = r.precheck()
            r.timings["precheck"] = time.monotonic() - t
        except BaseException:
            self.stop.set()
            raise
        finally:
            self._done_at = time.monotonic()
        if not r.opts.dry_run:
            self._early = self._refusal(facts, problems)
            if self._early:
                self.stop.set()
        return facts, problems

    def _refusal(self, facts: Dict[str, NodeFacts], problems: Dict[str, List[str]]) -> List[str]:
        """The pre-check's lines that refuse this restore whatever its source."""
        from etcd_agent import __version__

        out: List[str] = []
        for n in self.r.nodes:
            for m in n.members:
                found = list(problems.get(m.name, []))
                if m.name in facts:
                    found += standing_problems(self.r.cfg, m, facts[m.name], __version__)
                out += [f"{m.name} ({n.where}): {p}" for p in found]
        return out

    def result(self, name: str) -> Facts:
        """The hosts' facts (opened now when the opener did not start them); their error raised."""
        self._begin(name, overlapped=False)
        assert self._fut is not None
        read_at = time.monotonic()
        try:
            return self._fut.result()
        finally:
            if self._overlapped and self._done_at is not None:
                waited = max(0.0, self._done_at - read_at)
                self.r.timings["overlap: read waited for the hosts"] = waited
                self.r.timings["overlap: hosts waited for the read"] = max(0.0, read_at - self._done_at)

    def instead_of(self, exc: BaseException) -> None:
        """The source failed with ``exc``: wait for the hosts; when they refused first (the
        opener stopped for them), raise their refusal instead."""
        self._quit.set()
        if self._fut is None:
            return
        try:
            self._fut.result()
        except BaseException as hosts:
            if self.stop.is_set() and not isinstance(exc, KeyboardInterrupt):
                log.info("the source stopped (%s) for the hosts' refusal", exc)
                raise hosts from None
            return
        if self._early and not isinstance(exc, KeyboardInterrupt):
            for line in self._early:
                self.r.say(f"pre-check FAILED: {line}")
            raise RefusedError("restore refused by pre-checks; nothing touched (the replay was stopped)",
                               details=self._early) from None

    def close(self) -> None:
        """Every session closed (their locks released), once the thread has ended."""
        if self._fut is not None:
            self._quit.set()
            with contextlib.suppress(BaseException):  # said by whoever waited for it first
                self._fut.result()
        self.r.close_hosts()
