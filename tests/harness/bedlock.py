"""One heavy test bed on this machine at a time.

The multihost and systemd tiers use fixed namespace prefixes, subnets and container names: two
sessions running them at once (two developers, two worktrees) tear down each other's hosts. Both
tiers hold an exclusive flock on ``LOCK_PATH`` for their whole session (see their conftest.py).
The wait is bounded: a session that cannot get the bed within the deadline fails and names the
holder, rather than hanging a CI job.

Within one process the lock is re-entrant (both tiers in one session take it once): flock locks
belong to the open file, and a second open of the same path would wait on ourselves.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import sys
import threading
import time
from typing import IO, Any, Callable, Iterator, Optional

log = logging.getLogger(__name__)

LOCK_PATH = "/run/etcd-agent-testbed.lock"
# The whole suite takes ~12 min; a bed held longer than this is a stuck session, not a queue.
DEFAULT_TIMEOUT = float(os.environ.get("ETCD_AGENT_TESTBED_LOCK_TIMEOUT", "3600"))
POLL = 1.0
REPORT_EVERY = 60.0

_mutex = threading.Lock()
_held: Optional[IO[str]] = None
_depth = 0


class BedBusy(RuntimeError):
    """Another session held the bed past the deadline."""


def holder(path: str = LOCK_PATH) -> str:
    """Who holds the lock, as the holder wrote it ("pid N: argv"); "unknown" when nothing (or a
    note of a process that is gone) is there - `flock(1)` users write no note."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            note = f.read().strip()
    except OSError:
        return "unknown"
    parts = note.split()
    if len(parts) >= 2 and parts[0] == "pid" and parts[1].rstrip(":").isdigit():
        try:
            os.kill(int(parts[1].rstrip(":")), 0)
        except ProcessLookupError:
            return "unknown (a stale note of a process that is gone)"
        except PermissionError:
            pass
    return note or "unknown"


def acquire(path: str = LOCK_PATH, timeout: float = DEFAULT_TIMEOUT,
            say: Callable[[str], None] = lambda s: None, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> None:
    """Take the exclusive lock (re-entrant in this process), waiting at most ``timeout`` s.

    ``say`` gets one line when the wait starts and one a minute while it lasts."""
    global _held, _depth
    with _mutex:
        if _held is not None:
            _depth += 1
            return
        f = open(path, "a+", encoding="utf-8")
        try:
            deadline = clock() + timeout
            next_report = 0.0
            waited = False
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                now = clock()
                if now >= deadline:
                    raise BedBusy(f"test bed lock {path} still held after {timeout:.0f} s by {holder(path)}")
                if now >= next_report:
                    say(f"waiting for the test bed lock {path} (held by {holder(path)}; "
                        f"gives up in {deadline - now:.0f} s)")
                    next_report = now + REPORT_EVERY
                    waited = True
                sleep(POLL)
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n")
            f.flush()
            if waited:
                say(f"test bed lock {path} taken")
        except BaseException:
            f.close()
            raise
        _held, _depth = f, 1


def release() -> None:
    """Drop one level of the lock; the last one truncates the note and unlocks."""
    global _held, _depth
    with _mutex:
        if _held is None:
            return
        _depth -= 1
        if _depth > 0:
            return
        f, _held = _held, None
        try:
            f.seek(0)
            f.truncate()
        finally:
            f.close()  # closing the file releases the flock


# A tier run on pytest-xdist workers (Makefile: multihost): the controller holds the lock for the
# whole run and says so in each worker's workerinput. Each worker is a session of its own: taking
# the lock there, the second worker would wait for the first one's whole session.
HELD_BY_CONTROLLER = "etcd_agent_testbed_lock_held"


def is_xdist_controller(config: Any) -> bool:
    """True in the process that deals tests to xdist workers (``-n N``, N > 0), not in a worker."""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def hold_for_workers(config: Any) -> None:
    """From a tier's ``pytest_configure`` on the xdist controller: take the lock now, before any
    worker starts, and release it when the run ends. `tell_worker` passes the word on."""
    holding = hold_for_session(config)
    next(holding)
    config.add_cleanup(lambda: next(holding, None))


def tell_worker(node: Any) -> None:
    """From ``pytest_configure_node``: the worker's sessions need not take the lock this process
    holds (told only when it does)."""
    if _held is not None:
        node.workerinput[HELD_BY_CONTROLLER] = True


def hold_for_session(config: Any, path: str = LOCK_PATH) -> Iterator[None]:
    """Body of the tiers' session fixtures: hold the lock from first use to the session's end;
    the waiting lines go to the terminal even under output capture. In an xdist worker whose
    controller holds the lock for the run, nothing to take."""
    if getattr(config, "workerinput", {}).get(HELD_BY_CONTROLLER):
        yield
        return
    capman = config.pluginmanager.getplugin("capturemanager")

    def say(line: str) -> None:
        log.warning("%s", line)
        if capman is not None:
            with capman.global_and_fixture_disabled():
                sys.stderr.write(f"\n[etcd-agent testbed] {line}\n")
                sys.stderr.flush()

    acquire(path, say=say)
    try:
        yield
    finally:
        release()
