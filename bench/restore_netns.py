"""The namespace tier of bench/restore_bench.py: three hosts fc1..fc3 (10.213.12.11-13) with sshd.

Built by tests/harness/restorebed.py like the restore tests over SSH (each host its own agent.toml through
/etc/netns, the process backend, etcd 3.5.16 with etcdutl), under the machine-wide bed lock. The
agent runs on fc1 (fc1 through LocalHost, fc2/fc3 over SSH, known_hosts enforced). By hand is
what an operator on fc1 does: per host stop etcd, ``mv`` the data dir aside, ``etcdutl snapshot
restore``, start etcd - fc1 in a local shell, fc2/fc3 through one OpenSSH command each that also
carries the snapshot on stdin (the least an operator can do over SSH); serially, and on all
three hosts at once. Then every member is polled healthy from outside, every 50 ms. By hand
starts from the snapshot already extracted, while the agent is given the backup: the runbook's
first step, `tar -xf` of the snapshot on fc1, is timed on its own before each by-hand run and
reported beside it, never inside its wall.

Around every timed run a writer puts one key every 20 ms (1 s timeout each) from outside the bed:
the longest span without an acknowledged write is the run's downtime as a client sees it. The
agent also reports its own fence -> unfence. Once, untimed: one node's `snapshot restore` plus
one etcd start until healthy (the floor any restore pays), and `scp` of the snapshot to the two
other hosts at once (the wire the agent's ship is compared with).

``--value-bytes`` sets the size of every value: ``--keys 1000 --value-bytes 1048576`` is a 1 GiB
db. Values are Kubernetes-like text (object-shaped JSON with random names and a random hex payload
of a quarter of the value), so in-transit compression has what real data gives it, not more.
"""
from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

import psutil

from bench.restore_bench import (
    Run,
    agent_run,
    extract_snapshot,
    interleave,
    new_token,
    report,
    restore_argv,
    wait_all_healthy,
)
from etcd_agent.config import Config
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.member.process import ProcessBackend
from etcd_agent.proctime import start_ticks
from etcd_agent.topology import parse_conf
from tests.harness import bedlock
from tests.harness.netns import NetnsBed, NsHost
from tests.harness.releases import DEFAULT, release
from tests.harness.restorebed import AGENT, AGENT_TOML, ETC_DIR, RestoreBed, build, counts

PREFIX, SUBNET = "fc", "10.213.12"


TAR_XF = "tar xf (not in wall)"


def _host_script(cfg: Config, name: str, pid: int, snap: str, token: str, receive: bool) -> str:
    """One host's runbook as the shell lines an operator types (every value quoted)."""
    dd = cfg.data_dir(name)
    env = ["env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"] + [
        f"{k}={v}" for k, v in parse_conf(open(cfg.conf_file(name), encoding="utf-8").read()).items() if k.startswith("ETCD_")
    ]
    pidf = os.path.join(cfg.etcd.run_dir, f"{name}.by-hand-pid")
    log = os.path.join(cfg.etcd.run_dir, f"{name}.log")
    lines = ["set -e"]
    if receive:
        lines.append(f"cat > {shlex.quote(snap)}")
    lines += [
        f"kill -TERM {pid}",
        # etcd's parent may be gone (a zombie of a non-reaping init counts as stopped)
        f"while s=$(cut -d' ' -f3 /proc/{pid}/stat 2>/dev/null) && [ \"$s\" != Z ]; do sleep 0.05; done",
        shlex.join(["mv", dd, f"{dd}.by-hand-{time.time():.3f}"]),
        shlex.join(restore_argv(cfg, cfg.etcd.etcdutl or cfg.etcd.etcdctl, snap, name, dd, token)) + " >/dev/null",
        "setsid sh -c 'echo $$ > \"$0\"; exec \"$@\"' " + shlex.join([pidf, *env, cfg.etcd.binary])
        + f" >>{shlex.quote(log)} 2>&1 </dev/null &",
    ]
    return "\n".join(lines) + "\n"


