"""The heavy tiers' bed lock: re-entrant in one process, bounded wait, names the holder."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.harness import bedlock

HOLD = """
import fcntl, os, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.seek(0); f.truncate(); f.write(f"pid {os.getpid()}: other session\\n"); f.flush()
print("held", flush=True)
sys.stdin.read()
"""


def test_reentrant_in_one_process_and_released_at_the_last(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "bed.lock")
    bedlock.acquire(path, timeout=1)
    bedlock.acquire(path, timeout=1)  # the second tier of the same session: no self-deadlock
    assert "pid" in bedlock.holder(path)
    bedlock.release()
    probe = subprocess.run([sys.executable, "-c", "import fcntl,sys; f=open(sys.argv[1]); "
                            "fcntl.flock(f, fcntl.LOCK_EX|fcntl.LOCK_NB)", path], capture_output=True, timeout=30)
    assert probe.returncode != 0, "released after the first of two acquisitions"
    bedlock.release()
    probe = subprocess.run([sys.executable, "-c", "import fcntl,sys; f=open(sys.argv[1]); "
                            "fcntl.flock(f, fcntl.LOCK_EX|fcntl.LOCK_NB)", path], capture_output=True, timeout=30)
    assert probe.returncode == 0, probe.stderr


def test_waits_with_a_deadline_and_names_the_holder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "bed.lock")
    other = subprocess.Popen([sys.executable, "-c", HOLD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        now = [0.0]
        said = []

        def sleep(s: float) -> None:
            now[0] += s

        with pytest.raises(bedlock.BedBusy, match=f"held after 5 s by pid {other.pid}: other session"):
            bedlock.acquire(path, timeout=5, say=said.append, clock=lambda: now[0], sleep=sleep)
        assert len(said) == 1 and "waiting for the test bed lock" in said[0] and f"pid {other.pid}" in said[0]
    finally:
        other.communicate("", timeout=30)
    assert bedlock.holder(path).startswith("unknown"), "a note of a process that is gone names nobody"
    bedlock.acquire(path, timeout=1)  # the holder is gone: taken at once
    bedlock.release()


class _TookTheLock:
    """A pytest plugin manager that fails closed: hold_for_session asks it first when it takes
    the lock (for its waiting lines)."""

    def getplugin(self, name: str) -> None:
        raise AssertionError("the worker took the lock its controller holds")


def test_a_worker_whose_controller_holds_the_lock_takes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "bed.lock")
    node = SimpleNamespace(workerinput={})
    bedlock.tell_worker(node)
    assert node.workerinput == {}, "told the worker while this process held nothing"
    bedlock.acquire(path, timeout=1)  # the controller, for the whole run
    try:
        bedlock.tell_worker(node)
        worker = SimpleNamespace(workerinput=node.workerinput, pluginmanager=_TookTheLock())
        session = bedlock.hold_for_session(worker, path)
        next(session)  # a worker's session: on at once, as the second worker's is
        assert next(session, "ended") == "ended"
        assert "pid" in bedlock.holder(path), "the worker's session end dropped the controller's lock"
    finally:
        bedlock.release()
