"""The heavy tiers' bed lock: re-entrant in one process, bounded wait, names the holder."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import bedlock

HOLD = """
import fcntl, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.seek(0); f.truncate(); f.write("pid 1234: other session\\n"); f.flush()
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

        with pytest.raises(bedlock.BedBusy, match="held after 5 s by pid 1234: other session"):
            bedlock.acquire(path, timeout=5, say=said.append, clock=lambda: now[0], sleep=sleep)
        assert len(said) == 1 and "waiting for the test bed lock" in said[0] and "pid 1234" in said[0]
    finally:
        other.communicate("", timeout=30)
    bedlock.acquire(path, timeout=1)  # the holder is gone: taken at once
    bedlock.release()
