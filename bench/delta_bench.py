#!/usr/bin/env python3
"""Benchmark of continuous backup, measuring the real daemon (one command).

1. Capture cost. A one-member loopback cluster on etcd 3.5.16 (production defaults: fsync on)
   run by a real ``etcd-agent run`` daemon (process backend). A writer subprocess puts RATE
   values/s of SIZE bytes for DURATION s, first with ``[backup.delta] enabled = false``, then -
   after ``enabled = true`` and SIGHUP, the watch caught up - with it. Reported: the writer's
   throughput (median of per-second counts) and latency, the daemon process's CPU (% of one core:
   whole-run mean and median of 1 s samples; its etcd child is counted separately) and RSS. Then
   the same unpaced (max throughput) for MAX_SECONDS each way.
2. Replay. The captured chain replayed onto its full backup (checked equal to the live keyspace
   at the reached revision); a synthetic chain of EVENTS events onto a full backup of FULL_KEYS
   keys: events/s, the replay's total (full backup + events -> snapshot saved), and the wall time
   of ``etcd-agent restore --from FULL --to newest --yes`` of that cluster (replay + restore).

    .venv/bin/python bench/delta_bench.py [--duration 60] [--json out.json]
    .venv/bin/python bench/delta_bench.py --encrypt --no-synthetic   # with [backup] encrypt_to
    ... --batch-seconds 0        # the streaming watch instead of the default batches

``--encrypt``: the same with ``[backup] encrypt_to`` (a fresh age key): full backups and delta
segments (``.seg.age``) encrypted, the captured chain replayed with the identity.

The JSON report goes to stdout (or --json); a table and progress go to stderr.
"""
from __future__ import annotations

import argparse
import bisect
import json
import logging
import os
import random
import re
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
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from etcd_agent.backup import keys  # noqa: E402
from etcd_agent.backup.service import take_backup  # noqa: E402
from etcd_agent.chain import chains  # noqa: E402
from etcd_agent.chain.segments import DELETE, PUT, Event, SegmentHeader, Txn, list_segments  # noqa: E402
from etcd_agent.chain.writer import SegmentWriter  # noqa: E402
from etcd_agent.etcd import proto  # noqa: E402
from etcd_agent.etcd.rpc import EtcdRpc  # noqa: E402
from etcd_agent.pitr.replay import Target  # noqa: E402
from etcd_agent.pitr.replayrun import replay  # noqa: E402
from etcd_agent.scratch.member import scratch_etcd  # noqa: E402
from etcd_agent.waiting import poll  # noqa: E402
from tests.integration.continuous import agent, make_bed  # noqa: E402
from tests.integration.test_daemon import wait_healthy  # noqa: E402

log = logging.getLogger("delta_bench")


# ---------------------------------------------------------------- the writer (a subprocess)


def role_writer(args: argparse.Namespace) -> None:
    """Puts at ``rate``/s (0: as fast as ``inflight`` allows) for ``duration`` s; JSON out."""
    import grpc

    ch = grpc.insecure_channel(args.endpoint.split("//", 1)[1])
    txn = ch.unary_unary("/etcdserverpb.KV/Txn", request_serializer=lambda m: m.SerializeToString(),
                         response_deserializer=lambda b: b)
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



def synthetic_chain(segdir: str, base: int, events: int, size: int, t0: int, base_sha256: str = "", *,
                    key_format: bytes = b"syn/%06d", key_count: int = 50000,
                    existing: Optional[Dict[bytes, tuple]] = None, sign_key: Optional[bytes] = None) -> int:
    """A chain of ``events`` events after ``base``: mostly single puts over ``key_count`` keys,
    every 10th revision a 3-key transaction, every 25th a delete. Returns the last revision.
    ``base_sha256``: the full backup's snapshot sha256 the chain names (as the daemon's do);
    without it a restore judges the chain by time, and one dated before the backup (``t0``) is
    another backup's. ``existing``: keys the full backup holds, key -> (create revision,
    version), when the chain's keys are those (updates rather than new keys). ``sign_key``: the
    manifest key the daemon would sign with (a restore refuses an unsigned chain)."""
    rng = random.Random(5)
    value = os.urandom(size)
    rev = base
    made = 0
    seq = 0
    prev = ""
    t = t0
    live: Dict[bytes, tuple] = dict(existing or {})  # key -> (create revision, version)
    order: List[bytes] = sorted(live)  # kept sorted as it changes (sorting 50,000 keys a delete was most of the time)
    while made < events:
        w = SegmentWriter(segdir, SegmentHeader("5e" * 16, seq, base, rev + 1, prev, t, base_sha256=base_sha256),
                          sign_key=sign_key)
        while made < events and w.size < 4 * 1024 * 1024:
            rev += 1
            t += 1
            if rev % 25 == 0 and live:
                k = rng.choice(order)
                del live[k]
                del order[bisect.bisect_left(order, k)]
                evs: tuple = (Event(DELETE, k, b"", rev, 0, 0, 0),)
            else:
                n = 3 if rev % 10 == 0 else 1
                keys = sorted({key_format % rng.randrange(key_count) for _ in range(n)})
                out = []
                for k in keys:
                    if k not in live:
                        bisect.insort(order, k)
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


