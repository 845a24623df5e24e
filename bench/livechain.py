"""A delta chain written the way the product writes one: a real watch (the daemon's
``DeltaSupervisor``, in this process) on a loopback cluster that a writer fills with events, and
the checkpoints the supervisor takes on its own as the chain grows.

Used by ``pitr_bench.py --chain live``: the synthetic chain of ``delta_bench.synthetic_chain`` is
written straight into segment files, so no checkpoint can exist for it (a checkpoint is a real
full backup of the cluster at a revision inside the chain, vouched for by the chain).

The cluster is compacted as the apiserver compacts it (every 5 minutes, to the revision of 5
minutes before), in the bench's compressed time: every ``compact_seconds`` to the revision of
``compact_seconds`` before. Without it every full backup and checkpoint would carry the whole
history the bench wrote (a checkpoint 500,000 events into a chain, 500 MB of old revisions).

The writer: ``threads`` threads, each with its own connection and its own share of the keys (key
index = thread mod threads), so each knows which of its keys exist and counts its events exactly:
mostly single puts, every 10th operation a 3-key transaction, every 25th a delete of one of its
keys that exists - the mix of the synthetic chain.
"""
from __future__ import annotations

import os
import random
import threading
import time
from typing import Any, Collection, Dict, List, Optional, Set, Tuple

from etcd_agent.chain import chains
from etcd_agent.config import Config
from etcd_agent.continuous.supervisor import DeltaSupervisor
from etcd_agent.etcd import proto
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.waiting import poll


def delta_config(checkpoint_min_seconds: float, checkpoints: bool = True) -> str:
    """[backup.delta] as the product ships it, but for the bench's compressed time: a chain is not
    cut at 600,000 events (the bench wants it that long), and checkpoints come at most every
    ``checkpoint_min_seconds`` - the product's 60 s at 500 writes/s is the tail the bench should
    leave at its own write rate (60 s x 500 / rate)."""
    return ("[backup.delta]\nmax_chain_events = 5000000\nmax_chain_segments = 5000\n"
            "max_chain_bytes = 8589934592\n"
            f"checkpoint_min_seconds = {checkpoint_min_seconds}\n"
            + ("" if checkpoints else "checkpoint_ratio = 0.0\n"))


class Writer:
    """``threads`` writers until ``events`` events are acknowledged (exactly; see the module doc)."""

    def __init__(self, endpoints: List[str], events: int, size: int, key_format: bytes, key_count: int,
                 existing: Optional[Collection[bytes]] = None, threads: int = 8, seed: int = 5) -> None:
        self.endpoints, self.target, self.size = endpoints, events, size
        self.key_format, self.key_count, self.threads = key_format, key_count, threads
        self.existing = set(existing or ())
        self.seed = seed
        self.events = 0
        self.last_revision = 0
        self._mu = threading.Lock()

    def run(self) -> Tuple[int, float]:
        """(events, seconds)."""
        t0 = time.monotonic()
        ts = [threading.Thread(target=self._thread, args=(i,), daemon=True) for i in range(self.threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return self.events, time.monotonic() - t0

    def _take(self, n: int, rev: int) -> bool:
        """Count ``n`` events written at ``rev``; False once the target is reached."""
        with self._mu:
            self.events += n
            self.last_revision = max(self.last_revision, rev)
            return self.events < self.target

    def _thread(self, i: int) -> None:
        rng = random.Random(self.seed * 100 + i)
        r = EtcdRpc(self.endpoints[i % len(self.endpoints)], timeout=30.0)
        mine = list(range(i, self.key_count, self.threads))
        live = {k for k in mine if self.key_format % k in self.existing}
        value = os.urandom(self.size)
        n = 0
        try:
            while True:
                with self._mu:
                    if self.events >= self.target:
                        return
                n += 1
                if n % 25 == 0 and live:
                    k = rng.choice(sorted(live)) if len(live) < 64 else next(iter(live))
                    live.discard(k)
                    rev = r.txn([proto.op_delete(self.key_format % k)]).revision
                    more = self._take(1, rev)
                else:
                    keys = sorted({rng.choice(mine) for _ in range(3 if n % 10 == 0 else 1)})
                    rev = r.txn([proto.op_put(self.key_format % k, value) for k in keys]).revision
                    live.update(keys)
                    more = self._take(len(keys), rev)
                if not more:
                    return
        finally:
            r.close()


def chain_end(cfg: Config) -> int:
    """The newest revision in a closed segment of any chain in the backup dir."""
    return max((c.end_revision for c in chains.scan(cfg.backup.dir).chains if c.usable), default=0)


def watching(sup: DeltaSupervisor) -> Optional[int]:
    """The base revision of the supervisor's running watch, or None."""
    w = sup.watcher
    return w.base_revision if w is not None and w.running and w.state == "watching" else None


class Compactor:
    """Compacts the cluster every ``every`` seconds to the revision it had ``every`` seconds before."""

    def __init__(self, endpoint: str, every: float) -> None:
        self.endpoint, self.every = endpoint, every
        self.compactions = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Compactor":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        r = EtcdRpc(self.endpoint, timeout=30.0)
        try:
            before = r.header(serializable=False).revision
            while not self._stop.wait(self.every):
                now = r.header(serializable=False).revision
                if before > 1:
                    r.compact(before)
                    self.compactions += 1
                before = now
        finally:
            r.close()


def existing_keys(cfg: Config) -> Set[bytes]:
    """Every key the cluster has now (what a writer may delete and count as an event)."""
    r = EtcdRpc(cfg.members[0].client_url, timeout=60.0)
    try:
        return {kv.key for kv in r.range(b"\0", b"\0", keys_only=True).kvs}
    finally:
        r.close()


def warm_up(cfg: Config, events: int, size: int, key_format: bytes, key_count: int,
            compact_seconds: float = 10.0) -> Dict[str, Any]:
    """``events`` events with no watch, compacted as the apiserver does: a full backup taken
    after it is one of a cluster that has been running (its db file holds the free pages its
    history left), as the operator's cron backups and the daemon's checkpoints are."""
    w = Writer([m.client_url for m in cfg.members], events, size, key_format, key_count, existing_keys(cfg))
    with Compactor(cfg.members[0].client_url, compact_seconds):
        n, secs = w.run()
    return {"events": n, "write_seconds": secs}


def live_chain(cfg: Config, sup: DeltaSupervisor, base_revision: int, events: int, size: int,
               key_format: bytes, key_count: int, existing: Optional[Collection[bytes]] = None,
               compact_seconds: float = 10.0) -> Dict[str, Any]:
    """Wait until ``sup`` watches from ``base_revision``, write ``events`` events (compacting as
    the apiserver does), wait until the chain holds them all; what was written and how long it took."""
    poll(lambda: watching(sup) == base_revision, timeout=120, what=f"a watch from revision {base_revision}",
         interval=0.2)
    w = Writer([m.client_url for m in cfg.members], events, size, key_format, key_count,
               existing if existing is not None else existing_keys(cfg))
    with Compactor(cfg.members[0].client_url, compact_seconds):
        n, secs = w.run()
    t = time.monotonic()
    poll(lambda: chain_end(cfg) >= w.last_revision, timeout=300, what=f"the chain to reach {w.last_revision}",
         interval=0.5)
    return {"events": n, "write_seconds": secs, "rate": n / secs, "last_revision": w.last_revision,
            "caught_up_seconds": time.monotonic() - t}
