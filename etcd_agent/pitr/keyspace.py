"""The key space a chain leaves behind at a revision, computed offline with bounded memory.

A replay does not need every intermediate state: the restored cluster gets a new revision
history anyway (its revision is bumped), so what it must hold is, for every key the chain
touched up to the target, the chain's last word on it - a put (value, lease, the key's create
revision) or a delete. ``KeySpace.apply(txn)`` folds one revision in; ``changes()`` yields the
result, ordered by the keys' original create revision so a batched load hands out new create
revisions in the same relative order; ``leases`` names every lease a put attached to a key.

Memory stays flat whatever the chain's size: last writes are held in a dict up to
``memory_bytes`` (values counted), and past that moved into a SQLite file in the caller's
private staging dir (the replay's 0700 work dir), where later writes replace earlier ones. The
file is the replay's own scratch, removed with that dir; it is never read by anything else.
"""
from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Sequence, Set, Tuple

from etcd_agent.chain.errors import ReplayError
from etcd_agent.chain.reader import RawEvent
from etcd_agent.chain.segments import PUT, Txn

# per entry beyond its key and value: the dict slot, the tuple, the ints (measured ~200 B)
_ENTRY_OVERHEAD = 200
_LEASE_OVERHEAD = 100
DEFAULT_MEMORY = 64 * 1024 * 1024


@dataclass(frozen=True)
class Change:
    """The chain's last word on one key: a put (``value`` not None) or a delete."""

    key: bytes
    value: Optional[bytes]
    lease: int
    create_revision: int  # in the original cluster; 0 for a delete
    mod_revision: int  # the revision of that last write in the original cluster
    # the chain may have deleted this key up to here (True unless known not: once the key space
    # has spilled to its file it is not tracked). A key the chain created (create revision after
    # the snapshot's) and never deleted cannot be in the snapshot: the load need not delete it.
    deleted_before: bool = True


# key -> (value or None for a delete, lease, create revision, mod revision)
_Entry = Tuple[Optional[bytes], int, int, int]


class KeySpace:
    """Last write per key, spilled to ``<staging_dir>/keyspace.sqlite`` past ``memory_bytes``."""

    def __init__(self, staging_dir: str, *, memory_bytes: int = DEFAULT_MEMORY) -> None:
        self.staging_dir = staging_dir
        self.memory_bytes = memory_bytes
        self.events = 0
        self.revisions = 0
        self.last_revision = 0
        self.spills = 0
        self._mem: Dict[bytes, _Entry] = {}
        self._mem_leases: Set[int] = set()
        self._used = 0
        self._db: Optional[sqlite3.Connection] = None
        # keys a delete of the chain touched, while nothing has spilled (None after: unknown)
        self._deleted: Optional[Set[bytes]] = set()

    # ------------------------------------------------------------ folding in

    def apply(self, txn: Txn) -> None:
        """One revision's events; revisions must come in increasing order."""
        self.apply_raw(txn.revision, [(e.kind, e.key, e.value, e.create_revision, e.version, e.lease)
                                      for e in txn.events])

    def apply_raw(self, revision: int, events: Sequence[RawEvent]) -> None:
        """``apply`` of one revision handed over as the segment scan's tuples (kind, key, value,
        create revision, version, lease): the replay's fold, with no object per event."""
        if revision <= self.last_revision:
            raise ReplayError(f"revision {revision} folded in after {self.last_revision}")
        mem = self._mem
        leases = self._mem_leases
        deleted = self._deleted
        used = self._used
        for kind, key, value, create, _version, lease in events:
            old = mem.get(key)
            if old is not None:
                used -= len(key) + len(old[0] or b"") + _ENTRY_OVERHEAD
            if kind == PUT:
                mem[key] = (value, lease, create, revision)
                used += len(key) + len(value) + _ENTRY_OVERHEAD
                if lease and lease not in leases:
                    leases.add(lease)
                    used += _LEASE_OVERHEAD
            else:
                mem[key] = (None, 0, 0, revision)
                used += len(key) + _ENTRY_OVERHEAD
                if deleted is not None and key not in deleted:
                    deleted.add(key)
                    used += len(key) + _LEASE_OVERHEAD
        self._used = used
        self.events += len(events)
        self.revisions += 1
        self.last_revision = revision
        if used > self.memory_bytes:
            self._spill()

    def _open(self) -> sqlite3.Connection:
        if self._db is None:
            path = os.path.join(self.staging_dir, "keyspace.sqlite")
            if os.path.lexists(path):
                raise ReplayError(f"{path} exists: the replay's private dir is not fresh")
            # created 0600 before SQLite opens it: the values are the cluster's data
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            # the replay folds in a thread of its own and loads from the main one once the fold has
            # ended (handed over through its future): one user at a time, never two at once
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            # a throwaway file rebuilt by running the replay again: no journal, no fsync; and
            # temporary b-trees in memory, never in a shared temp dir outside the private one
            db.execute("PRAGMA journal_mode=OFF")
            db.execute("PRAGMA synchronous=OFF")
            db.execute("PRAGMA temp_store=MEMORY")
            db.execute("CREATE TABLE kv (key BLOB PRIMARY KEY, value BLOB, lease INTEGER, create_rev INTEGER, "
                       "mod_rev INTEGER) WITHOUT ROWID")
            # changes() reads in create order: the index is that order, so no sort at the end
            db.execute("CREATE INDEX kv_create ON kv (create_rev, key)")
            db.execute("CREATE TABLE leases (id INTEGER PRIMARY KEY)")
            self._db = db
        return self._db

    def _spill(self) -> None:
        """Move what is held in memory into the file (a later write replaces an earlier one)."""
        db = self._open()
        db.execute("BEGIN")
        db.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?, ?, ?, ?)",
                       ((k, v, lease, c, m) for k, (v, lease, c, m) in self._mem.items()))
        db.executemany("INSERT OR IGNORE INTO leases VALUES (?)", ((lid,) for lid in self._mem_leases))
        db.execute("COMMIT")
        self._mem.clear()
        self._mem_leases.clear()
        self._deleted = None  # from here on every key the chain created is deleted first, as before
        self._used = 0
        self.spills += 1

    # ------------------------------------------------------------ reading out

    @property
    def spilled(self) -> bool:
        return self._db is not None

    @property
    def leases(self) -> Iterator[int]:
        """Every lease some put up to here attached a key to (kept or overwritten since)."""
        if self._db is not None:
            self._spill()
            for (lid,) in self._db.execute("SELECT id FROM leases ORDER BY id"):
                yield int(lid)
        else:
            yield from sorted(self._mem_leases)

    def changes(self) -> Iterator[Change]:
        """Every touched key's last write: deletes first, then puts in original create order."""
        if self._db is None:
            items = sorted(self._mem.items(), key=lambda kv: (kv[1][2], kv[0]))
            deleted = self._deleted if self._deleted is not None else set(self._mem)
            for k, (v, lease, c, m) in items:
                yield Change(k, v, lease, c, m, k in deleted)
            return
        self._spill()
        for k, v, lease, c, m in self._db.execute("SELECT key, value, lease, create_rev, mod_rev FROM kv "
                                                  "ORDER BY create_rev, key"):
            yield Change(bytes(k), None if v is None else bytes(v), int(lease), int(c), int(m))

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
            path = os.path.join(self.staging_dir, "keyspace.sqlite")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._mem.clear()
        self._mem_leases.clear()

    def __enter__(self) -> "KeySpace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