# ---------------------------------------------------------------- driver


def _spawn_writer(endpoint: str, rate: int, size: int, duration: float, inflight: int) -> "subprocess.Popen[bytes]":
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "writer", "--endpoint", endpoint,
                             "--rate", str(rate), "--size", str(size), "--duration", str(duration),
                             "--inflight", str(inflight)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _cpu(p: Any) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def capture_run(endpoint: str, daemon_pid: int, etcd_pid: int, duration: float, rate: int, size: int,
                inflight: int) -> Dict[str, Any]:
    """One writer run; the daemon's and etcd's CPU and the daemon's RSS sampled every second."""
    import psutil

    daemon, etcd = psutil.Process(daemon_pid), psutil.Process(etcd_pid)
    writer = _spawn_writer(endpoint, rate, size, duration, inflight)
    t0 = time.monotonic()
    d0, e0 = _cpu(daemon), _cpu(etcd)
    samples: List[float] = []
    rss: List[int] = []
    last_t, last_c = t0, d0
    while writer.poll() is None:
        time.sleep(1.0)
        now, c = time.monotonic(), _cpu(daemon)
        samples.append(100.0 * (c - last_c) / (now - last_t))
        last_t, last_c = now, c
        rss.append(daemon.memory_info().rss)
    wall = time.monotonic() - t0
    out, err = writer.communicate()
    if writer.returncode != 0:
        raise SystemExit(f"writer failed: {err.decode()[-2000:]}")
    return {
        "writer": json.loads(out),
        "daemon_cpu_pct_mean": 100.0 * (_cpu(daemon) - d0) / wall,
        "daemon_cpu_pct_median": statistics.median(samples[1:] or samples),
        "daemon_rss_mb_max": max(rss) / 1e6,
        "etcd_cpu_pct": 100.0 * (_cpu(etcd) - e0) / wall,
    }


def set_delta(config_path: str, enabled: bool, daemon_pid: int) -> None:
    """Rewrite [backup.delta] enabled and SIGHUP the daemon (it reloads before its next cycle)."""
    with open(config_path) as fh:
        text = fh.read()
    text = re.sub(r"(?m)^enabled = (true|false)\n", "", text)
    text = text.replace("[backup.delta]\n", f"[backup.delta]\nenabled = {'true' if enabled else 'false'}\n", 1)
    with open(config_path, "w") as fh:
        fh.write(text)
    os.kill(daemon_pid, signal.SIGHUP)


def wait_caught_up(backup_dir: str, rpc: EtcdRpc, timeout: float = 300.0) -> float:
    """Until a closed segment holds the member's current revision (the watch's catch-up done)."""
    t = time.monotonic()
    want = rpc.header().revision

    def done() -> bool:
        found = chains.scan(backup_dir).chains
        return max((x.end_revision for x in found if x.usable), default=0) >= want

    poll(done, timeout=timeout, what=f"a closed segment at revision {want}", interval=0.5)
    return time.monotonic() - t


