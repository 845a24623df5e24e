"""A restore drill on the namespace tier while a writer runs: what it costs the live cluster.

Three namespace hosts dr1..dr3 (10.213.13.11-13), each with its own ``/etc/etcd-agent/agent.toml``
(``ip netns exec`` binds ``/etc/netns/<ns>/etcd-agent`` over it) and backup, state and drill dirs
of its own; etcd 3.5.16 runs with the process backend inside each namespace. A writer in the root
namespace puts at a steady pace through the cluster's client URLs and times every put; the
operator's ``etcd-agent drill`` runs inside dr1, as it would on master 1. The drill's etcd lives
on dr1's loopback, as the etcd user, at nice 10 / ionice idle / GOMAXPROCS=1.

Figures (FIGURE lines): the drill's duration and steps, put latency p50/p99 before / during /
after it, the drill metrics before and after; a corrupted backup on dr2 failing with its reason.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, Iterator, List, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from etcd_agent.config import Config, load
from etcd_agent.etcd import proto
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.etcd.rpc import EtcdRpc
from tests.harness.netns import NetnsBed, NsHost

pytestmark = pytest.mark.multihost

PREFIX, SUBNET = "dr", "10.213.13"
B = "/opt/etcd/3.5.16"
AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
ETC_DIR = "/etc/etcd-agent"
AGENT_TOML = f"{ETC_DIR}/agent.toml"
KEYS = 60_000  # ~1 KiB each: a ~70 MB snapshot, a drill of a few seconds
RATE = 100.0  # writer puts per second
WINDOW = 5.0  # s of puts before and after the drill: the latency figures' baseline and recovery (500 puts each)
BED_LOCK = "/run/etcd-agent-testbed.lock"


@pytest.fixture(scope="module")
def bed_lock(pytestconfig: pytest.Config) -> Iterator[None]:
    """One heavy bed per machine: the lock the other heavy tiers take (tests/harness/bedlock.py
    where present, re-entrant in one session and held by the controller for xdist workers; else
    an flock of the same file), waited for with a deadline."""
    try:
        from tests.harness import bedlock  # type: ignore[attr-defined]
    except ImportError:
        bedlock = None
    if bedlock is not None:
        yield from bedlock.hold_for_session(pytestconfig)
        return
    fh = open(BED_LOCK, "a+")

    def give_up(signum: int, frame: object) -> None:
        raise TimeoutError(f"the test bed lock {BED_LOCK} was not free within an hour")

    old = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(3600)  # a blocking flock, queued with the other waiters, with a deadline
    try:
        fcntl.flock(fh, fcntl.LOCK_EX)
    except BaseException:
        fh.close()
        raise
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    try:
        yield
    finally:
        fh.close()


def agent_toml(work: str, hosts: List[NsHost], me: NsHost) -> str:
    lines = [
        "[cluster]", 'name = "dr"', 'token = "dr-token"', 'bootstrap = "static"',
        "[local]", f'name = "{me.name}"',
        "[etcd]", f'binary = "{B}/etcd"', f'etcdctl = "{B}/etcdctl"', f'etcdutl = "{B}/etcdutl"',
        'service_manager = "process"', 'user = "root"', 'group = "root"',
        f'data_dir = "{work}/data/{{name}}.etcd"', f'conf_file = "{work}/conf/{{name}}.conf"',
        f'unit_file = "{work}/conf/etcd.service"', f'run_dir = "{work}/run"', "start_timeout = 30.0",
        "[backup]", f'dir = "{work}/{me.name}/backups"',
        "[daemon]", f'state_dir = "{work}/{me.name}/state"',
        "[drill]", f'dir = "/var/tmp/etcd-agent-drill-dr/{me.name}"', 'user = "etcd"',
        f'metrics_file = "{work}/{me.name}/etcd_agent_drill.prom"', "timeout = 600",
    ]
    for h in hosts:
        lines += ["[[member]]", f'name = "{h.name}"', f'host = "{h.ip}"']
    return "\n".join(lines) + "\n"


class Bed:
    def __init__(self, net: NetnsBed, work: str) -> None:
        self.net = net
        self.work = work
        self.cfgs: Dict[str, Config] = {}

    def host(self, i: int) -> NsHost:
        return self.net.hosts[i]

    def agent(self, h: NsHost, *args: str, timeout: float = 600) -> "subprocess.CompletedProcess[str]":
        return subprocess.run(self.net.exec_argv(h, [AGENT, "-c", AGENT_TOML, *args]), capture_output=True,
                              text=True, timeout=timeout)

    def metrics(self, h: NsHost) -> Dict[str, float]:
        path = os.path.join(self.work, h.name, "etcd_agent_drill.prom")
        if not os.path.exists(path):
            return {}
        with open(path) as fh:
            return {s.name: s.value for f in text_string_to_metric_families(fh.read()) for s in f.samples
                    if not s.labels}


@pytest.fixture(scope="module")
def bed(bed_lock: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    if os.geteuid() != 0:
        pytest.fail("the namespace tier needs root (network namespaces)")
    made_etc = not os.path.exists(ETC_DIR)
    if made_etc:
        os.makedirs(ETC_DIR, mode=0o755)
    net = NetnsBed(3, prefix=PREFIX, subnet=SUBNET)
    work = str(tmp_path_factory.mktemp("dr"))
    try:
        net.up()
        b = Bed(net, work)
        for h in net.hosts:
            os.makedirs(os.path.join(h.etc_dir, "etcd-agent"), exist_ok=True)
            for sub in (f"{h.name}/backups", f"{h.name}/state"):
                os.makedirs(os.path.join(work, sub), mode=0o700, exist_ok=True)
            path = os.path.join(h.etc_dir, "etcd-agent", "agent.toml")
            with open(path, "w") as fh:
                fh.write(agent_toml(work, net.hosts, h))
            b.cfgs[h.name] = load(path)
        code = ("import sys\nfrom etcd_agent.config import load, with_local\nfrom etcd_agent.member.local import "
                "LocalMember\ncfg = with_local(load(sys.argv[1]), sys.argv[2])\n"
                "LocalMember(cfg, cfg.member(sys.argv[2])).start_static()\n")
        for h in net.hosts:
            net.run(h, [sys.executable, "-c", code, AGENT_TOML, h.name], timeout=60)
        cfg = b.cfgs["dr1"]
        with EtcdClient.from_config(cfg, timeout=2.0) as cl:
            deadline = time.monotonic() + 60
            while not all(cl.healthy(m.client_url, timeout=2.0)[0] for m in cfg.members):
                assert time.monotonic() < deadline, "the dr cluster did not become healthy"
                time.sleep(0.3)
        yield b
    finally:
        net.down()  # every process of the namespaces, by PID
        shutil.rmtree("/var/tmp/etcd-agent-drill-dr", ignore_errors=True)
        if made_etc:
            try:
                os.rmdir(ETC_DIR)
            except OSError:
                pass


def fill(cfg: Config, n: int) -> None:
    value = os.urandom(1000)
    with EtcdRpc(cfg.members[0].client_url, timeout=30.0) as r:
        for start in range(0, n, 100):
            r.txn([proto.op_put(b"/registry/pods/ns%02d/p%06d" % (i % 50, i), value) for i in range(start, min(n, start + 100))])


class Writer:
    """Puts at RATE per second through the cluster's endpoints; every latency kept with its time."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.samples: List[Tuple[float, float]] = []  # (monotonic start, seconds)
        self.errors: List[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)

    def _run(self) -> None:
        with EtcdClient.from_config(self.cfg, timeout=5.0) as cl:
            i = 0
            nxt = time.monotonic()
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    cl.put(f"/writer/{i % 1000:04d}", b"w" * 200)
                    self.samples.append((t, time.monotonic() - t))
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    self.errors.append(str(exc))
                i += 1
                nxt += 1.0 / RATE
                self._stop.wait(max(0.0, nxt - time.monotonic()))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def between(self, a: float, b: float) -> List[float]:
        return [d for t, d in self.samples if a <= t < b]


