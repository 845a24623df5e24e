"""Benchmark: the agent's copies to and from the bucket against boto3 and curl, same server, same object.

A real S3 server (Ceph RGW on one node, tests/harness/rgw.py; its memstore raised to 4 GiB so a
1 GiB source object and an upload in flight fit) is started and stopped here, or an existing one
reused (``--env DIR/s3.env`` as rgw_up.sh writes it). One file of random bytes (archives of
snapshots barely shrink and are never re-compressed on the way) is uploaded once as the source
object. Then --rounds interleaved rounds, the order rotated each round so a noisy neighbour hits
each way alike, of every way, each in a child process of its own (its peak RSS: the kernel's VmHWM of it):

- upload, boto3: ``upload_file`` with boto3's defaults (8 MiB parts, 10 threads, CRC32);
- upload, agent: ``bucket.remote.upload_file`` as the copier calls it for a fresh backup: one read,
  every part with its Content-MD5, verified after (``verify = "auto"``: the ETag on RGW), then the
  sha256 metadata set by a copy of the object onto itself; ``agent+sha``: the same with the file's
  sha256 already known (named when the upload begins: no copy);
- download, curl: ``curl`` of a presigned URL, then an fsync of the file;
- download, boto3: ``download_file`` (no fsync, no check);
- download, agent: ``bucket.fetch.fetch_one`` (HEAD, stream into the staging part, sha256 checked
  against the metadata, fsynced, linked into the backup dir), the path ``backup fetch`` and the
  restore from the bucket take.

Each timing runs from the request's start to its end (imports and client set-up excluded, for
curl too: the presign is made before). Printed: MB/s per way per round, the medians, the ratios
the issues ask for (upload agent/boto3 >= 0.9; download agent/(curl + fsync) >= 0.8, agent/boto3
>= 0.9), peak RSS per way (<= 128 MB), and the load averages with every round.

    .venv/bin/python bench/bucket_bench.py [--size-mib 1024] [--rounds 3] [--dir /var/tmp/bucket-bench]
                                           [--env DIR/s3.env] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from etcd_agent.config import Config, parse_text  # noqa: E402
from etcd_agent.fs import fsync_path  # noqa: E402

MB = 1e6
MiB = 1024 * 1024
NAME = "etcd-2026-03-01-10-00-00.tar"
KEY = "ab" * 32  # the chain key the source object sits under (bucket/layout)
UPLOADS = ("up-boto3", "up-agent", "up-agent+sha")
DOWNLOADS = ("down-curl+fsync", "down-boto3", "down-agent")
LIMIT_RSS = 128 * MB


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclasses.dataclass(frozen=True)
class Server:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str

    def config(self, backup_dir: str) -> Config:
        c, errors = parse_text(f"""
[cluster]
name = "bench"
[[member]]
host = "127.0.0.1"
name = "m1"
[backup.remote]
bucket = "{self.bucket}"
endpoint = "{self.endpoint}"
prefix = "bench/"
addressing_style = "path"
access_key = "{self.access_key}"
secret_key = "{self.secret_key}"
enabled = true
[backup]
dir = "{backup_dir}"
""")
        if errors or c is None:
            raise SystemExit(f"bench config: {errors}")
        return c

    def client(self) -> Any:
        import boto3
        from botocore.config import Config as BotoConfig

        return boto3.session.Session(aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key) \
            .client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                    config=BotoConfig(s3={"addressing_style": "path"}))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


# ---------------------------------------------------------------- one way, in a child process


def child(way: str, server: Server, src: str, work: str) -> Dict[str, float]:
    """Run one way here (a fresh process); returns its seconds and CPU seconds."""
    from etcd_agent.bucket import fetch, layout, remote
    from etcd_agent.bucket.client import Bucket

    cfg = server.config(os.path.join(work, "backups"))
    s3 = server.client()
    b = Bucket(cfg)
    from etcd_agent.bucket.client import choose_check

    choose_check(b)  # the probe, once per process as in the daemon: not part of a copy
    sha = ""
    if way == "up-agent+sha":
        with open(os.path.join(work, "src.sha256")) as fh:
            sha = fh.read().strip()
    t0, c0 = time.perf_counter(), os.times()
    if way == "up-boto3":
        s3.upload_file(src, server.bucket, "bench/boto3-upload")
    elif way in ("up-agent", "up-agent+sha"):
        remote.upload_file(cfg, src, "agent-upload", sha256=sha or None)
    elif way == "down-boto3":
        s3.download_file(server.bucket, f"bench/{layout.full_name(KEY, NAME)}", os.path.join(work, "boto3.bin"))
    elif way == "down-agent":
        os.makedirs(cfg.backup.dir, mode=0o700, exist_ok=True)
        with fetch.staging_locked(cfg.backup.dir):
            fetch.fetch_one(b, fetch.Wanted(layout.full_name(KEY, NAME), NAME, layout.FULL, 0), cfg.backup.dir)
    else:
        raise SystemExit(f"unknown way {way}")
    c1 = os.times()
    return {"seconds": time.perf_counter() - t0, "cpu": c1.user + c1.system - c0.user - c0.system, "rss": vmhwm()}


def vmhwm() -> float:
    """This process's peak RSS (the kernel's high-water mark of its image: fresh at exec, unlike
    wait4's ru_maxrss, which counts the parent's pages the child had before its exec)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    return 0.0


