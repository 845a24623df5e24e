"""Benchmark: `etcd-agent backup` against the plain way, on a real etcd holding Kubernetes-like data.

One command. A one-member etcd of the harness's release (tests/harness/releases.py: 3.5.16, and
3.4.23 with --legacy) is started through the test harness and filled with Kubernetes-like protobuf
objects (tests/harness/kubedata.py: pods, events, secrets, configmaps ... under /registry/) up to
--size-mb of db. Then:

1. The compression study: the snapshot (saved once with etcdctl) compressed in this process by
   each candidate (zstd levels 1 and 3, in the agent's 4 MiB frames or not, and --fast=1 and 3;
   gzip levels 1 and 6):
   the ratio, and MB per CPU-second (what a backup pays for it, whatever the machine's load).
2. --rounds interleaved rounds, the order rotated each round so a noisy neighbour hits each way
   alike, of every way:
   - `etcdctl snapshot save` alone (the baseline), then `&& tar cf`, then `&& tar --zstd`
   - `etcd-agent backup` with compression "none", "zstd", and encrypt_to (age, one recipient)
   For each: wall time min / median / max, CPU (user + sys of the process tree, from wait4), the
   etcd server's CPU during the run, the peak RSS of the whole process tree (the sum over its
   processes, sampled every 10 ms) and the kernel's high-water mark of its largest process, and
   the output's size; then the ratios agent / `snapshot save`, compression ratio and MB/s.

The machine's load averages are printed with every round: on a shared machine compare ratios of
the same round set, not absolute seconds.

    .venv/bin/python bench/backup_bench.py [--size-mb 1200] [--rounds 5] [--legacy] [--dir /var/tmp]
                                           [--reuse DIR]   # keep the filled etcd there between runs
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
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.installed import byte_compile  # noqa: E402
from etcd_agent.age import generate_identity  # noqa: E402
from etcd_agent.errors import EtcdUnavailable  # noqa: E402
from etcd_agent.member.process import ProcessBackend  # noqa: E402
from tests.harness.kubedata import fill  # noqa: E402
from tests.harness.loopback import LoopbackCluster  # noqa: E402
from tests.harness.releases import DEFAULT, LEGACY, Release, release  # noqa: E402

MB = 1e6
FRAME = 4 << 20


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}"


# ---------------------------------------------------------------- measuring one way


@dataclass
class Run:
    wall: float
    cpu: float  # user + sys of the commands and their children
    server_cpu: float  # the etcd server's, meanwhile
    tree_rss: int  # peak of the sum of RSS over the process tree (sampled)
    hwm: int  # the kernel's peak RSS of the largest single process
    out: int  # bytes written


class TreeSampler:
    """Samples the RSS of a process and its descendants every 10 ms; keeps the peaks."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak_sum = 0
        self.peak_hwm = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                return
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                    with open(f"/proc/{p.pid}/status") as fh:
                        for line in fh:
                            if line.startswith("VmHWM:"):
                                self.peak_hwm = max(self.peak_hwm, int(line.split()[1]) * 1024)
                except (psutil.Error, OSError):
                    continue
            self.peak_sum = max(self.peak_sum, total)
            self._done.wait(0.01)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def run_commands(cmds: List[List[str]], etcd_pid: int, env: Dict[str, str], logdir: str) -> Tuple[Run, List[str]]:
    """Run ``cmds`` one after the other (as `a && b`); their stdouts, and what they cost."""
    server = psutil.Process(etcd_pid)
    s0 = server.cpu_times()
    t0 = time.monotonic()
    cpu, tree, hwm = 0.0, 0, 0
    outs: List[str] = []
    for i, argv in enumerate(cmds):
        out_path, err_path = os.path.join(logdir, f"{i}.out"), os.path.join(logdir, f"{i}.err")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
            sampler = TreeSampler(proc.pid)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            sampler.stop()
        cpu += usage.ru_utime + usage.ru_stime
        tree, hwm = max(tree, sampler.peak_sum), max(hwm, sampler.peak_hwm, usage.ru_maxrss * 1024)
        if proc.returncode != 0:
            with open(err_path, "rb") as fh:
                raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {fh.read()[-2000:].decode(errors='replace')}")
        with open(out_path, encoding="utf-8", errors="replace") as fh:
            outs.append(fh.read())
    wall = time.monotonic() - t0
    s1 = server.cpu_times()
    server_cpu = (s1.user - s0.user) + (s1.system - s0.system)
    return Run(wall, cpu, server_cpu, tree, hwm, 0), outs


