#!/usr/bin/env python3
"""Benchmark: a restore from the bucket alone against the download and the local restore it does.

A real S3 server (Ceph's radosgw, one node, ``tests/harness/rgw.py``) and a 3-member loopback
cluster (etcd 3.5.16) with ``[backup.remote]`` on it; ``--full-keys`` keys of ``--size`` bytes,
full backup B, a chain of ``--events`` events continuing it, everything copied to the bucket by
``etcd-agent backup push``. The chain (``--chain``):

- ``live`` (default): written as the product writes it, the daemon's supervisor (in this
  process) watching the cluster while a writer puts the events in (``bench/livechain.py``, as
  ``pitr_bench.py --chain live``), with the checkpoints it takes on its own, all pushed with the
  chain: what a restore from the bucket meets after a real disaster;
- ``synthetic``: segment files written straight (``delta_bench.synthetic_chain``, signed with the
  cluster's manifest key): no checkpoint, the replay of the whole chain.

Over the full backup's keys with ``--chain-keys updates`` (default). Then ``--rounds``
interleaved rounds (the order rotated each round) of:

- ``download``: boto3 ``download_file`` of B's object from the same server into a file (fsynced);
- ``local``: ``etcd-agent restore --from B --yes`` (B in the backup dir);
- ``bucket``: ``etcd-agent restore --from-bucket B --yes`` into an empty backup dir;
- ``local pitr``: ``restore --from B --to newest``; ``bucket pitr``: ``restore --from-bucket B
  --to newest`` into an empty backup dir.

Printed: each way's wall (min/median/max) and the issue's two figures (issue 33 item 8):
``bucket`` <= ``download`` + ``local`` + 2 s, and ``bucket pitr / bucket`` <= 1.5, with the same
for the local ways beside them, and the fetch leg of each bucket way (its JSON ``bucket.seconds``).

    .venv/bin/python bench/frombucket_bench.py [--rounds 3] [--full-keys 10000] [--size 1024]
        [--events 600000] [--chain-keys updates|new] [--chain live|synthetic] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from bench.delta_bench import synthetic_chain  # noqa: E402
from bench.installed import byte_compile  # noqa: E402
from bench.livechain import delta_config, live_chain, warm_up  # noqa: E402
from bench.pitr_bench import chain_keys, fill  # noqa: E402
from bench.restore_bench import Run, interleave  # noqa: E402
from etcd_agent.backup import keys  # noqa: E402
from etcd_agent.backup.service import take_backup  # noqa: E402
from etcd_agent.chain import chains as delta_chains  # noqa: E402
from etcd_agent.continuous.supervisor import DeltaSupervisor  # noqa: E402
from etcd_agent.etcd.rpc import EtcdRpc  # noqa: E402
from etcd_agent.fs import fsync_path  # noqa: E402
from tests.harness.loopback import LoopbackCluster  # noqa: E402
from tests.harness.rgw import RgwBed  # noqa: E402
from tests.integration.test_restore import AGENT, EXTRA  # noqa: E402


def remote_table(rgw: RgwBed, bucket: str) -> str:
    return (f'[backup.remote]\nenabled = true\nendpoint = "{rgw.endpoint}"\nbucket = "{bucket}"\n'
            f'access_key = "{rgw.access_key}"\nsecret_key = "{rgw.secret_key}"\naddressing_style = "path"\n'
            'prefix = "bench/"\nkeep_last = 100\n')


def timed_restore(argv: List[str]) -> Run:
    """An ``etcd-agent --json restore ...`` run: its wall, phases, and the fetch leg's seconds."""
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"restore failed (exit {p.returncode}): {' '.join(argv[3:])}\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout)
    phases = {k: float(v) for k, v in out["timings"].items()}
    if "bucket" in out:
        phases["fetch"] = float(out["bucket"]["seconds"])
        phases.update((f"fetch: {k}", float(v)) for k, v in out["bucket"].get("phases", {}).items())
        objs = out["bucket"]["objects"]
        phases["fetch: segments"] = float(sum(1 for o in objs if o["kind"] == "segment"))
        for kind in ("full", "checkpoint", "segment"):  # each kind's leg: from its first start to its last end
            legs = [(o["began"], o["began"] + o["seconds"]) for o in objs if o["kind"] == kind and "began" in o]
            if legs:
                phases[f"fetch: {kind} leg"] = max(e for _b, e in legs) - min(b for b, _e in legs)
                phases[f"fetch: {kind} ends at"] = max(e for _b, e in legs)
    return Run(wall, phases)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--full-keys", type=int, default=10_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--events", type=int, default=600_000)
    ap.add_argument("--chain-keys", choices=("new", "updates"), default="updates")
    ap.add_argument("--chain", choices=("live", "synthetic"), default="live")
    ap.add_argument("--checkpoint-min-seconds", type=float, default=10.0)
    ap.add_argument("--warmup-events", type=int, default=100_000)
    ap.add_argument("--compact-seconds", type=float, default=10.0)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json")
    a = ap.parse_args()
    byte_compile()
    work = tempfile.mkdtemp(prefix="frombucket-bench-", dir=a.dir)
    # the full backup, a 600,000-event chain (~630 MB) and its checkpoints (~65 MB each, ~20 of
    # them) pass 2 GiB: a full memstore blocks every write (the gateway then answers nothing)
    rgw = RgwBed(os.path.join(work, "rgw"), store_bytes=6 << 30).up()
    report: Dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
                              "full_keys": a.full_keys, "size": a.size, "events": a.events, "rounds": a.rounds,
                              "chain_mode": a.chain}
    c = None
    try:
        bucket = rgw.new_bucket()
        delta = delta_config(a.checkpoint_min_seconds) if a.chain == "live" else ""
        c = LoopbackCluster(os.path.join(work, "c"), 3, extra=delta + EXTRA + remote_table(rgw, bucket))
        c.start_static()
        rpc = EtcdRpc(c.cfg.members[0].client_url, timeout=30.0)
        filled = fill(rpc, a.full_keys, a.size)
        rpc.close()
        if a.chain == "live" and a.warmup_events:  # B is then a backup of a cluster that has been running
            warm_up(c.cfg, a.warmup_events, a.size, compact_seconds=a.compact_seconds, **chain_keys(a))
        # as the daemon takes it: `backup push` below copies it with its chain and checkpoints
        full = take_backup(c.cfg, member="m1", origin="daemon")
        assert full.revision is not None
        t = time.monotonic()
        if a.chain == "live":
            sup = DeltaSupervisor(lambda: (c.cfg, c.cfg.member("m1")))
            sup.start()
            try:
                got = live_chain(c.cfg, sup, full.revision, a.events, a.size, compact_seconds=a.compact_seconds,
                                 **chain_keys(a))
            finally:
                sup.stop()
            last = got["last_revision"]
            ch = next(x for x in delta_chains.scan(c.cfg.backup.dir).chains if x.base_revision == full.revision)
            report["chain"] = {"segments": ch.usable, "bytes": ch.bytes, "checkpoints": len(ch.checkpoints),
                               "events_after_newest_checkpoint": ch.replay_events}
            made = (f" ({ch.usable} segments, {ch.bytes / 1e6:.0f} MB; {len(ch.checkpoints)} checkpoint(s), "
                    f"{ch.replay_events} events after the newest)")
        else:
            extra: Dict[str, Any] = ({"key_format": b"full/%06d", "key_count": a.full_keys, "existing": filled}
                                     if a.chain_keys == "updates" else {})
            last = synthetic_chain(c.cfg.backup.dir, full.revision, a.events, a.size,
                                   int(time.time() * 1000) - 3_600_000, base_sha256=full.sha256,
                                   sign_key=keys.local_key(c.cfg).key, **extra)
            made = " (synthetic, no checkpoint)"
        print(f"full backup {os.path.basename(full.path)}: {full.size / 1e6:.1f} MB at revision {full.revision}; "
              f"a {a.chain} chain of {a.events} events to revision {last} in {time.monotonic() - t:.0f}s{made}",
              flush=True)
        t = time.monotonic()
        push = subprocess.run([AGENT, "-c", c.config_path, "backup", "push"], capture_output=True, text=True,
                              timeout=1800)
        if push.returncode != 0:
            raise SystemExit(f"backup push failed:\n{push.stdout}{push.stderr}")
        print(f"backup push: {time.monotonic() - t:.1f}s", flush=True)
        name = os.path.basename(full.path)
        key = next(o["Key"] for o in rgw.client().list_objects_v2(Bucket=bucket, Prefix="bench/")["Contents"]
                   if o["Key"].endswith("/" + name))
        directory = c.cfg.backup.dir
        local_copy = directory + ".bench-keep"

        def download() -> Run:
            dest = os.path.join(work, "download.tar")
            s3 = rgw.client()
            t0 = time.monotonic()
            s3.download_file(bucket, key, dest)
            fsync_path(dest)
            wall = time.monotonic() - t0
            os.unlink(dest)
            return Run(wall)

        def from_bucket(*more: str) -> Callable[[], Run]:
            def run() -> Run:  # the backup dir empty, as on a new master; the local one back after
                os.rename(directory, local_copy)
                try:
                    return timed_restore([AGENT, "-c", c.config_path, "--json", "restore", "--from-bucket", name,
                                          *more, "--yes"])
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
                    os.rename(local_copy, directory)
            return run

        def local(*more: str) -> Callable[[], Run]:
            return lambda: timed_restore([AGENT, "-c", c.config_path, "--json", "restore", "--from", full.path,
                                          *more, "--yes"])

        ways = {
            "download (boto3 download_file)": download,
            "local": local(),
            "bucket": from_bucket(),
            "local pitr": local("--to", "newest"),
            "bucket pitr": from_bucket("--to", "newest"),
        }
        runs = interleave(ways, a.rounds, between=lambda: None, check=lambda: None)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"\n== restore from the bucket, 3 members, {full.size / 1e6:.1f} MB full backup + {a.events} events "
              f"({a.rounds} rounds; load average now {load}, {os.cpu_count()} cpus)")
        print(f"{'wall s':<32} {'min':>7} {'median':>7} {'max':>7}   fetch leg (median)")
        med: Dict[str, float] = {}
        out: Dict[str, Any] = {}
        for n, rs in runs.items():
            w = [r.wall for r in rs]
            med[n] = statistics.median(w)
            fetch = [r.phases["fetch"] for r in rs if "fetch" in r.phases]
            print(f"{n:<32} {min(w):7.2f} {med[n]:7.2f} {max(w):7.2f}   "
                  + (f"{statistics.median(fetch):.2f}" if fetch else "-"))
            out[n] = {"walls": w, "phases": [r.phases for r in rs]}
        budget = med["download (boto3 download_file)"] + med["local"] + 2.0
        print(f"bucket {med['bucket']:.2f}s vs download + local + 2 s = {budget:.2f}s: "
              f"{'met' if med['bucket'] <= budget else 'NOT met'} (goal: bucket <= download + local + 2 s)")
        ratio = med["bucket pitr"] / med["bucket"]
        local_ratio = med["local pitr"] / med["local"]
        print(f"ratio bucket pitr / bucket: {ratio:.2f} (goal <= 1.5); local pitr / local beside it: {local_ratio:.2f}")
        report["ways"] = out
        report["figures"] = {"bucket_vs_budget": [med["bucket"], budget], "pitr_ratio": ratio,
                             "local_pitr_ratio": local_ratio}
        report["machine"]["loadavg_end"] = os.getloadavg()
        if a.json:
            with open(a.json, "w") as fh:
                fh.write(json.dumps(report, indent=2) + "\n")
    finally:
        if c is not None:
            c.stop()
        rgw.down()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
