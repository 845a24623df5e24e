"""This master's own members copy and restore their snapshot at a lower CPU priority.

They have time to spare (the others' ship and restore take longer), and the ship they run beside is
what the other masters wait for. On the namespace bench: 12.3-12.5 s for a 1.29 GB restore instead
of 13.9-14.6 s.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

log = logging.getLogger(__name__)

YIELD_NICE = 10

T = TypeVar("T")


def yielding(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own, ``YIELD_NICE`` lower in CPU priority. On Linux the nice
    value is the thread's, and the processes it starts (etcdutl) inherit it; it ends with the
    thread, so nothing else of the session runs at it."""
    def lowered() -> T:
        try:
            os.nice(YIELD_NICE)
        except OSError as exc:  # a sandbox that forbids it: the same work, at the usual priority
            log.debug("cannot lower this thread's priority: %s", exc)
        return fn()

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="yielding") as ex:
        return ex.submit(lowered).result()
