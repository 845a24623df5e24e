#!/usr/bin/env python3
"""CPU of the continuous backup's watch path alone: a ``DeltaWatcher`` in this process.

A one-member loopback etcd (tests/harness/loopback.py); per round, in turn: the writer alone (no
watcher: this process's idle CPU and the writer's figures as the baseline), a plain watcher and an
encrypted one, each while ``delta_bench.py writer`` puts RATE values/s of SIZE bytes for DURATION
s. Reported per mode: this process's CPU in % of one core (median over the interleaved rounds,
and every round), the writer's completed rate and p50 latency against the writer alone.

    flock /tmp/etcd-agent-heavy.lock .venv/bin/python bench/watch_cpu_bench.py [--rounds 3] [--duration 20]
    ... --profile enc    # one cProfiled run of a mode instead (every thread, thread CPU time)
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from etcd_agent.age import generate_identity, parse_recipient  # noqa: E402
from etcd_agent.continuous.position import WatchOptions  # noqa: E402
from etcd_agent.continuous.watcher import DeltaWatcher  # noqa: E402
from etcd_agent.etcd.rpc import EtcdRpc  # noqa: E402
from tests.harness.loopback import LoopbackCluster  # noqa: E402

# plain / enc: one streaming watch; the -batched modes read it in batches every second (the
# daemon's default, [backup.delta] batch_seconds = 1.0)
MODES = ("alone", "plain", "enc", "plain-batched", "enc-batched")
TICK = os.sysconf("SC_CLK_TCK")


def threads_cpu() -> Dict[str, float]:
    """CPU seconds (user, system) of this process's threads by name (Python's and gRPC's C threads)."""
    out: Dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name} user/{tid}"] = int(fields[11]) / TICK
        out[f"{name} sys/{tid}"] = int(fields[12]) / TICK
    return out


def run_once(ep: str, root: str, mode: str, args: argparse.Namespace) -> Dict[str, Any]:
    w = None
    if mode != "alone":
        out = tempfile.mkdtemp(prefix=f"segs-{mode}-", dir=root)
        rec = (parse_recipient(generate_identity()[1]),) if mode.startswith("enc") else ()
        rev = EtcdRpc(ep).header().revision
        batch = 1.0 if mode.endswith("-batched") else 0.0
        w = DeltaWatcher(ep, rev, out, options=WatchOptions(recipients=rec, batch_seconds=batch))
        w.start()
    time.sleep(2)
    wr = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "delta_bench.py"), "writer", "--endpoint", ep, "--rate", str(args.rate),
         "--size", str(args.size), "--duration", str(args.duration)], stdout=subprocess.PIPE)
    t0, w0, th0 = time.process_time(), time.monotonic(), threads_cpu()
    stdout, _ = wr.communicate()
    time.sleep(1)  # the watch's tail
    wall = time.monotonic() - w0
    cpu = 100.0 * (time.process_time() - t0) / wall
    th1 = threads_cpu()
    by_thread: Dict[str, float] = {}
    for k, v in th1.items():
        name = k.rsplit("/", 1)[0]
        by_thread[name] = by_thread.get(name, 0.0) + 100.0 * (v - th0.get(k, 0.0)) / wall
    if wr.returncode != 0:
        raise SystemExit(f"writer failed ({wr.returncode})")
    if w is not None:
        w.stop()
        shutil.rmtree(w.out_dir, ignore_errors=True)
    return {"cpu_pct": cpu, "writer": json.loads(stdout),
            "threads_pct": {k: round(v, 2) for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1]) if v >= 0.05}}


def profile(ep: str, root: str, mode: str, args: argparse.Namespace) -> None:
    profs: List[cProfile.Profile] = []
    orig = threading.Thread.run

    def run(self: threading.Thread) -> None:
        p = cProfile.Profile(time.thread_time)
        profs.append(p)
        p.enable()
        try:
            orig(self)
        finally:
            p.disable()

    threading.Thread.run = run  # type: ignore[method-assign]
    r = run_once(ep, root, mode, args)
    threading.Thread.run = orig  # type: ignore[method-assign]
    print(f"{mode}: {r['cpu_pct']:.1f} % of a core (profiled); threads {r['threads_pct']}")
    st = pstats.Stats(profs[0])
    for p in profs[1:]:
        st.add(p)
    st.sort_stats("tottime").print_stats(40)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--profile", choices=MODES[1:])
    ap.add_argument("--json", help="write the rounds here")
    args = ap.parse_args()

    root = tempfile.mkdtemp(prefix="watchcpu-", dir="/var/tmp")
    c = LoopbackCluster(os.path.join(root, "c"), 1, bootstrap="static")
    c.start_static()
    try:
        ep = c.cfg.members[0].client_url
        if args.profile:
            profile(ep, root, args.profile, args)
            return
        res: Dict[str, List[Dict[str, Any]]] = {m: [] for m in MODES}
        for i in range(args.rounds):
            k = i % len(MODES)
            order = MODES[k:] + MODES[:k]  # interleaved: no mode always first
            for mode in order:
                r = run_once(ep, root, mode, args)
                res[mode].append(r)
                print(f"round {i + 1} {mode:13}: {r['cpu_pct']:5.1f} % of a core, writer "
                      f"{r['writer']['rate_median']:.0f}/s p50 {r['writer']['latency_ms_p50']:.2f} ms; threads "
                      f"{r['threads_pct']}",
                      file=sys.stderr, flush=True)
        base = res["alone"]
        base_rate = statistics.median(r["writer"]["rate_mean"] for r in base)
        base_lat = statistics.median(r["writer"]["latency_ms_p50"] for r in base)
        print(f"{args.rate} puts/s of {args.size} B, {args.duration:g} s, {args.rounds} rounds (median):")
        for mode in MODES:
            cpus = [r["cpu_pct"] for r in res[mode]]
            rate = statistics.median(r["writer"]["rate_mean"] for r in res[mode])
            lat = statistics.median(r["writer"]["latency_ms_p50"] for r in res[mode])
            print(f"  {mode:13}: CPU {statistics.median(cpus):5.1f} % of a core "
                  f"(rounds {', '.join(f'{x:.1f}' for x in cpus)}); writer {rate:.1f}/s "
                  f"({100 * rate / base_rate:.1f} % of alone), p50 {lat:.2f} ms ({lat / base_lat:.2f}x alone)")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