def kube_value(i: int, size: int, rng: random.Random) -> bytes:
    """An object-shaped value of ``size`` bytes: repeated field names (what compresses in real
    apiserver data) around random names and a random hex payload of a quarter of the size."""
    head = (f'{{"apiVersion":"v1","kind":"ConfigMap","metadata":{{"name":"cm-{i:06d}-{rng.getrandbits(32):08x}",'
            f'"namespace":"ns-{i % 37}","uid":"{rng.getrandbits(128):032x}","resourceVersion":"{i}",'
            f'"labels":{{"app":"bench","tier":"t{i % 5}"}}}},"data":{{')
    out = [head]
    n = len(head)
    payload = rng.randbytes(size // 8).hex()
    out.append(f'"payload":"{payload}"')
    n += len(out[-1])
    j = 0
    while n < size - 2:
        piece = f',"key-{j:04d}":"value-{j % 97:02d}-{i % 13:02d}-bench-config-line"'
        out.append(piece)
        n += len(piece)
        j += 1
    out.append("}}")
    return "".join(out).encode()[:size] if size >= 64 else b"x" * size


def fill(cfg: Config, prefix: str, n: int, size: int, workers: int = 4) -> None:
    """``n`` keys of ``size``-byte values, ``workers`` clients at once."""
    def chunk(k: int) -> None:
        rng = random.Random(k)
        with EtcdClient.from_config(cfg, timeout=30.0) as cl:
            for i in range(k, n, workers):
                cl.put(f"{prefix}{i:06d}", kube_value(i, size, rng) if size >= 64 else b"x" * size)

    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(chunk, range(workers)))


