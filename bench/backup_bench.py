"""Benchmark: `etcd-agent backup` vs the plain way (`etcdctl snapshot save` + `tar cf`).

Starts a throwaway etcd on free loopback ports, fills it with --size-mb of incompressible data
(batched 1 MiB puts from a few threads), then times both ways on the same data and prints the
times, the ratio and the agent's peak RSS (psutil sampling of the agent process every 10 ms).

    .venv/bin/python bench/backup_bench.py [--size-mb 1024] [--dir /var/tmp]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Tuple

import psutil

ETCD, ETCDCTL = "/usr/bin/etcd", "/usr/bin/etcdctl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_etcd(base: str) -> Tuple[subprocess.Popen, str, str]:
    cport, pport = free_port(), free_port()
    curl, purl = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
    log = open(os.path.join(base, "etcd.log"), "wb")
    proc = subprocess.Popen(
        [ETCD, "--name=bench", f"--data-dir={base}/bench.etcd", f"--listen-client-urls={curl}",
         f"--advertise-client-urls={curl}", f"--listen-peer-urls={purl}", f"--initial-advertise-peer-urls={purl}",
         f"--initial-cluster=bench={purl}", "--quota-backend-bytes=8589934592", "--snapshot-count=100000"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    for _ in range(100):
        if subprocess.run([ETCDCTL, f"--endpoints={curl}", "endpoint", "health"], capture_output=True).returncode == 0:
            return proc, curl, purl
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("etcd did not start")


def fill(curl: str, size_mb: int) -> None:
    import etcd3  # the bench may use the client directly; the agent's code goes through etcd/client.py

    host, port = curl.rsplit("//", 1)[1].split(":")
    started = time.monotonic()

    def worker(idx: List[int]) -> None:
        c = etcd3.client(host=host, port=int(port))
        for i in idx:
            c.put(f"/bench/{i:08d}", os.urandom(1 << 20))
        c.close()

    n = size_mb
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(worker, [list(range(k, n, 4)) for k in range(4)]))
    print(f"filled {n} MiB in {time.monotonic() - started:.1f}s", flush=True)


def db_size(curl: str) -> int:
    r = subprocess.run([ETCDCTL, f"--endpoints={curl}", "endpoint", "status", "-w", "json"], capture_output=True, check=True)
    return int(json.loads(r.stdout)[0]["Status"]["dbSize"])


def run_agent(cfg: str) -> Tuple[float, int, dict]:
    agent = [sys.executable, "-m", "etcd_agent.cli.main", "-c", cfg, "--json", "backup", "--no-prune"]
    peak = 0
    done = threading.Event()
    t0 = time.monotonic()
    proc = subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            try:
                peak = max(peak, ps.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.01)

    th = threading.Thread(target=sample)
    th.start()
    out, err = proc.communicate()
    elapsed = time.monotonic() - t0
    done.set()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"agent backup failed ({proc.returncode}): {err}")
    return elapsed, peak, json.loads(out)


def run_plain(curl: str, work: str) -> float:
    t0 = time.monotonic()
    snap = os.path.join(work, "etcd_snapshot.db")
    subprocess.run([ETCDCTL, f"--endpoints={curl}", "snapshot", "save", snap], check=True, capture_output=True)
    subprocess.run(["tar", "cf", os.path.join(work, "plain.tar"), "-C", work, "etcd_snapshot.db"], check=True)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="data to put into etcd (default 1024 MiB)")
    ap.add_argument("--dir", default="/var/tmp", help="where the throwaway etcd and the backups go")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="etcd-agent-bench-", dir=args.dir)
    proc = None
    try:
        proc, curl, purl = start_etcd(base)
        fill(curl, args.size_mb)
        size = db_size(curl)
        cfg = os.path.join(base, "agent.toml")
        with open(cfg, "w") as fh:
            fh.write(f'[cluster]\nname = "bench"\n\n[[member]]\nname = "bench"\nhost = "127.0.0.1"\n'
                     f'client_url = "{curl}"\npeer_url = "{purl}"\n\n[backup]\ndir = "{base}/agent"\n')
        plain_dir = os.path.join(base, "plain")
        os.makedirs(plain_dir)
        os.sync()
        agent_s, peak, out = run_agent(cfg)
        os.sync()
        plain_s = run_plain(curl, plain_dir)
        print(f"db size:                         {size / 1e9:.2f} GB")
        print(f"etcd-agent backup:               {agent_s:.2f} s  ({out['size'] / 1e9:.2f} GB archive, revision {out['revision']})")
        print(f"etcdctl snapshot save + tar cf:  {plain_s:.2f} s")
        print(f"ratio agent / plain:             {agent_s / plain_s:.2f}x  (goal <= 0.90x)")
        print(f"agent peak RSS:                  {peak / 2**20:.1f} MiB  (goal <= 80 MiB)")
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
