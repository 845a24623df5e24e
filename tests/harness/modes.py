"""File modes in tests: run under a chosen umask, and read back the modes of a whole tree."""
from __future__ import annotations

import contextlib
import os
import stat
from typing import Dict, Iterator


@contextlib.contextmanager
def umask(value: int) -> Iterator[None]:
    """The process umask set to ``value`` for the block (what a caller's shell might have)."""
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: str) -> Dict[str, int]:
    """Relative path -> permission bits of everything below ``root`` (symlinks not followed)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out
