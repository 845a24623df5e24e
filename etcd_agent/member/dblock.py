"""Whether an etcd member still has its data open: the flock bbolt holds on ``member/snap/db``.

On SIGTERM etcd 3.5 stops its raft transport (the peer streams), then closes its WAL, then its
db - bbolt drops its flock - and only then closes its peer server, which waits up to a second for
the connections still open to it. A member whose db lock is gone has nothing of its data open,
and its leader already sees it as gone. The lock is read from ``/proc/locks``: read-only, never
taken here, not even for a moment, so a starting etcd can never find it held by the agent.
"""
from __future__ import annotations

import os
from typing import Optional

LOCKS = "/proc/locks"
MAX_LOCKS = 8 << 20  # bytes of /proc/locks read at most (~100,000 locks): more, and it cannot be told


def db_path(data_dir: str) -> str:
    return os.path.join(data_dir, "member", "snap", "db")


def db_locked(data_dir: str, locks: str = LOCKS) -> Optional[bool]:
    """True while a process holds a flock on the member's db, False when none does, None when
    this cannot be told (no db, ``locks`` unreadable or larger than MAX_LOCKS)."""
    try:
        st = os.stat(db_path(data_dir))
        with open(locks, "rb") as fh:
            text = fh.read(MAX_LOCKS + 1)
    except OSError:
        return None
    if len(text) > MAX_LOCKS:
        return None
    return held_in(text, os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)


def held_in(text: bytes, major: int, minor: int, inode: int) -> bool:
    """Whether ``text`` (``/proc/locks``) lists a granted flock on that file. A line reads
    ``1: FLOCK  ADVISORY  WRITE 4711 fd:00:1234 0 EOF`` (device in hex, inode in decimal); a
    process waiting for a lock is listed as ``1: -> FLOCK ...`` and holds nothing."""
    want = f"{major:02x}:{minor:02x}:{inode}".encode()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == b"FLOCK" and parts[5] == want:
            return True
    return False
