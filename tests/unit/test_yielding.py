"""restore.host.priority.yielding: this master's own copy and restore run below the ship in CPU priority,
on a thread of their own; the processes they start inherit it; nothing else does. Real threads,
real processes."""
from __future__ import annotations

import os
import subprocess
import threading
from typing import Tuple

import pytest

from etcd_agent.restore.host.priority import YIELD_NICE, yielding


def here() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)  # Linux: the calling thread's nice value


def child_nice() -> int:
    out = subprocess.run(["sh", "-c", "cut -d' ' -f19 /proc/$$/stat"], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_the_work_and_what_it_starts_run_lower_and_the_caller_stays_as_it_was() -> None:
    before = here()
    inside: Tuple[int, int, int] = yielding(lambda: (here(), child_nice(), threading.get_ident()))
    want = min(19, before + YIELD_NICE)
    assert inside[0] == want and inside[1] == want, inside
    assert inside[2] != threading.get_ident(), "not on the caller's thread"
    assert here() == before and child_nice() == before, "the caller's priority changed"
    assert yielding(here) == want, "a second call starts from the caller's priority again, not from the last one"


def test_what_the_work_raises_reaches_the_caller() -> None:
    def fail() -> None:
        raise OSError(28, "No space left on device")

    before = here()
    with pytest.raises(OSError, match="No space left"):
        yielding(fail)
    assert here() == before
