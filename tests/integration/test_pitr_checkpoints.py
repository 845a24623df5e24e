"""Checkpoints: full backups the daemon takes inside a running delta chain, which the chain then
vouches for, so that a point-in-time restore replays only what follows the newest one before its
target. On loopback, etcd 3.5.16, a real `etcd-agent run` daemon; every restore through the CLI,
every restored key space compared with the live one read at the same revision before."""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Dict, List, Tuple

import pytest

from etcd_agent.chain import chains
from etcd_agent.etcd import proto
from etcd_agent.etcd.rpc import EtcdRpc
from tests.integration.continuous import (
    agent,
    delete,
    dump,
    put,
    rpc,
    start_all,
    wait_durable,
    wait_for,
    wait_watching,
)
from tests.integration.test_daemon import wait_healthy

pytestmark = pytest.mark.integration

# a checkpoint each time the chain grows by a fifth of its full backup - at least 1 MiB
# (checkpoints.MIN_GROWTH), which the workload's 16 KiB values reach in ~65 puts - at most one every 2 s
CHECKPOINTS = {"checkpoint_ratio": "0.2", "checkpoint_min_seconds": "2.0"}


def live_at(r: EtcdRpc, revision: int) -> Dict[str, Tuple[bytes, int]]:
    """What `etcdctl get "" --prefix --rev=N` reads: every key, its value and lease at ``revision``."""
    res = r.range(b"\0", b"\0", revision=revision)
    assert not res.more
    return {e.key.decode(): (e.value, e.lease) for e in res.kvs}


def user_keys(kv: Dict[str, Tuple[bytes, int]]) -> Dict[str, Tuple[bytes, int]]:
    return {k: v for k, v in kv.items() if not k.startswith("/etcd-agent/")}  # the agent's own (lineage)


def same_state(live: Dict[str, Tuple[bytes, int]], got: Dict[str, Tuple[bytes, int]]) -> List[str]:
    """What differs: every key and value must be equal, and the keys must share leases as they did.
    Lease ids themselves may differ: a lease that came with the snapshot a replay starts from is
    given its remaining TTL by moving its keys to a new lease (the lease rule), one granted by the
    chain keeps its id - so the same target can come back with other ids from another start."""
    diff = sorted(k for k in live.keys() | got.keys() if (live.get(k) or (None,))[0] != (got.get(k) or (None,))[0])

    def groups(kv: Dict[str, Tuple[bytes, int]]) -> set:  # type: ignore[type-arg]
        by: Dict[int, List[str]] = {}
        for k, (_v, lease) in kv.items():
            if lease:
                by.setdefault(lease, []).append(k)
        return {tuple(sorted(ks)) for ks in by.values()}

    if groups(live) != groups(got):
        diff.append("keys grouped by lease differ")
    return diff


def vouched(directory: str) -> List[Tuple[str, int]]:
    return [(cp.name, cp.revision) for ch in chains.scan(directory).chains for cp in ch.checkpoints]


def watched(bed):  # type: ignore[no-untyped-def]
    """A one-member bed with checkpoints, its daemon watching: (daemons, cluster, backup dir, rpc, a lease)."""
    d = bed(n=1, delta=CHECKPOINTS)
    start_all(d)
    wait_watching(d.c)
    r = rpc(d.c)
    return d, d.c, d.c.cfg.backup.dir, r, r.lease_grant(900)[0]


def workload(r: EtcdRpc, phase: str, n: int, lease: int) -> int:
    """Puts of 16 KiB, updates, deletes, three-key transactions and lease-attached keys; the last revision."""
    rev = 0
    for i in range(n):
        rev = put(r, f"/{phase}/k{i:03d}", os.urandom(8192).hex().encode())
        if i % 10 == 0:
            rev = put(r, f"/shared/k{i % 30:02d}", f"{phase}-{i}".encode())  # updated by every phase
        if i % 25 == 24:
            rev = delete(r, f"/{phase}/k{i - 5:03d}")
        if i % 40 == 0:
            rev = r.txn([proto.op_put(f"/{phase}/t{i}-{j}".encode(), b"t", lease if j == 0 else 0)
                         for j in range(3)]).revision
    return rev


