"""A child that dies with the run that started it: Linux's parent-death signal (``prctl
PR_SET_PDEATHSIG``), set in the child between fork and exec (Popen's ``preexec_fn``).

The kernel sends it when the *thread* that forked the child ends, not the process: a child
started from a worker thread would be killed when that thread finishes, which is not the end
of its run. So it is offered only to children started from the main thread (whose end is the
process's); a child started elsewhere relies on its owner's cleanup and the next run's sweep.
A throwaway etcd of a point-in-time replay killed with -9 would otherwise keep its ports, its
CPU share and its plaintext scratch data until someone noticed.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that has the child receive ``sig`` when this process ends; None where it
    cannot be had safely (not Linux, not the main thread)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    # resolved here, before the fork: the child only calls it
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between the fork and the prctl
            os.kill(os.getpid(), int(sig))

    return preexec
