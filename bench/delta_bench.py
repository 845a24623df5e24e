#!/usr/bin/env python3
"""Benchmark of the delta feature on this machine.

1. Capture cost: a writer doing RATE puts/s of SIZE-byte values for DURATION s against a live
   single-member etcd (production defaults, fsync on), once without and once with the watcher.
   Writer and watcher run in subprocesses of their own, so psutil accounts each one's CPU
   separately; reported: writer throughput (median of per-second counts) and latency, watcher
   CPU % of one core (median of 1 s samples, and the whole-run mean) and RSS, etcd CPU.
   Then the same without pacing (max throughput) for MAX_SECONDS each way.
2. Replay: the captured chain replayed onto its full backup (and checked equal to the live
   keyspace), and a synthetic chain of EVENTS events onto a full backup of FULL_KEYS keys:
   events/s and the total restore time (full backup + events).

    /work/main/.venv/bin/python /work/proto/delta/bench_delta.py [--duration 60] [--json out.json]

The JSON report goes to stdout (or --json); progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from etcd_agent.delta import proto  # noqa: E402
from etcd_agent.delta.replay import Target, replay  # noqa: E402
from etcd_agent.delta.scratch import ScratchOptions, scratch_etcd, start_scratch  # noqa: E402
from etcd_agent.delta.segments import DELETE, PUT, Event, SegmentHeader, SegmentWriter, Txn, list_segments  # noqa: E402

log = logging.getLogger("bench_delta")
LIVE = ScratchOptions(unsafe_no_fsync=False, max_request_bytes=1572864, max_txn_ops=128)


# ---------------------------------------------------------------- subprocess roles


def role_writer(args: argparse.Namespace) -> None:
    """Puts at ``rate``/s (0: as fast as ``inflight`` allows) for ``duration`` s; JSON out."""
    import grpc

    ch = grpc.insecure_channel(args.endpoint.split("//", 1)[1])
    txn = ch.unary_unary("/etcdserverpb.KV/Txn", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    value = os.urandom(args.size)
    sem = threading.Semaphore(args.inflight)
    done_at: List[float] = []
    lat: List[float] = []
    errors = [0]
    lock = threading.Lock()

    def finished(fut: Any, t0: float) -> None:
        sem.release()
        now = time.monotonic()
        with lock:
            if fut.exception() is None:
                done_at.append(now)
                lat.append(now - t0)
            else:
                errors[0] += 1

    start = time.monotonic()
    end = start + args.duration
    i = 0
    while True:
        now = time.monotonic()
        if now >= end:
            break
        if args.rate:
            due = start + i / args.rate
            if due > now:
                time.sleep(min(due - now, 0.01))
                continue
        sem.acquire()
        t0 = time.monotonic()
        req = proto.encode_txn([proto.op_put(b"bench/%06d" % (i % 20000), value)])
        fut = txn.future(req, timeout=10)
        fut.add_done_callback(lambda f, t0=t0: finished(f, t0))
        i += 1
    for _ in range(args.inflight):
        sem.acquire(timeout=15)
    secs = [0] * (int(args.duration) + 1)
    for t in done_at:
        k = int(t - start)
        if 0 <= k < len(secs):
            secs[k] += 1
    lat.sort()
    out = {
        "issued": i,
        "completed": len(done_at),
        "errors": errors[0],
        "rate_median": statistics.median(secs[1:-1] or secs),
        "rate_mean": len(done_at) / args.duration,
        "latency_ms_p50": 1000 * lat[len(lat) // 2] if lat else None,
        "latency_ms_p99": 1000 * lat[int(len(lat) * 0.99)] if lat else None,
    }
    print(json.dumps(out))


def role_watcher(args: argparse.Namespace) -> None:
    """A DeltaWatcher until SIGTERM; JSON stats out."""
    from etcd_agent.delta.watcher import DeltaWatcher

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    w = DeltaWatcher(args.endpoint, args.base, args.out, close_seconds=5.0)
    try:
        w.run(stop)
    finally:
        print(json.dumps({"segments": w.segments_written, "responses": w.responses, "reconnects": w.reconnects,
                          "captured_revision": w.captured_revision}))


# ---------------------------------------------------------------- driver


def _spawn(role: str, *extra: str) -> subprocess.Popen:  # type: ignore[type-arg]
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), role, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _cpu(p: Any) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def capture_run(endpoint: str, etcd_pid: int, duration: float, rate: int, size: int, inflight: int,
                watch: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    import psutil

    watcher = None
    wproc = None
    if watch is not None:
        watcher = _spawn("watcher", "--endpoint", endpoint, "--base", str(watch["base"]), "--out", watch["out"])
        wproc = psutil.Process(watcher.pid)
        time.sleep(2.0)  # connected, first lease listing done
    etcd = psutil.Process(etcd_pid)
    writer = _spawn("writer", "--endpoint", endpoint, "--rate", str(rate), "--size", str(size),
                    "--duration", str(duration), "--inflight", str(inflight))
    t0 = time.monotonic()
    e0 = _cpu(etcd)
    w0 = _cpu(wproc) if wproc else 0.0
    samples: List[float] = []
    rss: List[int] = []
    last_t, last_c = t0, w0
    while writer.poll() is None:
        time.sleep(1.0)
        if wproc is not None:
            now, c = time.monotonic(), _cpu(wproc)
            samples.append(100.0 * (c - last_c) / (now - last_t))
            last_t, last_c = now, c
            rss.append(wproc.memory_info().rss)
    wall = time.monotonic() - t0
    out, err = writer.communicate()
    if writer.returncode != 0:
        raise SystemExit(f"writer failed: {err.decode()[-2000:]}")
    res: Dict[str, Any] = {"writer": json.loads(out), "etcd_cpu_pct": 100.0 * (_cpu(etcd) - e0) / wall}
    if watcher is not None and wproc is not None:
        res["watcher_cpu_pct_mean"] = 100.0 * (_cpu(wproc) - w0) / wall
        res["watcher_cpu_pct_median"] = statistics.median(samples[1:] or samples)
        res["watcher_rss_mb_max"] = max(rss) / 1e6
        time.sleep(6.0)  # let it close its last segment
        watcher.send_signal(signal.SIGTERM)
        wout, werr = watcher.communicate(timeout=60)
        if watcher.returncode != 0:
            raise SystemExit(f"watcher failed: {werr.decode()[-3000:]}")
        res["watcher"] = json.loads(wout.decode().strip().splitlines()[-1])
    return res


def synthetic_chain(segdir: str, base: int, events: int, size: int, t0: int) -> int:
    """A chain of ``events`` events after ``base``: mostly single puts, every 10th revision a
    3-key transaction, every 25th a delete. Returns the last revision."""
    rng = random.Random(5)
    value = os.urandom(size)
    rev = base
    made = 0
    seq = 0
    prev = ""
    t = t0
    live: Dict[bytes, tuple] = {}  # key -> (create revision, version)
    while made < events:
        w = SegmentWriter(segdir, SegmentHeader("5e" * 16, seq, base, rev + 1, prev, t))
        while made < events and w.size < 4 * 1024 * 1024:
            rev += 1
            t += 1
            if rev % 25 == 0 and live:
                k = rng.choice(sorted(live))
                del live[k]
                evs: tuple = (Event(DELETE, k, b"", rev, 0, 0, 0),)
            else:
                n = 3 if rev % 10 == 0 else 1
                keys = sorted({b"syn/%06d" % rng.randrange(50000) for _ in range(n)})
                out = []
                for k in keys:
                    c, v = live.get(k, (rev, 0))
                    live[k] = (c, v + 1)
                    out.append(Event(PUT, k, value, rev, c, v + 1, 0))
                evs = tuple(out)
            w.add_txn(Txn(rev, t, evs))
            made += len(evs)
        info = w.close(t, confirmed=True)
        prev = info.sha256
        seq += 1
    return rev


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="role")
    wr = sub.add_parser("writer")
    wr.add_argument("--endpoint", required=True)
    wr.add_argument("--rate", type=int, default=500)
    wr.add_argument("--size", type=int, default=1024)
    wr.add_argument("--duration", type=float, default=60)
    wr.add_argument("--inflight", type=int, default=32)
    wa = sub.add_parser("watcher")
    wa.add_argument("--endpoint", required=True)
    wa.add_argument("--base", type=int, required=True)
    wa.add_argument("--out", required=True)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--max-seconds", type=float, default=15)
    ap.add_argument("--events", type=int, default=100000)
    ap.add_argument("--full-keys", type=int, default=10000)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.role == "writer":
        return role_writer(args)
    if args.role == "watcher":
        return role_watcher(args)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    for noisy in ("delta", "etcd_agent"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    work = tempfile.mkdtemp(prefix="bench-delta-")
    report: Dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}}

    def save() -> None:  # after every phase: a late failure keeps the earlier numbers
        if args.json:
            with open(args.json, "w") as fh:
                fh.write(json.dumps(report, indent=2) + "\n")

    live = start_scratch(None, LIVE, name="live")
    try:
        rpc = live.rpc
        value = os.urandom(args.size)
        for i in range(0, args.full_keys, 100):
            rpc.txn([proto.op_put(b"full/%06d" % j, value) for j in range(i, min(i + 100, args.full_keys))])
        full = os.path.join(work, "full.db")
        base = live.snapshot_save(full).revision
        etcd_pid = live.pid
        assert etcd_pid is not None
        report["full_backup"] = {"keys": args.full_keys, "bytes": os.path.getsize(full), "revision": base}

        log.info("paced %d/s x %d B for %.0fs without the watcher", args.rate, args.size, args.duration)
        report["paced_without"] = capture_run(live.endpoint, etcd_pid, args.duration, args.rate, args.size, 64, None)
        save()
        segdir = os.path.join(work, "seg")
        # the watcher starts from the full backup: it first catches up on the baseline run
        log.info("paced with the watcher")
        report["paced_with"] = capture_run(live.endpoint, etcd_pid, args.duration, args.rate, args.size, 64,
                                           {"base": base, "out": segdir})
        segs = list_segments(segdir)
        report["paced_with"]["segments_bytes"] = sum(os.path.getsize(p) for p in segs)
        save()

        log.info("max throughput without / with the watcher, %.0fs each", args.max_seconds)
        report["max_without"] = capture_run(live.endpoint, etcd_pid, args.max_seconds, 0, args.size, 32, None)
        save()
        segdir2 = os.path.join(work, "seg2")
        report["max_with"] = capture_run(live.endpoint, etcd_pid, args.max_seconds, 0, args.size, 32,
                                         {"base": rpc.header().revision, "out": segdir2})
        save()

        log.info("replaying the captured chain")
        t = time.monotonic()
        res = replay(full, segs, Target.newest(), output=os.path.join(work, "captured.db"))
        cap = res.to_json()
        cap["events_per_s"] = res.events_applied / res.replay_seconds if res.replay_seconds else None
        with scratch_etcd(res.snapshot_path) as s:
            got = s.rpc.range(b"\0", b"\0").kvs
        want = {e.key: e.value for e in rpc.range(b"\0", b"\0", revision=res.reached_revision).kvs}
        cap["equal_to_live_at_reached_revision"] = {e.key: e.value for e in got} == want
        cap["wall_s"] = time.monotonic() - t
        report["replay_captured"] = {k: cap[k] for k in ("events_applied", "revisions_applied", "segments_applied",
                                                          "replay_seconds", "seconds", "events_per_s", "complete",
                                                          "equal_to_live_at_reached_revision")}
        save()
    finally:
        live.stop()

    log.info("synthetic chain of %d events", args.events)
    syn = os.path.join(work, "syn")
    os.makedirs(syn)
    last = synthetic_chain(syn, base, args.events, args.size, int(time.time() * 1000) - 3_600_000)
    segs = list_segments(syn)
    t = time.monotonic()
    res = replay(full, segs, Target.newest(), output=os.path.join(work, "syn.db"))
    report["replay_synthetic"] = {
        "events": res.events_applied,
        "revisions": res.revisions_applied,
        "segments": len(segs),
        "segment_bytes": sum(os.path.getsize(p) for p in segs),
        "reached_revision": res.reached_revision,
        "expected_revision": last,
        "replay_seconds": res.replay_seconds,
        "events_per_s": res.events_applied / res.replay_seconds,
        "revisions_per_s": res.revisions_applied / res.replay_seconds,
        "total_restore_seconds": res.seconds,
        "wall_s": time.monotonic() - t,
    }
    report["machine"]["loadavg_end"] = os.getloadavg()
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