def run_way(way: str, server: Server, src: str, work: str) -> Dict[str, float]:
    """One way in a child process: its timing, and its peak RSS (``vmhwm``)."""
    if way == "down-curl+fsync":
        url = server.client().generate_presigned_url(
            "get_object", Params={"Bucket": server.bucket, "Key": f"bench/chains/{KEY}/{NAME}"}, ExpiresIn=3600)
        out = os.path.join(work, "curl.bin")
        t0 = time.perf_counter()
        proc = subprocess.Popen(["curl", "-sSf", "-o", out, url])
        _pid, status, usage = os.wait4(proc.pid, 0)
        if status != 0:
            raise SystemExit(f"curl failed: {status}")
        fsync_path(out)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "cpu": usage.ru_utime + usage.ru_stime, "rss": 0.0}  # not the agent's
    argv = [sys.executable, os.path.abspath(__file__), "--child", way, "--src", src, "--dir", work]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # the keys on stdin, not in ps
    output, _ = proc.communicate(server.to_json().encode())
    if proc.returncode != 0:
        raise SystemExit(f"{way} failed (exit {proc.returncode})")
    result: Dict[str, float] = json.loads(output)
    return result


def clean_after(way: str, server: Server, work: str, bed: Optional[Any]) -> None:
    """What a way left, removed: the downloaded file (and its page cache), the uploaded object
    (and its space in the OSD, which holds every byte in RAM: RGW's garbage collector run now
    on our own bed, waited for on a reused one)."""
    s3 = server.client()
    if way.startswith("up-"):
        s3.delete_object(Bucket=server.bucket, Key="bench/boto3-upload" if way == "up-boto3" else "bench/agent-upload")
        collect_garbage(bed)
    for f in ("curl.bin", "boto3.bin"):
        with_path = os.path.join(work, f)
        if os.path.exists(with_path):
            os.unlink(with_path)
    shutil.rmtree(os.path.join(work, "backups"), ignore_errors=True)
    for _ in range(3):  # the page cache holds what was written: flushed, so the next way starts alike
        os.sync()


# ---------------------------------------------------------------- setting up


def collect_garbage(bed: Optional[Any]) -> None:
    if bed is None:
        time.sleep(20)  # rgw_gc_obj_min_wait and its processor period on the harness's beds
        return
    subprocess.run(["/usr/bin/radosgw-admin", "-c", bed.conf, "gc", "process", "--include-all"], check=True,
                   capture_output=True, timeout=120)


