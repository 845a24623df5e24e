"""Total disaster with continuous backup, encrypted ([backup] encrypt_to: full backups and delta
segments in age): a writer puts and deletes keys (some lease-attached, as Kubernetes does) and runs
multi-key transactions, logging every acknowledged write; three revisions' key spaces are read
from the live cluster, each taken once the one before is in a closed segment (four segment closes
in all, ~20 s); every etcd is killed and its data dir destroyed; `restore --from
latest --to newest --identity KEY --yes`. Then: acknowledged writes missing, deleted keys that
came back, expired-lease keys that came back; and `--to-revision N` for the three revisions, each
restored key space against the live one read before the disaster."""
from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import pytest

from etcd_agent.chain import chains
from etcd_agent.errors import EtcdError
from etcd_agent.etcd import proto
from etcd_agent.etcd.rpc import EtcdRpc
from tests.integration.continuous import (
    agent,
    closed_through,
    dump,
    full_backups,
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
        self.txns = 0
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
                if 0.5 <= x < 0.6:  # a multi-key transaction: three puts and a delete in one revision
                    keys = [f"/registry/configmaps/ns{n}/c{rng.randrange(100):02d}" for _ in range(3)]
                    keys = list(dict.fromkeys(keys))
                    gone = f"/registry/pods/ns{n}/p{rng.randrange(300):03d}"
                    ops = [proto.op_put(k.encode(), b"t%d-%d" % (n, i)) for k in keys] + [proto.op_delete(gone.encode())]
                    rev = r.txn(ops).revision
                    at = time.time()
                    with self._mu:
                        self.acks.extend(Ack(k, b"t%d-%d" % (n, i), 0, at, rev) for k in keys)
                        self.acks.append(Ack(gone, None, 0, at, rev))
                        self.txns += 1
                    time.sleep(0.002)
                    continue
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
def keyfile(tmp_path):  # type: ignore[no-untyped-def]
    """(identity file 0600, its recipient)."""
    from etcd_agent import age

    secret, recipient = age.generate_identity()
    path = tmp_path / "backup-key.txt"
    path.write_text(secret + "\n")
    os.chmod(path, 0o600)
    return str(path), recipient


@pytest.fixture
def bed(tmp_path, keyfile):  # type: ignore[no-untyped-def]
    # the product's defaults for the watch (segments close every 5 s), everything encrypted;
    # checkpoints at most every 10 s (the default's 60 s would leave none in the run)
    d = make_bed(str(tmp_path / "c"), delta={"close_seconds": "5.0", "idle_seconds": "60.0",
                                             "checkpoint_min_seconds": "10.0"},
                 backup=f'encrypt_to = ["{keyfile[1]}"]\n')
    yield d
    d.stop()
    d.c.stop()


def live_at(endpoint: str, revision: int) -> Dict[str, Tuple[bytes, int]]:
    """key -> (value, lease) of the whole key space at ``revision``, read from the live cluster."""
    res = EtcdRpc(endpoint, timeout=10.0).range(b"\0", b"\0", revision=revision)
    assert not res.more
    return {e.key.decode(): (e.value, e.lease) for e in res.kvs}


def compare(live: Dict[str, Tuple[bytes, int]], got: Dict[str, Tuple[bytes, int]], short: Dict[int, float]) -> Dict[str, int]:
    """Every key and value equal, but for keys of the short (never renewed) leases, which the lease
    rule drops when their lease ran out around the target and which then expire on their own: of
    those, the restored ones must be live ones with their values (nothing extra, nothing changed)."""
    short_keys = {k for k, (_v, lease) in live.items() if lease in short}
    # /etcd-agent/: the agent's own keys (the restore writes its lineage there)
    plain_live = {k: v[0] for k, v in live.items() if k not in short_keys and not k.startswith("/etcd-agent/")}
    plain_got = {k: v[0] for k, v in got.items() if k not in short_keys and not k.startswith("/etcd-agent/")}
    wrong = sum(1 for k in plain_live.keys() | plain_got.keys() if plain_live.get(k) != plain_got.get(k))
    short_bad = sum(1 for k in short_keys & got.keys() if got[k][0] != live[k][0])
    short_extra = sum(1 for k, (_v, lease) in got.items() if lease in short and k not in live)
    return {"keys": len(plain_live), "wrong": wrong, "short": len(short_keys),
            "short_restored": len(short_keys & got.keys()), "short_bad": short_bad + short_extra}


def vouched_for(c: Any) -> List[Tuple[str, int]]:
    return [(cp.name, cp.revision) for ch in chains.scan(c.cfg.backup.dir).chains for cp in ch.checkpoints]


def started_from(progress: str) -> str:
    """Where the restore's replay started, from its progress lines: a checkpoint or the full backup."""
    line = next((ln for ln in progress.splitlines() if "replaying the delta chain onto " in ln), "")
    return line.split("replaying the delta chain onto ", 1)[-1].split(" up to revision")[0].split(";")[0]


def test_total_disaster_loses_seconds_not_the_hour(bed, keyfile) -> None:  # type: ignore[no-untyped-def]
    d = bed
    c = d.c
    start_all(d)
    wait_watching(c)
    w = Writer([m.client_url for m in c.cfg.members])
    w.start()
    began = time.time()
    # three revisions to restore to, taken during the run, each in a segment of its own: the next
    # is taken once a closed segment holds the one before (a wait on the chain, not on a clock)
    wait_for(lambda: w.acks, 30, "the writer's first acknowledged write")
    marks: List[int] = []
    for _ in range(3):
        before = marks[-1] if marks else min(a.revision for a in w.acks)
        wait_for(lambda before=before: closed_through(c.cfg.backup.dir) >= before, 90,
                 f"a closed segment holding revision {before}")
        with w._mu:
            marks.append(max(a.revision for a in w.acks))
    wait_for(lambda: closed_through(c.cfg.backup.dir) >= marks[-1], 90,
             f"a closed segment holding revision {marks[-1]}")
    lives = {n: live_at(c.cfg.members[0].client_url, n) for n in marks}  # before the disaster

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
    segs = segment_files(c)
    assert segs and all(p.endswith(".seg.age") for p in segs), segs
    assert all(p.endswith(".tar") for p in full_backups(c))

    # without the key: refused before anything is touched, naming the recipients
    res = agent(c, "restore", "--from", "latest", "--to", "newest", "--yes", timeout=600)
    assert res.returncode == 3 and "pass --identity FILE" in res.stderr, res.stdout + res.stderr

    t = time.monotonic()
    res = agent(c, "restore", "--from", "latest", "--to", "newest", "--identity", keyfile[0], "--yes", timeout=600)
    wall = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(c.cfg, 3, 60)
    got = dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0))

    r = account(acks, got, w.short_expiry, disaster)
    missing_old, missing_recent, resurrected, expired_present = (
        r["missing_old"], r["missing_recent"], r["resurrected"], r["expired_present"])
    uncertain, lag = r["uncertain"], r["lag"]
    print(f"\nFIGURE disaster (encrypted): {len(acks)} acknowledged writes ({sum(a.value is None for a in acks)} "
          f"deletes, {sum(bool(a.lease) for a in acks)} lease-attached, {w.txns} multi-key transactions) over {disaster - began:.0f} s, "
          f"{w.errors} writer errors; {len(segs)} encrypted segments")
    print(f"FIGURE disaster: acknowledged writes missing after the restore: {len(missing_old)} older than "
          f"{SLACK:.0f} s before the disaster, {len(missing_recent)} within the last {SLACK:.0f} s "
          f"({uncertain} keys of leases running out within 1.5 s of it not judged; deletes count as writes); keys deleted more than {SLACK:.0f} s before it present: "
          f"{len(resurrected)}; keys of leases expired before it present: {len(expired_present)}")
    print(f"FIGURE disaster: the oldest lost write was acknowledged {lag:.3f}s before the disaster (0: none lost); "
          f"RPO metric (textfile, written every 5 s) just before it {rpo_before:.1f}s; restore --to newest --identity "
          f"wall time {wall:.1f}s")
    print(f"FIGURE disaster: the chain vouches for {len(vouched_for(c))} checkpoint(s) (encrypted full backups taken "
          f"inside it): {vouched_for(c)}; the restore started from: {started_from(res.stderr)}")
    print("FIGURE disaster plan lines:\n  " + "\n  ".join(
        ln.split("restore: ", 1)[-1] for ln in res.stderr.splitlines() if "replay" in ln or "encrypted" in ln)[:2000])
    assert not missing_old, missing_old[:5]
    assert not resurrected, resurrected[:5]
    assert not expired_present, expired_present[:5]
    assert chains.scan(c.cfg.backup.dir).chains

    # the three revisions, each restored and read against the live cluster's history
    short = dict(w.short_expiry)
    for n in marks:
        res = agent(c, "restore", "--from", "latest", "--to-revision", str(n), "--identity", keyfile[0], "--yes",
                    timeout=600)
        assert res.returncode == 0, res.stdout + res.stderr
        wait_healthy(c.cfg, 3, 60)
        got_n = dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0))
        cmp = compare(lives[n], got_n, short)
        print(f"FIGURE disaster --to-revision {n} (from {started_from(res.stderr)}): {cmp['keys']} keys, "
              f"{cmp['wrong']} differ from the live key space at {n}; keys of never-renewed 3 s leases: {cmp['short']} live, {cmp['short_restored']} restored, "
              f"{cmp['short_bad']} wrong or extra")
        assert cmp["wrong"] == 0 and cmp["short_bad"] == 0, cmp
