"""Benchmark: `etcd-agent restore --yes` vs the same restore done serially by hand with etcdctl.

A 3-member loopback cluster (the test harness, process backend) gets --keys keys and a backup;
then the cluster is restored twice from that backup and timed:

- agent: ``etcd-agent restore --from TAR --yes`` (pre-checks, lock, journal, parallel steps)
- by hand, one member after the other, as the seed runbook does it: stop etcd, ``mv`` the data
  dir aside, ``etcdctl snapshot restore`` with the member's flags, start etcd; then wait healthy.

    .venv/bin/python bench/restore_bench.py [--keys 10000] [--dir /var/tmp]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from etcd_agent.backup.service import take_backup  # noqa: E402
from etcd_agent.topology import initial_cluster, member_pairs  # noqa: E402
from tests.harness.loopback import LoopbackCluster  # noqa: E402
from tests.integration.test_restore import AGENT, EXTRA, counts, put_many  # noqa: E402


def by_hand(c: LoopbackCluster, tar: str, work: str) -> float:
    """The serial runbook: per member stop, mv aside, snapshot restore, start; then wait."""
    with tarfile.open(tar) as t:
        snap = os.path.join(work, "etcd_snapshot.db")
        with t.extractfile("etcd_snapshot.db") as src, open(snap, "wb") as dst:  # type: ignore[union-attr]
            shutil.copyfileobj(src, dst)
    ic = initial_cluster(member_pairs(c.cfg.members))
    t0 = time.monotonic()
    for lm in c.members:
        m = lm.member
        lm.backend.stop()
        dd = c.cfg.data_dir(m.name)
        os.rename(dd, f"{dd}.by-hand-{time.time():.0f}")
        subprocess.run(
            [c.cfg.etcd.etcdutl or c.cfg.etcd.etcdctl, "snapshot", "restore", snap, f"--name={m.name}", f"--initial-cluster={ic}",
             "--initial-cluster-token=by-hand", f"--initial-advertise-peer-urls={m.peer_url}", f"--data-dir={dd}"],
            check=True, capture_output=True, env=dict(os.environ, ETCDCTL_API="3"), timeout=600,
        )
        lm.backend.start()
    for lm in c.members:
        lm.wait_healthy(60)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--dir", default="/var/tmp")
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="restore-bench-", dir=a.dir)
    c = LoopbackCluster(os.path.join(base, "c"), 3, extra=EXTRA)
    try:
        c.start_static()
        put_many(c, "/k/", a.keys)
        b = take_backup(c.cfg, member="m1")
        put_many(c, "/later/", 100)
        t0 = time.monotonic()
        subprocess.run([AGENT, "-c", c.config_path, "restore", "--from", b.path, "--yes"], check=True,
                       stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, timeout=600)
        agent = time.monotonic() - t0
        assert counts(c, "/k/", "/later/") == [a.keys, 0]
        put_many(c, "/later/", 100)
        hand = by_hand(c, b.path, base)
        assert counts(c, "/k/", "/later/") == [a.keys, 0]
        print(f"keys={a.keys} snapshot={b.size} bytes")
        print(f"agent restore --yes (3 members, pre-checks, journal, lock): {agent:.2f}s")
        print(f"by hand, serial (stop, mv, etcdctl snapshot restore, start x3): {hand:.2f}s")
        print(f"ratio agent/by-hand: {agent / hand:.2f}")
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