class Writer:
    """One put every 20 ms (1 s timeout) while a run goes on; the longest span between two
    acknowledged writes is the downtime a client saw."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.acked: List[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        cl: Optional[EtcdClient] = None
        while not self.stop.is_set():
            try:
                if cl is None:
                    cl = EtcdClient.from_config(self.cfg, timeout=1.0)
                cl.put(f"/bench-writer/{i % 1000:04d}", b"w")
                self.acked.append(time.monotonic())
            except Exception:  # noqa: BLE001 - a refused or timed-out write is what is measured
                if cl is not None:
                    cl.close()
                cl = None
            i += 1
            self.stop.wait(0.02)
        if cl is not None:
            cl.close()

    def __enter__(self) -> "Writer":
        self.t0 = time.monotonic()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def gap(self) -> float:
        ts = [self.t0] + self.acked
        return max((b - a for a, b in zip(ts, ts[1:])), default=float("nan"))


def with_writer(cfg: Config, way: Callable[[], Run]) -> Callable[[], Run]:
    def run() -> Run:
        with Writer(cfg) as w:
            r = way()
            time.sleep(0.3)  # the first write after the restore
        r.phases["client-seen downtime"] = w.gap()
        return r
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_node(snap: str, work: str) -> Tuple[float, float]:
    """One node's floor: `etcdutl snapshot restore` into a fresh dir, then one etcd started on it
    until it answers a linearizable read."""
    rel = release(DEFAULT)
    dd = os.path.join(work, "one-node.etcd")
    shutil.rmtree(dd, ignore_errors=True)
    cport, pport = _free_port(), _free_port()
    peer = f"http://127.0.0.1:{pport}"
    t0 = time.monotonic()
    subprocess.run([str(rel.etcdutl), "snapshot", "restore", snap, "--name=one", f"--initial-cluster=one={peer}",
                    "--initial-cluster-token=one-node", f"--initial-advertise-peer-urls={peer}", f"--data-dir={dd}"],
                   check=True, capture_output=True, timeout=900)
    t1 = time.monotonic()
    client = f"http://127.0.0.1:{cport}"
    proc = subprocess.Popen([str(rel.etcd), "--name=one", f"--data-dir={dd}", f"--listen-client-urls={client}",
                             f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}",
                             f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=one={peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with EtcdClient([client], timeout=1.0) as cl:
            while not cl.healthy(client, timeout=1.0)[0]:
                if proc.poll() is not None or time.monotonic() - t1 > 300:
                    raise SystemExit("one node: etcd did not become healthy")
                time.sleep(0.05)
        t2 = time.monotonic()
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(dd, ignore_errors=True)
    return t1 - t0, t2 - t1


class NetnsBench:
    def __init__(self, bed: RestoreBed, snap: str, backup: str) -> None:
        self.bed = bed
        self.snap = snap
        self.backup = backup
        self.cfg = bed.cfg(bed.h(1).name)

    def tar_xf(self) -> float:
        """The runbook's first step, which the by-hand runs are spared (they start from the
        snapshot already extracted): `tar -xf` of the snapshot out of the backup on fc1, timed
        here, outside their wall, then removed and synced (untimed)."""
        dest = tempfile.mkdtemp(prefix="tar-xf-", dir=self.bed.work)
        t = time.monotonic()
        subprocess.run(self.bed.net.exec_argv(self.bed.net.hosts[0], ["tar", "-xf", self.backup, "-C", dest,
                                                                      "etcd_snapshot.db"]),
                       check=True, capture_output=True, timeout=900)
        took = time.monotonic() - t
        shutil.rmtree(dest)
        os.sync()
        return took

    def ssh_argv(self, h: NsHost, script: str) -> List[str]:
        net = self.bed.net
        return net.exec_argv(net.hosts[0], [
            "ssh", "-i", net.client_key, "-o", f"UserKnownHostsFile={net.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", f"root@{h.ip}", script])

    def sweep(self) -> None:
        """Untimed, between runs: the data dirs every restore set aside (the agent's and the
        by-hand ones), so a 1 GiB bench does not fill the disk with nine copies per round."""
        for m in self.cfg.members:
            parent = os.path.dirname(self.cfg.data_dir(m.name))
            for entry in os.listdir(parent):
                if ".by-hand-" in entry or ".pre-restore-" in entry:
                    shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)

    def scp_others(self) -> float:
        """`scp` of the snapshot from the first host to the two others at once (OpenSSH defaults,
        the bed's key and known_hosts): seconds until both are done."""
        net = self.bed.net

        def one(h: NsHost) -> None:
            dest = os.path.join(self.bed.work, h.name, "scp-snapshot.db")
            subprocess.run(net.exec_argv(net.hosts[0], [
                "scp", "-q", "-i", net.client_key, "-o", f"UserKnownHostsFile={net.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                self.snap, f"root@{h.ip}:{dest}"]), check=True, capture_output=True, timeout=900)
            os.unlink(dest)

        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(one, net.hosts[1:]))
        return time.monotonic() - t0

    def one_host(self, h: NsHost, pid: int, token: str) -> None:
        local = h is self.bed.net.hosts[0]
        snap = self.snap if local else os.path.join(self.bed.work, h.name, "by-hand-snapshot.db")
        script = _host_script(self.cfg, h.name, pid, snap, token, receive=not local)
        if local:
            argv = self.bed.net.exec_argv(h, ["sh", "-c", script])
            subprocess.run(argv, check=True, capture_output=True, timeout=600)
        else:
            with open(self.snap, "rb") as fh:
                subprocess.run(self.ssh_argv(h, script), stdin=fh, check=True, capture_output=True, timeout=600)

    def by_hand(self, parallel: bool) -> Run:
        pids = {m.name: ProcessBackend(self.cfg, m.name).pid() for m in self.cfg.members}
        if not all(pids.values()):
            raise SystemExit(f"by hand: not every etcd runs before the round: {pids}")
        untar = self.tar_xf()
        token = new_token()
        hosts = self.bed.net.hosts
        t0 = time.monotonic()
        if parallel:
            with ThreadPoolExecutor(len(hosts)) as ex:
                list(ex.map(lambda h: self.one_host(h, int(pids[h.name] or 0), token), hosts))
        else:
            for h in hosts:
                self.one_host(h, int(pids[h.name] or 0), token)
        steps = time.monotonic() - t0
        wait_all_healthy(self.cfg)
        run = Run(time.monotonic() - t0, {"hosts": steps, "wait": time.monotonic() - t0 - steps, TAR_XF: untar})
        self.adopt()
        return run

    def adopt(self) -> None:
        """After a round by hand (untimed): the etcds it started get the pid files the process
        backend writes, so the next agent round can stop them after its identity checks."""
        for m in self.cfg.members:
            with open(os.path.join(self.cfg.etcd.run_dir, f"{m.name}.by-hand-pid"), encoding="utf-8") as fh:
                pid = int(fh.read().strip())
            rec = {"pid": pid, "create_time": psutil.Process(pid).create_time(), "start_ticks": start_ticks(pid),
                   "binary": self.cfg.etcd.binary}
            with open(os.path.join(self.cfg.etcd.run_dir, f"{m.name}.pid"), "w", encoding="utf-8") as fh:
                json.dump(rec, fh)


def netns(keys: int, rounds: int, directory: str, value_bytes: int = 64, warmup: int = 0) -> None:
    bedlock.acquire(say=lambda s: print(s, flush=True))
    made_etc = not os.path.exists(ETC_DIR)
    if made_etc:
        os.makedirs(ETC_DIR, mode=0o755)
    work = tempfile.mkdtemp(prefix="fc-restore-netns-", dir=directory)
    net = NetnsBed(3, prefix=PREFIX, subnet=SUBNET)
    try:
        bed = build(net, work, PREFIX, etcd=release(DEFAULT).toml())
        cfg = bed.cfg(net.hosts[0].name)
        t = time.monotonic()
        fill(cfg, "/k/", keys, value_bytes)
        print(f"netns: filled {keys} keys of {value_bytes} B in {time.monotonic() - t:.1f}s", flush=True)
        res = bed.agent(net.hosts[0], "--json", "backup")
        if res.returncode != 0:
            raise SystemExit(f"backup failed: {res.stderr}")
        backup: Dict[str, object] = json.loads(res.stdout)
        snap = extract_snapshot(str(backup["path"]), work)
        size = os.path.getsize(snap)
        print(f"netns: keys={keys} snapshot={size} bytes", flush=True)
        nb = NetnsBench(bed, snap, str(backup["path"]))
        ways = {
            "agent restore --yes (SSH)": with_writer(cfg, lambda: agent_run(net.exec_argv(net.hosts[0], [
                AGENT, "-c", AGENT_TOML, "--json", "restore", "--from", str(backup["path"]), "--yes"]))),
            "by hand, serial": with_writer(cfg, lambda: nb.by_hand(parallel=False)),
            "by hand, 3 hosts at once": with_writer(cfg, lambda: nb.by_hand(parallel=True)),
        }

        def check() -> None:
            got = counts(cfg, "/k/", "/later/")
            if got != [keys, 0]:
                raise SystemExit(f"restored data wrong: counts {got}, expected {[keys, 0]}")

        def between() -> None:
            nb.sweep()
            fill(cfg, "/later/", 100, 64)
            # untimed: the previous round's gigabytes reach the disk now, not during this round
            # (on one shared disk their writeback doubled a round's copy and ship times)
            os.sync()

        runs = interleave(ways, rounds, between=between, check=check, warmup=warmup)
        os.sync()
        restore_s, start_s = one_node(snap, work)
        os.sync()
        scp_s = nb.scp_others()
        title = f"netns, 3 hosts over SSH, {keys} keys of {value_bytes} B, snapshot {size} bytes"
        report(title, runs, agent="agent restore --yes (SSH)")
        agent = runs["agent restore --yes (SSH)"]
        floor = restore_s + start_s
        down = [r.phases.get("downtime", float("nan")) for r in agent]
        seen = [r.phases["client-seen downtime"] for r in agent]
        print(f"one node: snapshot restore {restore_s:.2f}s + etcd start to healthy {start_s:.2f}s = {floor:.2f}s")
        print(f"agent downtime, fence -> unfence (median): {statistics.median(down):.2f}s = "
              f"{statistics.median(down) / floor:.2f}x one node")
        for name, rs in runs.items():
            gaps = [r.phases["client-seen downtime"] for r in rs]
            print(f"client-seen downtime of {name} (min/median/max): {min(gaps):.2f} {statistics.median(gaps):.2f} "
                  f"{max(gaps):.2f}s")
        print(f"agent client-seen downtime (median) = {statistics.median(seen) / floor:.2f}x one node")
        at_once = [r.wall + r.phases[TAR_XF] for r in runs["by hand, 3 hosts at once"]]
        print(f"by hand, 3 hosts at once, its tar xf of the snapshot added (min/median/max): {min(at_once):.2f} "
              f"{statistics.median(at_once):.2f} {max(at_once):.2f}s; agent median / that = "
              f"{statistics.median(r.wall for r in agent) / statistics.median(at_once):.2f}x")
        ships = [r.phases["ship"] for r in agent if r.phases.get("ship")]
        scp_mbs = size / scp_s / 1e6
        if ships:
            ship_mbs = size / statistics.median(ships) / 1e6
            print(f"ship: agent {ship_mbs:.1f} MB/s per host (to fc2 and fc3 at once while fc1 copies its own; snapshot / "
                  "median ship phase) vs "
                  f"scp to 2 hosts at once {scp_mbs:.1f} MB/s per host: {ship_mbs / scp_mbs:.2f}x")
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load average at the end: {load}")
    finally:
        net.down()  # every process of the namespaces by PID: etcd, sshd, sessions
        shutil.rmtree(work, ignore_errors=True)
        if made_etc:
            try:
                os.rmdir(ETC_DIR)
            except OSError:
                pass
        bedlock.release()