def pct(xs: List[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


def describe(xs: List[float]) -> str:
    return f"p50 {pct(xs, 0.50):.1f} ms, p99 {pct(xs, 0.99):.1f} ms, max {max(xs) * 1000:.1f} ms ({len(xs)} puts)"


def test_drill_while_a_writer_runs(bed: Bed) -> None:
    dr1 = bed.host(0)
    cfg = bed.cfgs["dr1"]
    t = time.monotonic()
    fill(cfg, KEYS)
    res = bed.agent(dr1, "--json", "backup")
    assert res.returncode == 0, res.stderr
    backup = json.loads(res.stdout)
    print(f"\nFIGURE netns drill: backup of {KEYS} keys, {backup['size'] / 1e6:.1f} MB, made in "
          f"{time.monotonic() - t:.1f}s (fill included)")
    before = bed.metrics(dr1)

    w = Writer(cfg)
    w.start()
    try:
        time.sleep(WINDOW)  # the baseline
        d0 = time.monotonic()
        drill = bed.agent(dr1, "--json", "drill")
        d1 = time.monotonic()
        time.sleep(WINDOW)
        a1 = time.monotonic()
    finally:
        w.stop()
    assert drill.returncode == 0, drill.stdout + drill.stderr
    rep = json.loads(drill.stdout)
    after = bed.metrics(dr1)

    base, during, post = w.between(d0 - WINDOW, d0), w.between(d0, d1), w.between(d1, a1)
    steps = ", ".join(f"{st['step']} {st['seconds']:.2f}s" for st in rep["steps"])
    print(f"FIGURE netns drill: {rep['backup']} drilled on dr1 in {rep['duration']:.2f}s (wall {d1 - d0:.2f}s with "
          f"the CLI's start): {rep['keys']} keys, revision {rep['revision']}, {rep['sample']} sampled, etcd "
          f"{rep['etcd_version']} as {rep['run_as']}; {steps}")
    print(f"FIGURE netns put latency before the drill: {describe(base)}")
    print(f"FIGURE netns put latency during the drill: {describe(during)}")
    print(f"FIGURE netns put latency after the drill:  {describe(post)}")
    keys = ("etcd_agent_restore_drill_last_success_timestamp_seconds", "etcd_agent_restore_drill_last_duration_seconds",
            "etcd_agent_restore_drill_runs_total", "etcd_agent_restore_drill_failures_total",
            "etcd_agent_restore_drill_last_result")
    short = len("etcd_agent_restore_drill_")
    print("FIGURE netns drill metrics before: " + (", ".join(f"{k[short:]}={before[k]:g}" for k in keys if k in before)
                                                   or "none: no drill has run on dr1, its textfile does not exist"))
    print("FIGURE netns drill metrics after:  " + ", ".join(f"{k[short:]}={after[k]:g}" for k in keys if k in after))
    print(f"FIGURE netns machine load average (1/5/15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
          " on 2 cores shared with other sessions")
    assert rep["ok"] and rep["run_as"] == "etcd" and rep["keys"] >= KEYS
    assert after["etcd_agent_restore_drill_last_result"] == 1.0
    assert after["etcd_agent_restore_drill_runs_total"] == before.get("etcd_agent_restore_drill_runs_total", 0) + 1
    assert after["etcd_agent_restore_drill_last_success_timestamp_seconds"] > time.time() - 300
    # the live cluster kept taking writes throughout: no error, and the pace held within a factor of two
    assert w.errors == []
    assert len(during) >= 0.5 * RATE * (d1 - d0), (len(during), d1 - d0)
    # the drill left nothing on dr1: no etcd in its dir, no dir but the lock file
    assert os.listdir("/var/tmp/etcd-agent-drill-dr/dr1") == [".drill.lock"]


def test_a_corrupted_backup_on_dr2_fails_and_says_why(bed: Bed) -> None:
    dr2 = bed.host(1)
    res = bed.agent(dr2, "--json", "backup")
    assert res.returncode == 0, res.stderr
    path = json.loads(res.stdout)["path"]
    with open(path, "r+b") as fh:  # a lost 4 KiB page in the middle of the snapshot, as a bad disk sector
        fh.seek(os.path.getsize(path) // 2 // 4096 * 4096)
        fh.write(b"\0" * 4096)
    before = bed.metrics(dr2)
    drill = bed.agent(dr2, "drill")
    after = bed.metrics(dr2)
    head = drill.stdout.splitlines()[0] if drill.stdout else drill.stderr
    print(f"\nFIGURE netns corrupt backup on dr2 (exit {drill.returncode}): {head}")
    print(f"FIGURE netns corrupt backup metrics: failures_total {before.get('etcd_agent_restore_drill_failures_total', 0):g}"
          f" -> {after['etcd_agent_restore_drill_failures_total']:g}, last_result -> "
          f"{after['etcd_agent_restore_drill_last_result']:g}")
    assert drill.returncode == 1
    assert "FAILED" in head and "while reading the archive: the archive is bad: etcd_snapshot.db:" in head
    assert after["etcd_agent_restore_drill_failures_total"] == before.get("etcd_agent_restore_drill_failures_total", 0) + 1
    assert after["etcd_agent_restore_drill_last_result"] == 0.0
    assert "etcd_agent_restore_drill_last_failure_timestamp_seconds" in after
