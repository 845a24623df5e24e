"""When a process started, as the kernel counts it: clock ticks since boot, the one identity of a
pid that no clock can move.

psutil's ``create_time()`` is that count plus ``btime`` of ``/proc/stat``, which the kernel
derives from the wall clock, truncated to whole seconds: an NTP step, a VM paused and resumed, or
any clock that jumped moves it by seconds, and the wall clock drifting across a second's edge
flips it by one. A live process compared by ``create_time`` then looks like another one (seen in
CI: an upgrade's freshly started etcd taken for gone 70 ms after its start, and rolled back).
"""
from __future__ import annotations

from typing import Optional

STAT_LIMIT = 4096  # /proc/<pid>/stat is one short line; its comm is at most 64 bytes


def start_ticks(pid: int) -> Optional[int]:
    """Field 22 (starttime) of ``/proc/<pid>/stat``; None when the process is gone or unreadable."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            data = fh.read(STAT_LIMIT)
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    fields = data.rsplit(b")", 1)[-1].split()
    try:
        return int(fields[19])  # state is field 3, here at index 0
    except (IndexError, ValueError):
        return None
