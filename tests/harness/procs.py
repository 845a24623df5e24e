"""Real processes a test starts and kills: an agent command in a session of its own, never left
running whatever the test asserts."""
from __future__ import annotations

import contextlib
import subprocess
from typing import Iterator, Sequence


@contextlib.contextmanager
def agent_run(argv: Sequence[str]) -> "Iterator[subprocess.Popen[bytes]]":
    """``argv`` started in its own session (an operator's Ctrl-C would not reach it), output
    dropped; killed on the way out if the test did not end it."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