def make_source(path: str, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as fh:
        left = size
        while left > 0:
            block = os.urandom(min(8 * MiB, left))
            h.update(block)
            fh.write(block)
            left -= len(block)
    return h.hexdigest()


def start_bed(work: str) -> Any:
    from tests.harness import rgw

    # the OSD keeps every byte in RAM: the source object, an upload and one pending GC fit in 4 GiB
    # (the bed's 2 GiB default fills, and a full Ceph hangs the GC between ways)
    bed = rgw.RgwBed(os.path.join(work, "rgw"), store_bytes=4 << 30)
    bed.up()
    return bed


def server_from_env(path: str, bucket: str) -> Server:
    env: Dict[str, str] = {}
    with open(path) as fh:
        for line in fh:
            k, _, v = line.strip().partition("=")
            env[k] = v
    return Server(env["S3_ENDPOINT"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], bucket)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp/bucket-bench")
    ap.add_argument("--env", help="reuse a running RGW: the s3.env rgw_up.sh wrote")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON document too")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, Server(**json.loads(sys.stdin.read())), args.src, args.dir)))
        return 0

    work = os.path.abspath(args.dir)
    if os.path.exists(work):
        raise SystemExit(f"{work} exists: give a new --dir (it is removed afterwards)")
    os.makedirs(work)
    bed: Optional[Any] = None
    try:
        bucket = f"bench-{os.getpid()}"
        if args.env:
            server = server_from_env(args.env, bucket)
        else:
            bed = start_bed(work)
            server = Server(bed.endpoint, bed.access_key, bed.secret_key, bucket)
        server.client().create_bucket(Bucket=bucket)
        size = args.size_mib * MiB
        src = os.path.join(work, "src.bin")
        sha = make_source(src, size)
        with open(os.path.join(work, "src.sha256"), "w") as fh:
            fh.write(sha)
        from etcd_agent.bucket import layout, remote

        cfg = server.config(os.path.join(work, "backups"))
        remote.upload_file(cfg, src, layout.full_name(KEY, NAME), sha256=sha)  # the object downloads read
        print(f"{args.size_mib} MiB, {args.rounds} rounds, {os.cpu_count()} CPUs; server {server.endpoint}; "
              f"load {load()}", flush=True)
        ways = list(UPLOADS + DOWNLOADS)
        results: Dict[str, List[Dict[str, float]]] = {w: [] for w in ways}
        loads: List[str] = []
        for r in range(args.rounds):
            order = ways[r % len(ways):] + ways[:r % len(ways)]
            line = []
            for way in order:
                res = run_way(way, server, src, work)
                clean_after(way, server, work, bed)
                results[way].append(res)
                line.append(f"{way} {size / res['seconds'] / MB:.0f}")
            loads.append(load())
            print(f"round {r + 1}: MB/s " + ", ".join(line) + f"; load {loads[-1]}", flush=True)
        report = summarize(results, size)
        report["loads"] = loads
        if args.json:
            print(json.dumps(report, indent=1))
        s3 = server.client()
        s3.delete_object(Bucket=bucket, Key=f"bench/{layout.full_name(KEY, NAME)}")
        s3.delete_bucket(Bucket=bucket)
        return 0
    finally:
        if bed is not None:
            bed.down()
        shutil.rmtree(work, ignore_errors=True)


def summarize(results: Dict[str, List[Dict[str, float]]], size: int) -> Dict[str, Any]:
    med = {w: statistics.median(x["seconds"] for x in rs) for w, rs in results.items()}
    rate = {w: size / s / MB for w, s in med.items()}
    rss = {w: max(x["rss"] for x in rs) for w, rs in results.items()}
    cpu = {w: statistics.median(x["cpu"] for x in rs) for w, rs in results.items()}
    print()
    print(f"{'way':<18}{'median s':>10}{'MB/s':>8}{'CPU s':>8}{'peak RSS MB':>13}")
    for w in results:
        print(f"{w:<18}{med[w]:>10.2f}{rate[w]:>8.0f}{cpu[w]:>8.2f}{rss[w] / MB:>13.0f}")
    checks: List[Tuple[str, float, float]] = [
        ("upload agent / boto3 upload_file", rate["up-agent"] / rate["up-boto3"], 0.9),
        ("upload agent+sha / boto3 upload_file", rate["up-agent+sha"] / rate["up-boto3"], 0.9),
        ("download agent / curl + fsync", rate["down-agent"] / rate["down-curl+fsync"], 0.8),
        ("download agent / boto3 download_file", rate["down-agent"] / rate["down-boto3"], 0.9),
    ]
    print()
    for what, got, want in checks:
        print(f"{what:<40}{got:>6.2f}x  (wanted >= {want}x) {'ok' if got >= want else 'SHORT'}")
    for w in ("up-agent", "up-agent+sha", "down-agent"):
        print(f"peak RSS {w:<31}{rss[w] / MB:>6.0f} MB (wanted <= {LIMIT_RSS / MB:.0f}) "
              f"{'ok' if rss[w] <= LIMIT_RSS else 'OVER'}")
    return {"median_seconds": med, "mb_per_s": rate, "cpu_seconds": cpu, "peak_rss_bytes": rss,
            "ratios": {what: got for what, got, _ in checks}, "rounds": results}


if __name__ == "__main__":
    sys.exit(main())