# ---------------------------------------------------------------- the ways


@dataclass
class Way:
    label: str
    run: Callable[[], Run]
    runs: List[Run] = field(default_factory=list)
    kind: str = "plain"  # "baseline" | "plain" (the runbook's other steps) | "agent"


def agent_argv() -> List[str]:
    script = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
    return [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "etcd_agent.cli.main"]


def agent_config(c: LoopbackCluster, name: str, extra: str) -> str:
    """The cluster's agent.toml with [backup] in a dir of its own and ``extra`` settings."""
    with open(c.config_path, encoding="utf-8") as fh:
        text = fh.read()
    old = f'dir = "{c.dir}/backups"'
    if old not in text:
        raise SystemExit(f"{c.config_path}: no {old!r} to replace")
    path = os.path.join(c.dir, f"agent-{name}.toml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text.replace(old, f'dir = "{c.dir}/b-{name}"\n{extra}'))
    return path


def ways_for(c: LoopbackCluster, rel: Release, work: str, recipient: str) -> List[Way]:
    ep = c.cfg.members[0].client_url
    backend = c.members[0].backend
    assert isinstance(backend, ProcessBackend)
    pid = backend.pid()
    assert pid is not None
    env = {**os.environ, "ETCDCTL_API": "3"}
    snap = os.path.join(work, "etcd_snapshot.db")
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    save = [rel.etcdctl, f"--endpoints={ep}", "snapshot", "save", snap]

    def clean() -> None:
        for n in os.listdir(work):
            p = os.path.join(work, n)
            if os.path.isfile(p):
                os.unlink(p)

    def plain(then: Optional[List[str]], result: str) -> Callable[[], Run]:
        def go() -> Run:
            clean()
            os.sync()
            r, _ = run_commands([save] + ([then] if then else []), pid, env, logs)
            r.out = os.stat(os.path.join(work, result)).st_size
            clean()
            return r
        return go

    def agent(name: str, extra: str) -> Callable[[], Run]:
        cfg = agent_config(c, name, extra)

        def go() -> Run:
            os.sync()
            r, outs = run_commands([agent_argv() + ["-c", cfg, "--json", "backup"]], pid, env, logs)
            doc = json.loads(outs[0])
            r.out = int(doc["size"])
            os.unlink(doc["path"])
            return r
        return go

    tar = ["tar", "cf", os.path.join(work, "plain.tar"), "-C", work, "etcd_snapshot.db"]
    tzst = ["tar", "-I", "zstd -1", "-cf", os.path.join(work, "plain.tar.zst"), "-C", work, "etcd_snapshot.db"]
    return [
        Way("etcdctl snapshot save", plain(None, "etcd_snapshot.db"), kind="baseline"),
        Way("  && tar cf", plain(tar, "plain.tar")),
        Way("  && tar --zstd (zstd -1)", plain(tzst, "plain.tar.zst")),
        Way("etcd-agent backup", agent("none", ""), kind="agent"),
        Way("etcd-agent backup, zstd", agent("zstd", 'compression = "zstd"\n'), kind="agent"),
        Way("etcd-agent backup, encrypted", agent("age", f'encrypt_to = ["{recipient}"]\n'), kind="agent"),
    ]


# ---------------------------------------------------------------- the compression study


def study(snap: str) -> List[str]:
    """Each candidate over the saved snapshot, 1 MiB at a time (read from the page cache)."""
    import zstandard

    size = os.path.getsize(snap)
    with open(snap, "rb") as fh:  # into the page cache first: the first candidate must not pay the disk
        while fh.read(1 << 24):
            pass
    lines = [f"compression of the {size / MB:.0f} MB snapshot, in this process ({load()}):",
             f"  {'candidate':<30} {'ratio':>6} {'MB/CPU-s':>9} {'MB/s':>7}"]

    def measure(label: str, make: Callable[[], Callable[[bytes, bool], int]]) -> None:
        sink = make()
        t0, c0 = time.monotonic(), time.thread_time()
        out = 0
        with open(snap, "rb") as fh:
            while True:
                block = fh.read(1 << 20)
                if not block:
                    break
                out += sink(block, False)
        out += sink(b"", True)
        cpu, wall = time.thread_time() - c0, time.monotonic() - t0
        lines.append(f"  {label:<30} {size / out:6.2f} {size / MB / cpu:9.0f} {size / MB / wall:7.0f}")

    class Zstd:
        """zstd at ``level``, a new frame every ``frame`` bytes (0: one frame)."""

        def __init__(self, level: int, frame: int) -> None:
            self.cctx = zstandard.ZstdCompressor(level=level)
            self.obj = self.cctx.compressobj()
            self.frame, self.pending = frame, 0

        def __call__(self, block: bytes, last: bool) -> int:
            n = len(self.obj.compress(block))
            self.pending += len(block)
            if last or (self.frame and self.pending >= self.frame):
                n += len(self.obj.flush())
                self.obj, self.pending = self.cctx.compressobj(), 0
            return n

    def zstd(level: int, frame: int) -> Callable[[], Callable[[bytes, bool], int]]:
        return lambda: Zstd(level, frame)

    def gzip(level: int) -> Callable[[], Callable[[bytes, bool], int]]:
        def make() -> Callable[[bytes, bool], int]:
            z = zlib.compressobj(level, zlib.DEFLATED, 31)
            return lambda block, last: len(z.compress(block)) + (len(z.flush()) if last else 0)
        return make

    measure("zstd -1, 4 MiB frames (agent)", zstd(1, FRAME))
    measure("zstd -1, one frame", zstd(1, 0))
    for fast in (1, 3):  # zstd's negative levels (`zstd --fast=N`): less CPU, less ratio
        measure(f"zstd --fast={fast}, 4 MiB frames", zstd(-fast, FRAME))
    measure("zstd -3, 4 MiB frames", zstd(3, FRAME))
    measure("zstd -3, one frame", zstd(3, 0))
    measure("gzip -1", gzip(1))
    measure("gzip -6", gzip(6))
    return lines


# ---------------------------------------------------------------- one release


def prepared(base: str, version: str, size_mb: int, reuse: bool) -> LoopbackCluster:
    d = os.path.join(base, f"etcd-{version}")
    if reuse and os.path.exists(os.path.join(d, "filled")):
        c = LoopbackCluster.existing(d)
        c.start_existing()
        return c
    shutil.rmtree(d, ignore_errors=True)
    c = LoopbackCluster(d, 1, version=version)
    c.start_static()
    m = c.cfg.members[0]

    def db_size() -> int:
        # etcd busy with the fill's writes (and a loaded machine) can miss one status: look again
        for attempt in range(10):
            try:
                with c.client() as cl:
                    return cl.status(m.client_url, timeout=30).db_size
            except EtcdUnavailable:
                if attempt == 9:
                    raise
                time.sleep(1)
        raise AssertionError("unreachable")

    t0 = time.monotonic()
    written = fill(m.client_url, size_mb * 1_000_000, db_size=db_size, progress=lambda s: print(f"  {s}", flush=True))
    print(f"etcd {version}: filled with {written / MB:.0f} MB of Kubernetes-like keys and values, db "
          f"{db_size() / MB:.0f} MB, in {time.monotonic() - t0:.0f} s", flush=True)
    open(os.path.join(d, "filled"), "w").close()
    return c


def bench_release(c: LoopbackCluster, version: str, rounds: int, recipient: str, do_study: bool) -> List[str]:
    rel = release(version)
    work = tempfile.mkdtemp(prefix="work-", dir=c.dir)
    with c.client() as cl:
        db = cl.status(c.cfg.members[0].client_url).db_size
    report: List[str] = []
    try:
        ways = ways_for(c, rel, work, recipient)
        if do_study:
            snap = os.path.join(work, "study.db")
            subprocess.run([rel.etcdctl, f"--endpoints={c.cfg.members[0].client_url}", "snapshot", "save", snap],
                           check=True, capture_output=True, env={**os.environ, "ETCDCTL_API": "3"})
            report += study(snap)
            os.unlink(snap)
            print("\n".join(report), flush=True)
        for r in range(rounds):
            order = ways[r % len(ways):] + ways[:r % len(ways)]
            print(f"etcd {version} round {r + 1}/{rounds} ({load()})", flush=True)
            for w in order:
                run = w.run()
                w.runs.append(run)
                print(f"  {w.label:<30} {run.wall:6.2f} s  cpu {run.cpu:5.2f} s  etcd cpu {run.server_cpu:5.2f} s  "
                      f"peak rss {run.tree_rss / 2**20:5.1f} MiB (largest process {run.hwm / 2**20:5.1f})", flush=True)
        report += summary(ways, version, db, rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def summary(ways: List[Way], version: str, db: int, rounds: int) -> List[str]:
    base = next(w for w in ways if w.kind == "baseline")
    bmed, bmin = statistics.median(r.wall for r in base.runs), min(r.wall for r in base.runs)
    lines = [f"etcd {version}, db {db / MB:.0f} MB, {rounds} interleaved rounds ({load()} at the end):",
             f"  {'way':<30} {'wall s min / median / max':>25} {'x save':>7} {'cpu s':>6} {'etcd cpu':>8} "
             f"{'peak rss MiB':>12} {'largest':>7} {'out MB':>7} {'ratio':>6} {'MB/s':>5}"]
    for w in ways:
        walls = sorted(r.wall for r in w.runs)
        med = statistics.median(walls)
        lines.append(
            f"  {w.label:<30} {walls[0]:7.2f} / {med:6.2f} / {walls[-1]:6.2f} {med / bmed:6.2f}x "
            f"{statistics.median(r.cpu for r in w.runs):6.2f} {statistics.median(r.server_cpu for r in w.runs):8.2f} "
            f"{max(r.tree_rss for r in w.runs) / 2**20:12.1f} {max(r.hwm for r in w.runs) / 2**20:7.1f} "
            f"{w.runs[0].out / MB:7.0f} {db / w.runs[0].out:6.2f} {db / MB / med:5.0f}")
    for w in ways:
        if w.kind == "agent":
            lines.append(f"  ratio {w.label} / etcdctl snapshot save: median {statistics.median(r.wall for r in w.runs) / bmed:.3f}x,"
                         f" min {min(r.wall for r in w.runs) / bmin:.3f}x; per round "
                         + " ".join(f"{a.wall / b.wall:.2f}" for a, b in zip(w.runs, base.runs)))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1200, help="db size to fill etcd to (default 1200 MB)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--legacy", action="store_true", help=f"also etcd {LEGACY} (no etcdutl), after {DEFAULT}")
    ap.add_argument("--dir", default="/var/tmp", help="where the etcd data and the backups go")
    ap.add_argument("--reuse", metavar="DIR", help="keep the filled etcd in DIR and reuse it on the next run")
    ap.add_argument("--no-study", action="store_true", help="skip the compression study")
    args = ap.parse_args()
    byte_compile()
    base = args.reuse or tempfile.mkdtemp(prefix="etcd-agent-backup-bench-", dir=args.dir)
    os.makedirs(base, exist_ok=True)
    _secret, recipient = generate_identity()  # the secret is not needed: nothing is decrypted here
    print(f"backup bench in {base}, {os.cpu_count()} CPUs, {load()}", flush=True)
    report: List[str] = []
    clusters: List[LoopbackCluster] = []
    try:
        for version in [DEFAULT] + ([LEGACY] if args.legacy else []):
            c = prepared(base, version, args.size_mb, args.reuse is not None)
            clusters.append(c)
            report += bench_release(c, version, args.rounds, recipient, not args.no_study and version == DEFAULT)
            c.stop()
    finally:
        for c in clusters:
            c.stop()
        if args.reuse is None:
            shutil.rmtree(base, ignore_errors=True)
    print("\n" + "\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
