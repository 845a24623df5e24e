"""Total disaster with continuous backup: a writer puts and deletes keys (some lease-attached, as
Kubernetes does) and logs every acknowledged write; every data dir is destroyed; `restore --from
latest --to newest --yes`. Then: acknowledged writes missing, and deleted keys that came back."""
from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import pytest

from etcd_agent.delta import chains, proto
from etcd_agent.delta.rpc import EtcdRpc
from etcd_agent.errors import EtcdError
from tests.integration.continuous import (
    agent,
    dump,
    make_bed,
    segment_files,
    start_all,
    textfile,
    wait_for,
    wait_watching,
)
from tests.integration.test_daemon import wait_healthy

pytestmark = pytest.mark.integration

KEEP_TTL = 60  # leases kept alive by their owner (kubelet-style node leases)
SHORT_TTL = 3  # leases nobody renews (event-style): their keys expire during the run
SLACK = 5.0  # the goal: nothing acknowledged more than this long before the disaster is lost


@dataclass
class Ack:
    key: str
    value: Optional[bytes]  # None: a delete
    lease: int
    at: float  # when the acknowledgement arrived (time.time())
    revision: int


class Writer:
    """Three threads, one per member endpoint; each op's acknowledgement is logged."""

    def __init__(self, endpoints: List[str], seed: int = 11) -> None:
        self.endpoints = endpoints
        self.acks: List[Ack] = []
        self.errors = 0
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self.rng = random.Random(seed)
        r = EtcdRpc(endpoints[0], timeout=5.0)
        self.keep = [r.lease_grant(KEEP_TTL)[0] for _ in range(4)]
        self.short_expiry: Dict[int, float] = {}
        self._keeper = r.keepalive()
        self._r = r

    def start(self) -> None:
        for i, ep in enumerate(self.endpoints):
            t = threading.Thread(target=self._run, args=(ep, i), daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._keepalive, daemon=True)
        t.start()
        self._threads.append(t)

    def _keepalive(self) -> None:
        while not self._stop.wait(KEEP_TTL / 6):
            try:
                self._keeper.renew(self.keep)
            except Exception:  # noqa: BLE001 - the disaster ends it
                return

    def _run(self, ep: str, n: int) -> None:
        rng = random.Random(n)
        r = EtcdRpc(ep, timeout=2.0)
        i = 0
        while not self._stop.is_set():
            i += 1
            key = f"/registry/pods/ns{n}/p{rng.randrange(300):03d}"
            x = rng.random()
            lease = 0
            try:
                if x < 0.6:
                    value: Optional[bytes] = b"v%d-%d" % (n, i)
                    if x < 0.2:
                        key = f"/registry/leases/node{n}-{rng.randrange(20)}"
                        lease = self.keep[rng.randrange(len(self.keep))]
                    elif x < 0.25:
                        key = f"/registry/events/e{n}-{i}"
                        lease, _ = r.lease_grant(SHORT_TTL)
                        with self._mu:
                            self.short_expiry[lease] = time.time() + SHORT_TTL
                    rev = r.txn([proto.op_put(key.encode(), value, lease)]).revision
                else:
                    value = None
                    rev = r.txn([proto.op_delete(key.encode())]).revision
            except EtcdError:
                with self._mu:
                    self.errors += 1
                if self._stop.wait(0.05):
                    return
                continue
            at = time.time()
            with self._mu:
                self.acks.append(Ack(key, value, lease, at, rev))
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)
        try:
            self._keeper.close()
        except Exception:  # noqa: BLE001
            pass