def table(report: Dict[str, Any]) -> str:
    def row(name: str, a: Dict[str, Any], b: Dict[str, Any]) -> str:
        wa, wb = a["writer"], b["writer"]
        lost = 100.0 * (1 - wb["rate_median"] / wa["rate_median"]) if wa["rate_median"] else 0.0
        return (f"| {name} | {wa['rate_median']:.0f} / {wb['rate_median']:.0f} /s ({lost:+.1f} % lost) "
                f"| {wa['latency_ms_p50']:.1f} / {wa['latency_ms_p99']:.0f} -> {wb['latency_ms_p50']:.1f} / "
                f"{wb['latency_ms_p99']:.0f} ms | {a['daemon_cpu_pct_mean']:.1f} -> {b['daemon_cpu_pct_mean']:.1f} % "
                f"(median {a['daemon_cpu_pct_median']:.1f} -> {b['daemon_cpu_pct_median']:.1f}) "
                f"| {a['daemon_rss_mb_max']:.0f} -> {b['daemon_rss_mb_max']:.0f} MB |")

    lines = ["| writer | throughput without / with the watch | latency p50/p99 without -> with | daemon CPU "
             "(% of one core) without -> with | daemon RSS |", "|---|---|---|---|---|"]
    if "paced_with" in report:
        lines.append(row(f"{report['rate']}/s x {report['size']} B", report["paced_without"], report["paced_with"]))
    if "max_with" in report:
        lines.append(row("unpaced (64 in flight)", report["max_without"], report["max_with"]))
    if "replay_captured" in report:
        r = report["replay_captured"]
        lines.append(f"replay of the captured chain: {r['events_applied']} events, {r['events_per_s']:.0f} events/s, "
                     f"equal to live: {r['equal_to_live_at_reached_revision']}")
    if "replay_synthetic" in report:
        r = report["replay_synthetic"]
        lines.append(f"replay of {r['events']} synthetic events onto a full backup of {r['full_keys']} keys "
                     f"({r['full_bytes'] / 1e6:.1f} MB): {r['events_per_s']:.0f} events/s, full backup + events -> "
                     f"snapshot {r['total_restore_seconds']:.1f}s; etcd-agent restore --to newest --yes "
                     f"{r.get('cli_restore_seconds', float('nan')):.1f}s")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="role")
    wr = sub.add_parser("writer")
    wr.add_argument("--endpoint", required=True)
    wr.add_argument("--rate", type=int, default=500)
    wr.add_argument("--size", type=int, default=1024)
    wr.add_argument("--duration", type=float, default=60)
    wr.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--max-seconds", type=float, default=15)
    ap.add_argument("--events", type=int, default=100000)
    ap.add_argument("--full-keys", type=int, default=10000)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json")
    ap.add_argument("--encrypt", action="store_true", help="[backup] encrypt_to set: everything in age")
    ap.add_argument("--no-synthetic", action="store_true", help="skip part 2's synthetic chain")
    ap.add_argument("--batch-seconds", help="[backup.delta] batch_seconds (default: the product's, 1.0; 0 streams)")
    ap.add_argument("--lean", choices=("true", "false"),
                    help="[backup.delta] lean_checkpoints (default: the product's, true): what defragmenting each "
                         "checkpoint offline costs the daemon and the writer")
    args = ap.parse_args()
    if args.role == "writer":
        role_writer(args)
        return

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    logging.getLogger("etcd_agent").setLevel(logging.WARNING)
    work = tempfile.mkdtemp(prefix="bench-delta-", dir=args.dir)
    report: Dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
                              "rate": args.rate, "size": args.size, "duration": args.duration}

    def save() -> None:  # after every phase: a late failure keeps the earlier numbers
        if args.json:
            with open(args.json, "w") as fh:
                fh.write(json.dumps(report, indent=2) + "\n")

    identities = None
    backup = ""
    if args.encrypt:
        from etcd_agent import age

        secret, recipient = age.generate_identity()
        key_path = os.path.join(work, "backup-key.txt")
        with open(os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
            fh.write(secret + "\n")
        identities = age.load_identities(key_path)
        backup = f'encrypt_to = ["{recipient}"]\n'
    report["encrypted"] = bool(args.encrypt)
    # the product's defaults for the watch; off to begin with
    delta = {"enabled": "false", "close_seconds": "5.0", "idle_seconds": "60.0"}
    if args.batch_seconds is not None:
        delta["batch_seconds"] = str(float(args.batch_seconds))
    report["batch_seconds"] = float(args.batch_seconds) if args.batch_seconds is not None else "default"
    if args.lean is not None:
        delta["lean_checkpoints"] = args.lean
    report["lean_checkpoints"] = args.lean or "default"
    bed = make_bed(os.path.join(work, "c"), 1, delta=delta, backup=backup)
    c = bed.c
    try:
        bed.start("m1")
        wait_healthy(c.cfg, 1, 90)
        daemon_pid = bed.procs["m1"].pid
        etcd_pid = c.members[0].backend.pid()
        assert etcd_pid is not None
        endpoint = c.cfg.members[0].client_url
        rpc = EtcdRpc(endpoint, timeout=10.0)
        value = os.urandom(args.size)
        for i in range(0, args.full_keys, 100):
            rpc.txn([proto.op_put(b"full/%06d" % j, value) for j in range(i, min(i + 100, args.full_keys))])
        full = take_backup(c.cfg, member="m1")
        report["full_backup"] = {"keys": args.full_keys, "bytes": full.size, "revision": full.revision}

        log.info("paced %d/s x %d B for %.0fs, delta watch off", args.rate, args.size, args.duration)
        report["paced_without"] = capture_run(endpoint, daemon_pid, etcd_pid, args.duration, args.rate, args.size, 64)
        save()
        set_delta(c.config_path, True, daemon_pid)
        report["catch_up_seconds"] = wait_caught_up(c.cfg.backup.dir, rpc)
        log.info("paced, delta watch on (caught up in %.1fs)", report["catch_up_seconds"])
        report["paced_with"] = capture_run(endpoint, daemon_pid, etcd_pid, args.duration, args.rate, args.size, 64)
        wait_caught_up(c.cfg.backup.dir, rpc)
        report["paced_with"]["segments_bytes"] = sum(os.path.getsize(p) for p in list_segments(c.cfg.backup.dir))
        # the daemon's checkpoints in the chain (each a full backup it took during the paced run)
        report["paced_with"]["checkpoints_vouched"] = sum(
            len(ch.checkpoints) for ch in chains.scan(c.cfg.backup.dir).chains)
        save()
        log.info("unpaced %.0fs, with then without the watch", args.max_seconds)
        report["max_with"] = capture_run(endpoint, daemon_pid, etcd_pid, args.max_seconds, 0, args.size, 64)
        wait_caught_up(c.cfg.backup.dir, rpc)
        reached_live = rpc.header().revision
        set_delta(c.config_path, False, daemon_pid)
        poll(lambda: chains.active_base(c.cfg.backup.dir) is None, timeout=60, what="the watch to stop")
        report["max_without"] = capture_run(endpoint, daemon_pid, etcd_pid, args.max_seconds, 0, args.size, 64)
        save()

        log.info("replaying the captured chain")
        segs = list_segments(c.cfg.backup.dir)
        check = None
        if identities is not None:  # what a restore does: the chain opened into a private dir
            from etcd_agent.chain.check import check_chain
            from etcd_agent.chain.seal import open_sealed

            staging = tempfile.mkdtemp(prefix="open-", dir=work)
            t = time.monotonic()
            check = check_chain(segs, full.revision, opener=lambda p: open_sealed(p, identities, staging))
            report["open_chain_seconds"] = time.monotonic() - t
        res = replay(full.path, segs, Target.to_revision(reached_live), output=os.path.join(work, "captured.db"),
                     check=check, identities=identities)
        cap = res.to_json()
        cap["events_per_s"] = res.events_applied / res.replay_seconds if res.replay_seconds else None
        with scratch_etcd(res.snapshot_path) as s:
            got = {e.key: e.value for e in s.rpc.range(b"\0", b"\0").kvs}
        want = {e.key: e.value for e in rpc.range(b"\0", b"\0", revision=res.reached_revision).kvs}
        cap["equal_to_live_at_reached_revision"] = got == want
        report["replay_captured"] = {k: cap[k] for k in ("events_applied", "revisions_applied", "segments_applied",
                                                          "replay_seconds", "seconds", "events_per_s", "complete",
                                                          "equal_to_live_at_reached_revision")}
        save()
        if args.no_synthetic:
            finish(report, args)
            return

        log.info("synthetic chain of %d events after a fresh full backup", args.events)
        bed.stop()  # no daemon from here on: the chain below is the only one continuing full2
        c.members[0].backend.start()
        c.members[0].wait_healthy(60)
        rpc = EtcdRpc(endpoint, timeout=10.0)
        full2 = take_backup(c.cfg, member="m1")
        assert full2.revision is not None
        live_keys = rpc.range(b"\0", b"\0", count_only=True).count
        last = synthetic_chain(c.cfg.backup.dir, full2.revision, args.events, args.size,
                               int(time.time() * 1000) - 600_000, sign_key=keys.local_key(c.cfg).key)
        mine = [p for p in list_segments(c.cfg.backup.dir) if _base(p) == full2.revision]
        res = replay(full2.path, mine, Target.newest(), output=os.path.join(work, "syn.db"))
        report["replay_synthetic"] = {
            "events": res.events_applied, "revisions": res.revisions_applied, "segments": len(mine),
            "segment_bytes": sum(os.path.getsize(p) for p in mine), "reached_revision": res.reached_revision,
            "expected_revision": last, "replay_seconds": res.replay_seconds,
            "events_per_s": res.events_applied / res.replay_seconds,
            "revisions_per_s": res.revisions_applied / res.replay_seconds,
            "total_restore_seconds": res.seconds, "full_keys": live_keys, "full_bytes": full2.size,
        }
        save()
        log.info("etcd-agent restore --from %s --to newest --yes", os.path.basename(full2.path))
        t = time.monotonic()
        out = agent(c, "restore", "--from", os.path.basename(full2.path), "--to", "newest", "--yes", timeout=3600)
        report["replay_synthetic"]["cli_restore_seconds"] = time.monotonic() - t
        if out.returncode != 0:
            report["replay_synthetic"]["cli_restore_error"] = out.stderr[-2000:]
        save()
    finally:
        bed.stop()
        c.stop()
        shutil.rmtree(work, ignore_errors=True)
    finish(report, args)


def finish(report: Dict[str, Any], args: argparse.Namespace) -> None:
    report["machine"]["loadavg_end"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    print(text)
    sys.stderr.write(table(report) + "\n")


def _base(path: str) -> Optional[int]:
    from etcd_agent.chain.reader import read_header

    try:
        return read_header(path).base_revision
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    main()