def start_of(directory: str, target: int) -> str:
    """What a restore to ``target`` must start from: the newest checkpoint the chain vouches for at
    or before it (all are kept here: two at most are taken in the test), else the full backup."""
    cps = [x for x in vouched(directory) if x[1] <= target]
    if not cps:
        return "point in time: full backup "
    name, rev = max(cps, key=lambda x: x[1])
    return f"point in time: checkpoint {name} (revision {rev}, "


def test_a_restore_replays_from_the_newest_vouched_checkpoint_and_restores_the_same_state(bed) -> None:  # type: ignore[no-untyped-def]
    _d, c, directory, r, lease = watched(bed)

    n_early = workload(r, "p1", 30, lease)  # inside the first phase: before any checkpoint after it
    n1 = workload(r, "p1b", 50, lease)
    wait_durable(c, n1)
    wait_for(lambda: [x for x in vouched(directory) if x[1] >= n1], 90,
             f"a checkpoint after revision {n1} that the chain vouches for")
    workload(r, "p2", 150, lease)
    n_p3 = workload(r, "p3", 10, lease)
    # a revision's time is its batch's arrival (batch_seconds 1): the time target well after it
    time.sleep(2.5)
    t_p3 = time.time()
    time.sleep(0.5)
    n3 = workload(r, "p3b", 10, lease)
    wait_durable(c, n3)
    # a checkpoint the last segments made due is taken and vouched for within min_seconds +
    # idle_seconds (2 + 3 s): the starts are known after that
    time.sleep(7.0)
    # the target: half way between the newest checkpoint with revisions after it and the next one
    # (or the chain's end), so that the replay starts from it and folds a tail
    revs = sorted(x[1] for x in vouched(directory) if x[1] < n3)
    assert revs, vouched(directory)
    n_mid = (revs[-1] + ([x for x in sorted(x[1] for x in vouched(directory)) if x > revs[-1]] + [n3 + 1])[0]) // 2
    assert n_mid > revs[-1], (revs, n3)
    lives = {n: user_keys(live_at(r, n)) for n in (n_early, n_mid)}
    starts = {n: start_of(directory, n) for n in (n_early, n_mid)}
    assert "checkpoint" in starts[n_mid], (vouched(directory), n_mid)
    print(f"\nFIGURE checkpoints: {vouched(directory)} vouched for by the chain (revision, name); "
          f"a restore to {n_mid} starts from {starts[n_mid].split(': ', 1)[1]}...; to {n_early} from "
          f"{starts[n_early].split(': ', 1)[1]}...")

    listing = agent(c, "backup", "list")
    assert listing.returncode == 0, listing.stderr
    assert "a checkpoint the daemon took inside delta chain" in listing.stdout, listing.stdout
    assert "vouched for by the chain, a point-in-time restore starts its replay here" in listing.stdout
    assert "replays ~0s from checkpoint" in listing.stdout, listing.stdout

    # a time target after p3: the newest checkpoint at or before the revision it reaches
    from datetime import datetime, timezone

    when = datetime.fromtimestamp(t_p3, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    dry = agent(c, "restore", "--from", "latest", "--to-time", when, "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"reached revision {n_p3} " in dry.stdout, (n_p3, dry.stdout)
    assert start_of(directory, n_p3) in dry.stdout, (start_of(directory, n_p3), dry.stdout)

    walls = {}
    for n in (n_mid, n_early):
        dry = agent(c, "restore", "--from", "latest", "--to-revision", str(n), "--dry-run")
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert starts[n] in dry.stdout and f"reached revision {n}" in dry.stdout, (starts[n], dry.stdout)
        t = time.monotonic()
        res = agent(c, "--json", "restore", "--from", "latest", "--to-revision", str(n), "--yes")
        walls[n] = time.monotonic() - t
        assert res.returncode == 0, res.stdout + res.stderr
        assert json.loads(res.stdout)["done"] is True
        wait_healthy(c.cfg, 1, 60)
        diff = same_state(lives[n], user_keys(dump(rpc(c))))
        assert not diff, (n, diff[:10])

    # the same target with --no-checkpoint: the whole chain from the full backup, the same state
    t = time.monotonic()
    res = agent(c, "restore", "--from", "latest", "--to-revision", str(n_mid), "--no-checkpoint", "--yes")
    wall_full = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    onto = next(ln for ln in res.stderr.splitlines() if "replaying the delta chain onto" in ln)
    assert "checkpoint" not in onto, onto
    wait_healthy(c.cfg, 1, 60)
    assert not same_state(lives[n_mid], user_keys(dump(rpc(c))))
    print(f"FIGURE checkpoints: restore --to-revision {n_mid}: {len(lives[n_mid])} keys and values equal to the live "
          f"key space at {n_mid} ({walls[n_mid]:.1f}s; --no-checkpoint, the whole chain: {wall_full:.1f}s, equal "
          f"too); --to-revision {n_early}: {len(lives[n_early])} equal ({walls[n_early]:.1f}s)")


def snapshot_span(path: str) -> Tuple[int, int]:
    """(offset, size) of etcd_snapshot.db inside a plain backup tarball."""
    import tarfile

    with tarfile.open(path) as tf:
        m = tf.getmember("etcd_snapshot.db")
        return m.offset_data, m.size


def test_a_checkpoint_that_is_not_what_its_chain_vouches_for_is_passed_over(bed) -> None:  # type: ignore[no-untyped-def]
    """The newest checkpoint damaged on disk (a flipped byte in its snapshot), then replaced by
    another checkpoint's bytes under its name: each time the restore starts from the older
    checkpoint instead, says why, and restores the same state."""
    d, c, directory, r, lease = watched(bed)
    for phase in ("p1", "p2"):  # each phase grows the chain past a checkpoint's worth
        top = workload(r, phase, 100, lease)
        wait_durable(c, top)
        wait_for(lambda top=top: [x for x in vouched(directory) if x[1] >= top], 90, f"a vouched checkpoint after {phase}")
    top = put(r, "/last", b"x")
    wait_durable(c, top)
    live = user_keys(live_at(r, top))
    d.stop()  # nothing writes into the dir while its files are damaged
    c.members[0].backend.start()
    c.members[0].wait_healthy(30)
    cps = sorted(vouched(directory), key=lambda x: x[1])
    older, newest = cps[-2], cps[-1]
    path = os.path.join(directory, newest[0])

    # a flipped byte in the middle of its snapshot (the manifest, still signed, names the old sha256)
    off, size = snapshot_span(path)
    with open(path, "r+b") as fh:
        fh.seek(off + size // 2)
        b = fh.read(1)
        fh.seek(off + size // 2)
        fh.write(bytes([b[0] ^ 0x40]))
    dry = agent(c, "restore", "--from", "latest", "--to", "newest", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"point in time: checkpoint {older[0]} (revision {older[1]}" in dry.stdout, dry.stdout
    assert f"passed over: {newest[0]}" in dry.stdout, dry.stdout
    damaged = next(ln for ln in dry.stderr.splitlines() if f"checkpoint {newest[0]}" in ln and "WARNING" in ln)
    assert "cannot be read" in damaged, damaged

    # another checkpoint's bytes under its name: a real, signed backup of this chain, the wrong snapshot
    os.unlink(path)
    shutil.copy2(os.path.join(directory, older[0]), path)
    os.chmod(path, 0o600)
    dry = agent(c, "restore", "--from", "latest", "--to", "newest", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"point in time: checkpoint {older[0]} (revision {older[1]}" in dry.stdout, dry.stdout
    swapped = next(ln for ln in dry.stderr.splitlines() if f"checkpoint {newest[0]}" in ln and "WARNING" in ln)
    assert "not the one its chain vouches for" in swapped, swapped
    res = agent(c, "restore", "--from", "latest", "--to", "newest", "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(c.cfg, 1, 60)
    assert not same_state(live, user_keys(dump(rpc(c))))
    print(f"\nFIGURE checkpoint damaged: {damaged.split('WARNING', 1)[-1].strip()[:220]}")
    print(f"FIGURE checkpoint swapped: {swapped.split('WARNING', 1)[-1].strip()[:220]}; restored from "
          f"{older[0]}: {len(live)} keys equal to the live key space at {top}")
