"""Small helpers shared by the tests."""
from __future__ import annotations

import time
from typing import Dict, Tuple

from etcd_agent.etcd import proto
from etcd_agent.etcd.rpc import EtcdRpc

KV = Tuple[bytes, int, int, int, int]  # value, create_revision, mod_revision, version, lease


def dump(rpc: EtcdRpc, revision: int = 0) -> Dict[bytes, KV]:
    """The whole keyspace (at ``revision``; 0 = now) as key -> (value, create, mod, version, lease)."""
    res = rpc.range(b"\0", b"\0", revision=revision)
    assert not res.more
    return {e.key: (e.value, e.create_revision, e.mod_revision, e.version, e.lease) for e in res.kvs}


def values(d: Dict[bytes, KV]) -> Dict[bytes, bytes]:
    return {k: v[0] for k, v in d.items()}


def wait_for(pred, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def put(rpc: EtcdRpc, key: bytes, value: bytes, lease: int = 0) -> int:
    return rpc.txn([proto.op_put(key, value, lease)]).revision


def wait_watcher_caught_up(watcher, revision: int, timeout: float = 30.0) -> None:
    """Until the watcher has written ``revision`` (stopping it then closes the open segment)."""
    ok = wait_for(lambda: watcher.captured_revision >= revision or not watcher.running, timeout)
    assert ok, f"watcher did not reach revision {revision}: {watcher.status().to_json()}"


class Writer:
    """A mixed workload for ``seconds``: puts (a third with a lease), deletes, multi-key
    transactions, and short leases that expire (their keys vanish in one revision)."""

    def __init__(self, rpc: EtcdRpc, seed: int = 7) -> None:
        import random

        self.rpc = rpc
        self.rng = random.Random(seed)
        self.long_lease, _ = rpc.lease_grant(120)
        self.ops = 0

    def step(self) -> None:
        r, rng = self.rpc, self.rng
        k = b"k%03d" % rng.randrange(150)
        x = rng.random()
        if x < 0.5:
            lease = self.long_lease if rng.random() < 0.33 else 0
            r.txn([proto.op_put(k, b"v%d-" % self.ops + bytes(rng.randrange(256) for _ in range(rng.randrange(64))),
                                lease)])
        elif x < 0.7:
            r.txn([proto.op_delete(k)])  # deleting a missing key writes no revision
        elif x < 0.95:
            keys = sorted({b"t%02d" % rng.randrange(40) for _ in range(rng.randint(2, 6))})
            ops = [proto.op_put(key, b"txn%d" % self.ops) for key in keys[:-1]] + [proto.op_delete(keys[-1])]
            r.txn(ops)
        else:
            lid, _ = r.lease_grant(2)
            r.txn([proto.op_put(b"e%d-%d" % (self.ops, i), b"short", lid) for i in range(3)])
        self.ops += 1

    def run(self, seconds: float, pause: float = 0.002, min_ops: int = 0) -> int:
        """Steps for ``seconds``, and on until ``min_ops`` steps in all (a test that needs that
        much history does not depend on how fast a loaded machine writes; at most 60 s more)."""
        end = time.monotonic() + seconds
        limit = end + 60.0
        while time.monotonic() < end or (self.ops < min_ops and time.monotonic() < limit):
            self.step()
            time.sleep(pause)
        return self.ops


def assert_replayed(got: Dict[bytes, KV], want: Dict[bytes, KV], base: int, reached: int,
                    moved: Tuple[bytes, ...] = ()) -> None:
    """``got`` (a replayed store) holds exactly ``want`` (the live store at ``reached``), with
    what a replay keeps: every key and value, each key's lease id (but ``moved``: reattached by
    the lease rule, created as before); a key untouched since the full backup (``base``) as it was in every field;
    a key the chain wrote with a mod revision above anything the original reached, its create
    revision if it lived since before ``base``, else a new one in the original creation order."""
    from etcd_agent.pitr.replayrun import LOAD_MARGIN

    assert set(got) == set(want), (sorted(set(got) ^ set(want))[:10])
    assert values(got) == values(want)
    for k, (_value, create, mod, version, lease) in want.items():
        g = got[k]
        if k in moved:  # a fix-up put moved it to another lease: a new mod revision, same creation
            assert g[1] == create and g[4] != lease, (k, g, want[k])
            continue
        assert g[4] == lease, (k, g, want[k])
        if mod <= base:
            assert g == want[k], (k, g, want[k])
            continue
        assert g[2] > reached + LOAD_MARGIN, (k, g, want[k])
        if create <= base:
            assert g[1] == create and 1 <= g[3] <= version, (k, g, want[k])
        else:
            assert g[1] > reached + LOAD_MARGIN and g[3] == 1, (k, g, want[k])
    born = sorted((want[k][1], k) for k in want if want[k][1] > base)
    news = [got[k][1] for _c, k in born]
    assert news == sorted(news), "keys created in the chain were loaded out of their creation order"