def account(acks: List[Ack], got: Dict[str, Any], short_expiry: Dict[int, float], disaster: float) -> Dict[str, Any]:
    """Judge the restored keyspace ``got`` against the acknowledged writes."""
    last: Dict[str, Ack] = {}
    for a in acks:
        last[a.key] = a
    missing_old: List[Ack] = []
    missing_recent: List[Ack] = []
    resurrected: List[Ack] = []
    expired_present: List[Ack] = []
    uncertain = 0
    for key, a in last.items():
        if a.value is None:
            if key in got:
                # a delete is a write like any other: lost within the last SLACK seconds (the
                # segment still open), a resurrection only when older than that
                (resurrected if a.at < disaster - SLACK else missing_recent).append(a)
            continue
        exp = short_expiry.get(a.lease)
        if exp is not None and exp + 1.5 < disaster:  # etcd revoked it well before: its key is gone
            if key in got:
                expired_present.append(a)
            continue
        if exp is not None and exp - 1.5 < disaster:
            uncertain += 1  # the lease ran out around the disaster: either is right
            continue
        if got.get(key, (None, 0))[0] != a.value:
            (missing_old if a.at < disaster - SLACK else missing_recent).append(a)
    lost = missing_old + missing_recent
    lag = disaster - min((a.at for a in lost), default=disaster)
    return {"missing_old": missing_old, "missing_recent": missing_recent, "resurrected": resurrected,
            "expired_present": expired_present, "uncertain": uncertain, "lag": lag}


@pytest.fixture
def bed(tmp_path):  # type: ignore[no-untyped-def]
    # the product's defaults for the watch (segments close every 5 s)
    d = make_bed(str(tmp_path / "c"), delta={"close_seconds": "5.0", "idle_seconds": "60.0"})
    yield d
    d.stop()
    d.c.stop()


def test_total_disaster_loses_seconds_not_the_hour(bed) -> None:  # type: ignore[no-untyped-def]
    d = bed
    c = d.c
    start_all(d)
    wait_watching(c)
    w = Writer([m.client_url for m in c.cfg.members])
    w.start()
    time.sleep(40)

    # the disaster: every etcd killed at once, every data dir destroyed (the daemons live on and
    # refuse to bootstrap a new cluster: these hosts ran members before)
    pids = [lm.backend.pid() for lm in c.members]
    for p in pids:
        if p:
            os.kill(p, signal.SIGKILL)
    disaster = time.time()
    rpo_before = textfile(c).get("etcd_agent_delta_rpo_seconds", -1.0)
    for m in c.cfg.members:
        shutil.rmtree(c.cfg.data_dir(m.name), ignore_errors=True)
    w.stop()
    acks = sorted(w.acks, key=lambda a: a.revision)
    # the watch sees its stream fail and closes its open segment; then nothing changes any more
    seen: Dict[str, float] = {"n": -1, "since": time.monotonic()}

    def settled() -> bool:
        n = len(segment_files(c))
        if n != seen["n"]:
            seen["n"], seen["since"] = n, time.monotonic()
        return time.monotonic() - seen["since"] > 3

    wait_for(settled, 60, "the segments to settle after the disaster")

    t = time.monotonic()
    res = agent(c, "restore", "--from", "latest", "--to", "newest", "--yes", timeout=600)
    wall = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(c.cfg, 3, 60)
    got = dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0))

    r = account(acks, got, w.short_expiry, disaster)
    missing_old, missing_recent, resurrected, expired_present = (
        r["missing_old"], r["missing_recent"], r["resurrected"], r["expired_present"])
    uncertain, lag = r["uncertain"], r["lag"]
    print(f"\nFIGURE disaster: {len(acks)} acknowledged writes ({sum(a.value is None for a in acks)} deletes, "
          f"{sum(bool(a.lease) for a in acks)} lease-attached) over 40 s, {w.errors} writer errors")
    print(f"FIGURE disaster: acknowledged writes missing after the restore: {len(missing_old)} older than "
          f"{SLACK:.0f} s before the disaster, {len(missing_recent)} within the last {SLACK:.0f} s "
          f"({uncertain} keys of leases running out within 1.5 s of it not judged; deletes count as writes); keys deleted more than {SLACK:.0f} s before it present: "
          f"{len(resurrected)}; keys of leases expired before it present: {len(expired_present)}")
    print(f"FIGURE disaster: the oldest lost write was acknowledged {lag:.3f}s before the disaster (0: none lost); "
          f"RPO metric (textfile, written every 5 s) just before it {rpo_before:.1f}s; restore --to newest wall "
          f"time {wall:.1f}s")
    print("FIGURE disaster plan lines:\n  " + "\n  ".join(
        ln.split("restore: ", 1)[-1] for ln in res.stderr.splitlines() if "replay" in ln)[:2000])
    assert not missing_old, missing_old[:5]
    assert not resurrected, resurrected[:5]
    assert not expired_present, expired_present[:5]
    assert chains.scan(c.cfg.backup.dir).chains
