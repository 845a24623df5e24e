"""Benchmark: how long a killed etcd takes to serve again under `etcd-agent run` (process backend).

A 3-member loopback cluster (the test harness) on the etcd release ``--version``, one daemon per
member with the product's default cycle (``[daemon] interval = 10``). Each round kills one
member's etcd with SIGKILL (the members in turn) and times from the kill to that member answering
a linearizable health check again (polled every 50 ms), then waits until all three are healthy
before the next round. It prints kill -> healthy per round and min/median/max.

The daemon is etcd's parent: it learns of the exit from a pidfd at once and runs its next cycle
then (one early restart per cycle), so the figure is etcd's own start-up plus one cycle's work,
not the wait for the next cycle.

    .venv/bin/python bench/heal_bench.py [--version 3.5.16] [--rounds 6] [--interval 10]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from etcd_agent.etcd.client import EtcdClient  # noqa: E402
from tests.harness.loopback import LoopbackCluster  # noqa: E402
from tests.harness.releases import DEFAULT  # noqa: E402
from tests.integration.test_daemon import Daemons, wait_healthy  # noqa: E402

POLL = 0.05


def member_healthy(c: LoopbackCluster, i: int) -> bool:
    url = c.cfg.members[i].client_url
    with EtcdClient.from_config(c.cfg, [url], timeout=0.5) as cl:
        return cl.healthy(url, timeout=0.5)[0]


def one_round(c: LoopbackCluster, i: int, limit: float) -> float:
    """Kill member ``i``'s etcd; seconds until it is healthy again."""
    backend = c.members[i].backend
    pid = backend.pid()
    if pid is None:
        raise SystemExit(f"member {c.cfg.members[i].name} has no etcd running")
    t = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while time.monotonic() - t < limit:
        # a new process first (the old one may answer for a few ms while it dies), then health
        if backend.pid() not in (None, pid) and member_healthy(c, i):
            return time.monotonic() - t
        time.sleep(POLL)
    raise SystemExit(f"member {c.cfg.members[i].name} not healthy {limit:.0f}s after the kill")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", default=DEFAULT, help="etcd release under /opt/etcd (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--interval", type=float, default=10.0, help="[daemon] interval (default: the product's 10 s)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="heal-bench-") as d:
        c = LoopbackCluster(d, 3, version=args.version,
                            extra=f'[daemon]\ninterval = {args.interval}\nlock_ttl = 10\nstate_dir = "{d}/state"\n')
        daemons = Daemons(c)
        try:
            for m in c.cfg.members:
                daemons.start(m.name)
            wait_healthy(c.cfg, 3, 120)
            time.sleep(2 * args.interval)  # past the daemons' start-up cycles: a steady state
            took: List[float] = []
            for r in range(args.rounds):
                i = r % 3
                s = one_round(c, i, limit=6 * args.interval + 30)
                took.append(s)
                print(f"round {r + 1}: killed {c.cfg.members[i].name}'s etcd -> healthy in {s:.2f}s", flush=True)
                wait_healthy(c.cfg, 3, 120)
                time.sleep(args.interval)  # one early restart per cycle: the next kill is a new event
            print(f"etcd {args.version}, [daemon] interval {args.interval:g}s, {args.rounds} kills: kill -> healthy "
                  f"min {min(took):.2f}s, median {statistics.median(took):.2f}s, max {max(took):.2f}s")
        finally:
            daemons.stop()
            c.stop()


if __name__ == "__main__":
    main()
