"""Benchmark: `etcd-agent backup` vs the plain way (`etcdctl snapshot save` + `tar cf`).

Starts a throwaway etcd on free loopback ports, fills it with --size-mb of incompressible data
(batched 1 MiB puts from a few threads), then times both ways on the same data and prints the
times, the ratio and the agent's peak RSS (psutil sampling of the agent process every 10 ms).

``--encrypt`` adds a third way, the agent with ``[backup] encrypt_to`` (age, one recipient), and
runs ``--rounds`` interleaved rounds of all three (the order rotates each round, so a noisy
neighbour on a shared machine hits each way alike); it prints min and median of each, the
encrypted/plain ratio, and checks once that the age CLI (when installed) decrypts the snapshot.

    .venv/bin/python bench/backup_bench.py [--size-mb 1024] [--dir /var/tmp] [--encrypt --rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Tuple

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


def agent_config(base: str, curl: str, purl: str, name: str, extra: str = "") -> str:
    cfg = os.path.join(base, f"{name}.toml")
    with open(cfg, "w") as fh:
        fh.write(f'[cluster]\nname = "bench"\n\n[[member]]\nname = "bench"\nhost = "127.0.0.1"\n'
                 f'client_url = "{curl}"\npeer_url = "{purl}"\n\n[backup]\ndir = "{base}/{name}"\n{extra}'
                 f'\n[daemon]\nstate_dir = "{base}/{name}-state"\n')
    return cfg


def check_with_age_cli(archive: str, keyfile: str, work: str) -> str:
    """``tar x`` + ``age -d`` as the README's manual recovery: the decrypted snapshot's sha256."""
    age = shutil.which("age")
    if age is None:
        return "age CLI not installed: manual decryption not checked"
    subprocess.run(["tar", "xf", archive, "-C", work, "etcd_snapshot.db.age", "manifest.json"], check=True)
    with open(os.path.join(work, "manifest.json")) as fh:
        manifest = json.load(fh)
    out = os.path.join(work, "etcd_snapshot.db")
    subprocess.run([age, "-d", "-i", keyfile, "-o", out, os.path.join(work, "etcd_snapshot.db.age")], check=True)
    import hashlib

    h = hashlib.sha256()
    with open(out, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    for n in ("etcd_snapshot.db", "etcd_snapshot.db.age", "manifest.json"):
        os.unlink(os.path.join(work, n))
    ok = h.hexdigest() == manifest["encryption"]["plaintext_sha256"]
    return f"age -d of the archive's etcd_snapshot.db.age: sha256 {'= the manifest plaintext_sha256' if ok else 'DIFFERS'}"


def summary(label: str, xs: List[float]) -> str:
    return f"{label:<34} min {min(xs):6.2f} s  median {statistics.median(xs):6.2f} s  (n={len(xs)})"


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
    ap.add_argument("--encrypt", action="store_true", help="also the agent with [backup] encrypt_to (age), interleaved")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1; 5 or more with --encrypt)")
    args = ap.parse_args()
    if args.encrypt:
        return encrypted_bench(args)
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


def encrypted_bench(args: argparse.Namespace) -> int:
    """Interleaved rounds of plain agent backup, encrypted agent backup and etcdctl + tar."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from etcd_agent.age import generate_identity

    base = tempfile.mkdtemp(prefix="etcd-agent-bench-", dir=args.dir)
    proc = None
    try:
        proc, curl, purl = start_etcd(base)
        fill(curl, args.size_mb)
        size = db_size(curl)
        secret, recipient = generate_identity()
        keyfile = os.path.join(base, "key.txt")
        with open(os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
            fh.write(secret + "\n")
        cfgs = {"agent plain": agent_config(base, curl, purl, "plain"),
                "agent encrypted (age)": agent_config(base, curl, purl, "enc", f'encrypt_to = ["{recipient}"]\n')}
        times: Dict[str, List[float]] = {k: [] for k in (*cfgs, "etcdctl snapshot save + tar cf")}
        peaks: Dict[str, List[int]] = {k: [] for k in cfgs}
        plain_dir = os.path.join(base, "etcdctl")
        os.makedirs(plain_dir)
        ways = list(times)
        note = ""
        for r in range(args.rounds):
            order = ways[r % len(ways):] + ways[:r % len(ways)]
            for way in order:
                os.sync()
                if way in cfgs:
                    t, peak, out = run_agent(cfgs[way])
                    peaks[way].append(peak)
                    if way.startswith("agent encrypted") and not note:
                        note = check_with_age_cli(out["path"], keyfile, base)
                    os.unlink(out["path"])
                else:
                    t = run_plain(curl, plain_dir)
                    for n in os.listdir(plain_dir):
                        os.unlink(os.path.join(plain_dir, n))
                times[way].append(t)
                print(f"round {r + 1}: {way}: {t:.2f} s", flush=True)
        print(f"db size: {size / 1e9:.2f} GB; {args.rounds} interleaved rounds")
        for way, xs in times.items():
            rss = f"  peak RSS {max(peaks[way]) / 2**20:.1f} MiB" if way in peaks else ""
            print(summary(way, xs) + rss)
        plain, enc, tar = (times[w] for w in ways)
        print(f"ratio encrypted / plain (agent):   min {min(enc) / min(plain):.2f}x  median "
              f"{statistics.median(enc) / statistics.median(plain):.2f}x")
        print(f"ratio encrypted / etcdctl + tar:   min {min(enc) / min(tar):.2f}x  median "
              f"{statistics.median(enc) / statistics.median(tar):.2f}x")
        print(note)
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
