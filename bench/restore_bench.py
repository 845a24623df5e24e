"""Benchmark: the fixed cost of `etcd-agent restore --from X --yes` over the manual runbook.

A 3-member cluster gets --keys keys and a backup; then it is restored from that backup again and
again, ``--rounds`` interleaved rounds (the order rotates each round, so a noisy neighbour on a
shared machine hits every way alike), each way timed from its first command to every member
healthy:

- agent: ``etcd-agent --json restore --from TAR --yes`` (sessions and locks, pre-checks, identity,
  journal, ship, fence, stop, restore, start, converge, unfence, finish); its own phase timings
  (the JSON ``timings``) give the per-phase breakdown, ``cli`` being the rest of the wall
  (Python start-up, config, closing the sessions).
- by hand, one member after the other, as the seed runbook does it: stop etcd, ``mv`` the data
  dir aside, ``etcdutl snapshot restore`` with the member's flags, start etcd; then wait until
  every member is healthy (polled every 50 ms: the by-hand column is never slow for polling).

``--tier loopback``: the members on loopback (the test harness, process backend). ``--tier
netns``: three network-namespace hosts with sshd (bench/restore_netns.py), the agent run on the
first, the others reached over SSH; by hand there means OpenSSH to each host, serially and all
hosts at once. It prints agent wall (min/median/max), by-hand wall, the difference (the agent's
fixed cost on a small db) and the ratio, then the per-phase medians.

    .venv/bin/python bench/restore_bench.py [--tier loopback|netns|both] [--keys 10000] [--rounds 3]
        [--value-bytes 64]   # netns: --keys 1000 --value-bytes 1048576 is a 1 GiB db
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.installed import byte_compile  # noqa: E402
from etcd_agent.backup.service import take_backup  # noqa: E402
from etcd_agent.config import Config  # noqa: E402
from etcd_agent.etcd.client import EtcdClient  # noqa: E402
from etcd_agent.topology import initial_cluster, member_pairs  # noqa: E402
from tests.harness.loopback import LoopbackCluster  # noqa: E402
from tests.integration.test_restore import AGENT, EXTRA, counts, put_many  # noqa: E402


@dataclass
class Run:
    """One timed restore: its wall and where the time went."""

    wall: float
    phases: Dict[str, float] = field(default_factory=dict)


def agent_run(argv: Sequence[str]) -> Run:
    """``argv`` is an ``etcd-agent ... --json restore ...`` command; its wall and phase timings."""
    t0 = time.monotonic()
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"agent restore failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout)
    phases = {k: float(v) for k, v in out["timings"].items()}
    phases["cli"] = wall - float(out["duration"])
    if out.get("downtime") is not None:
        phases["downtime"] = float(out["downtime"])
    return Run(wall, phases)


def wait_all_healthy(cfg: Config, timeout: float = 60.0) -> None:
    """Every member answers a linearizable read (the runbook's `etcdctl endpoint health`)."""
    deadline = time.monotonic() + timeout
    with EtcdClient.from_config(cfg, timeout=2.0) as c:
        while True:
            if all(c.healthy(m.client_url, timeout=2.0)[0] for m in cfg.members):
                return
            if time.monotonic() > deadline:
                raise SystemExit("by hand: the cluster did not become healthy")
            time.sleep(0.05)


def extract_snapshot(tar: str, dest: str) -> str:
    """The runbook's `tar xf` of the snapshot (done before the clock starts)."""
    snap = os.path.join(dest, "etcd_snapshot.db")
    with tarfile.open(tar) as t:
        src = t.extractfile("etcd_snapshot.db")
        assert src is not None
        with src, open(snap, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return snap


_TOKENS = iter(range(1, 1 << 30))


def new_token() -> str:
    """The runbook's fresh cluster token: a member restored with the running cluster's token would
    get the ids of the members still running, and join them with a raft log they do not have."""
    return f"by-hand-{os.getpid()}-{next(_TOKENS)}"


def restore_argv(cfg: Config, tool: str, snap: str, name: str, data_dir: str, token: str) -> List[str]:
    """The runbook's `snapshot restore` of one member (its name and peer URL)."""
    m = cfg.member(name)
    return [tool, "snapshot", "restore", snap, f"--name={name}",
            f"--initial-cluster={initial_cluster(member_pairs(cfg.members))}",
            f"--initial-cluster-token={token}", f"--initial-advertise-peer-urls={m.peer_url}",
            f"--data-dir={data_dir}"]


def by_hand_loopback(c: LoopbackCluster, snap: str) -> Run:
    """The serial runbook on loopback: per member stop, mv aside, snapshot restore, start; then wait."""
    phases = dict.fromkeys(("stop", "mv", "restore", "start", "wait"), 0.0)
    tool = c.cfg.etcd.etcdutl or c.cfg.etcd.etcdctl
    token = new_token()
    t0 = time.monotonic()

    def timed(name: str, fn: Callable[[], object]) -> None:
        t = time.monotonic()
        fn()
        phases[name] += time.monotonic() - t

    for lm in c.members:
        dd = c.cfg.data_dir(lm.member.name)
        timed("stop", lm.backend.stop)
        timed("mv", lambda dd=dd: os.rename(dd, f"{dd}.by-hand-{time.time():.3f}"))
        timed("restore", lambda lm=lm, dd=dd: subprocess.run(restore_argv(c.cfg, tool, snap, lm.member.name, dd, token), check=True,
                                                capture_output=True, env=dict(os.environ, ETCDCTL_API="3"),
                                                timeout=600))
        timed("start", lm.backend.start)
    timed("wait", lambda: wait_all_healthy(c.cfg))
    return Run(time.monotonic() - t0, phases)


def interleave(ways: Dict[str, Callable[[], Run]], rounds: int, between: Callable[[], None],
               check: Callable[[], None], warmup: int = 0) -> Dict[str, List[Run]]:
    """``rounds`` rounds of every way, the order rotated each round; ``between`` runs before each
    restore (untimed), ``check`` after it. ``warmup`` rounds of every way come first, printed and
    not counted: on the namespace bed the first restores after the fill ran up to twice as long,
    whichever way ran them, and the rotation puts the first way first."""
    names = list(ways)
    out: Dict[str, List[Run]] = {n: [] for n in names}
    for r in range(-warmup, rounds):
        # the warm-up in the given order: on the namespace bed the agent comes first, since its
        # backup is another cluster's to it once a by-hand restore has made new member ids and no
        # restore of its own has recorded the lineage
        k = max(r, 0) % len(names)
        order = names[k:] + names[:k]
        for n in order:
            between()
            run = ways[n]()
            check()
            if r >= 0:
                out[n].append(run)
            top = sorted(run.phases.items(), key=lambda kv: -kv[1])[:4]
            label = f"round {r + 1}" if r >= 0 else "warm-up (not counted)"
            print(f"  {label} {n}: {run.wall:.2f}s ({', '.join(f'{k} {v:.2f}' for k, v in top)})", flush=True)
    return out


def _mmm(xs: Sequence[float]) -> str:
    return f"{min(xs):6.2f} {statistics.median(xs):6.2f} {max(xs):6.2f}"


def report(title: str, runs: Dict[str, List[Run]], agent: str = "agent") -> None:
    """Walls (min/median/max), the fixed cost and ratio against each by-hand way, phase medians."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n== {title} ({len(runs[agent])} rounds; load average now {load}, {os.cpu_count()} cpus)")
    print(f"{'wall s':<34} {'min':>6} {'median':>6} {'max':>6}")
    for name, rs in runs.items():
        print(f"{name:<34} {_mmm([r.wall for r in rs])}")
    a = statistics.median(r.wall for r in runs[agent])
    for name, rs in runs.items():
        if name == agent:
            continue
        h = statistics.median(r.wall for r in rs)
        print(f"fixed cost vs {name} (median agent - median by hand): {a - h:.2f}s, ratio {a / h:.2f}")
    for name, rs in runs.items():
        keys = sorted({k for r in rs for k in r.phases}, key=lambda k: -statistics.median(r.phases.get(k, 0.0) for r in rs))
        cells = [f"{k} {statistics.median(r.phases.get(k, 0.0) for r in rs):.2f}" for k in keys]
        print(f"phases of {name} (median s): " + ", ".join(cells))


def loopback(keys: int, rounds: int, directory: str) -> None:
    base = tempfile.mkdtemp(prefix="restore-bench-", dir=directory)
    c = LoopbackCluster(os.path.join(base, "c"), 3, extra=EXTRA)
    try:
        c.start_static()
        put_many(c, "/k/", keys)
        b = take_backup(c.cfg, member="m1")
        snap = extract_snapshot(b.path, base)
        print(f"loopback: keys={keys} snapshot={b.size} bytes", flush=True)
        ways = {
            "agent restore --yes": lambda: agent_run([AGENT, "-c", c.config_path, "--json", "restore", "--from",
                                                      b.path, "--yes"]),
            "by hand, serial": lambda: by_hand_loopback(c, snap),
        }
        runs = interleave(ways, rounds, between=lambda: put_many(c, "/later/", 100),
                          check=lambda: _expect(counts(c, "/k/", "/later/"), [keys, 0]))
        report(f"loopback, 3 members, {keys} keys, snapshot {b.size} bytes", runs, agent="agent restore --yes")
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


def _expect(got: List[int], want: List[int]) -> None:
    if got != want:
        raise SystemExit(f"restored data wrong: counts {got}, expected {want}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--tier", choices=("loopback", "netns", "both"), default="loopback")
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--value-bytes", type=int, default=64, help="netns tier: size of every value")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="netns tier: untimed rounds of every way first")
    ap.add_argument("--dir", default="/var/tmp")
    a = ap.parse_args()
    byte_compile()
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    if a.tier in ("loopback", "both"):
        loopback(a.keys, a.rounds, a.dir)
    if a.tier in ("netns", "both"):
        from bench.restore_netns import netns

        netns(a.keys, a.rounds, a.dir, a.value_bytes, warmup=a.warmup)


if __name__ == "__main__":
    main()
