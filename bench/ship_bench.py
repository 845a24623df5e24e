"""Benchmark: the restore's snapshot ship vs OpenSSH ``scp`` of the same file to the same hosts.

A namespace bed sh1..sh3 (10.213.14.11-13, sshd on each, under the machine-wide bed lock), and
two 1 GiB snapshots made here: Kubernetes-like objects (zstd -1 shrinks them ~5.5x, like real
apiserver data) and random bytes (encrypted values: they do not shrink). Each is shipped to 1 host
and to 3 hosts at once, both ways, rounds interleaved:

- agent: the product's path - a ``node serve`` session holding each host's lock, a journaled
  ``begin``, then ``restore.ship.ship_snapshot`` (codec from samples, one read, zstd once when it
  pays, one stream per host to ``etcd-agent node receive``, which hashes, checks, fsyncs, renames),
  through the OpenSSH client (``[ssh] stream = "auto"``; ``--stream paramiko`` for the agent's own
  connection);
- scp: ``scp`` with OpenSSH's defaults and the bed's key and known_hosts, to the same disk (no fsync).

Printed: MB/s per host (snapshot bytes / seconds until the slowest host is done, median of the
rounds), the ratio agent/scp, the sender's CPU seconds per GiB, and the load averages. The bed
and the snapshots are removed afterwards (``--keep`` keeps the snapshots for another run).

    .venv/bin/python bench/ship_bench.py [--rounds 3] [--size-mib 1024] [--dir /var/tmp/ship-bench] [--keep]
                                         [--stream paramiko]
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import time
import uuid
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.installed import byte_compile  # noqa: E402
from etcd_agent.config import Config, parse_text  # noqa: E402
from etcd_agent.errors import AgentError  # noqa: E402
from etcd_agent.etcd.bbolt import BOLT_MAGIC, BOLT_VERSION, META_FLAG, NO_FREELIST, TRAILER, _fnv64a  # noqa: E402
from etcd_agent.hosts.ssh import SshHost  # noqa: E402
from etcd_agent.node.client import new_owner  # noqa: E402
from etcd_agent.node.replies import RollbackReply, StepReply  # noqa: E402
from etcd_agent.node.sessions import HostNode, close_sessions, open_sessions  # noqa: E402
from etcd_agent.restore.orchestrator.ship import ship_snapshot  # noqa: E402
from etcd_agent.restore.orchestrator.source import Source  # noqa: E402
from tests.harness import bedlock  # noqa: E402
from tests.harness.netns import NetnsBed  # noqa: E402
from tests.harness.releases import DEFAULT, release  # noqa: E402
from tests.harness.restorebed import AGENT_TOML, ETC_DIR, agent_toml  # noqa: E402

PREFIX, SUBNET = "sh", "10.213.14"
PAGE = 4096

# ---------------------------------------------------------------- the snapshots


def write_snapshot(path: str, size: int, pages: Iterator[bytes]) -> str:
    """An etcd snapshot of ~``size`` bytes that ``node receive`` accepts: two valid bbolt meta
    pages, content pages from ``pages`` (1 MiB at a time), etcd's sha256 trailer. Its sha256."""
    n = (size - TRAILER) // PAGE
    body, whole = hashlib.sha256(), hashlib.sha256()
    with open(path, "wb") as fh:
        def put(data: bytes) -> None:
            body.update(data)
            whole.update(data)
            fh.write(data)

        for pgid in (0, 1):
            meta = struct.pack("<IIIIQQQQQ", BOLT_MAGIC, BOLT_VERSION, PAGE, 0, 2, 0, NO_FREELIST, n, pgid + 1)
            page = struct.pack("<QHHI", pgid, META_FLAG, 0, 0) + meta + struct.pack("<Q", _fnv64a(meta))
            put(page.ljust(PAGE, b"\0"))
        left = (n - 2) * PAGE
        for chunk in pages:
            if left <= 0:
                break
            put(chunk[:left])
            left -= min(len(chunk), left)
        trailer = body.digest()
        whole.update(trailer)
        fh.write(trailer)
    return whole.hexdigest()


def random_pages() -> Iterator[bytes]:
    while True:
        yield os.urandom(1 << 20)


class KubernetesLike:
    """Objects the way the apiserver leaves them in etcd, JSON-encoded in bbolt-like 4 KiB pages:
    pods, events, leases, config maps with their managedFields; secrets encrypted at rest
    (random); a share of free pages, zeroed or holding stale copies of earlier ones."""

    NS = ["default", "kube-system", "monitoring", "logging", "ingress-nginx"] + [
        f"{t}-{e}" for t in ("platform", "payments", "retail", "data", "sre", "ml") for e in ("prod", "staging", "dev")]
    APPS = ["nginx", "api-gateway", "payments", "orders", "catalog", "auth", "redis", "postgres", "kafka",
            "prometheus", "grafana", "fluent-bit", "coredns", "checkout", "cart", "search", "billing", "frontend"]
    IMAGES = ["docker.io/library/nginx:1.25.3", "registry.k8s.io/coredns/coredns:v1.11.1",
              "quay.io/prometheus/prometheus:v2.48.0", "ghcr.io/acme/payments:2024.11.3", "docker.io/bitnami/redis:7.2.3"]
    NODES = [f"worker-{i:03d}.dc1.example.com" for i in range(60)]
    KINDS = ["Pod", "ConfigMap", "Event", "Lease", "Endpoints", "ReplicaSet", "Secret"]

    def __init__(self, seed: int = 1) -> None:
        self.r = random.Random(seed)
        self.rev = 1
        self.stale: List[bytes] = []

    def _object(self) -> Tuple[str, bytes]:
        r = self.r
        kind, ns, app = r.choice(self.KINDS), r.choice(self.NS), r.choice(self.APPS)
        name = f"{app}-{r.getrandbits(40):010x}"[: r.randint(12, 28)]
        key = f"/registry/{kind.lower()}s/{ns}/{name}"
        if kind == "Secret":
            return key, b"k8s:enc:aescbc:v1:key1:" + os.urandom(r.randint(64, 720))
        uid = str(uuid.UUID(int=r.getrandbits(128)))
        ts = f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:00Z"
        meta = {"name": name, "namespace": ns, "uid": uid, "resourceVersion": str(self.rev), "creationTimestamp": ts,
                "labels": {"app.kubernetes.io/name": app, "pod-template-hash": f"{r.getrandbits(32):08x}"},
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                                   "time": ts, "fieldsType": "FieldsV1",
                                   "fieldsV1": {"f:metadata": {"f:labels": {".": {}}}, "f:spec": {"f:containers": {}}}}]}
        if kind == "Pod":
            body = {"spec": {"nodeName": r.choice(self.NODES), "containers": [{
                "name": app, "image": r.choice(self.IMAGES), "ports": [{"containerPort": r.choice([80, 8080, 9090])}],
                "env": [{"name": f"{app.upper().replace('-', '_')}_{k}", "value": f"{r.getrandbits(24):x}"}
                        for k in ("HOST", "PORT", "MODE")],
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}}}]},
                "status": {"phase": "Running", "podIP": f"10.{r.randint(0, 255)}.{r.randint(0, 255)}.{r.randint(0, 255)}",
                           "conditions": [{"type": t, "status": "True", "lastTransitionTime": ts}
                                          for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")]}}
        elif kind == "Event":
            body = {"reason": r.choice(["Scheduled", "Pulled", "Started", "BackOff"]), "count": r.randint(1, 40),
                    "message": f"Successfully assigned {ns}/{name} to {r.choice(self.NODES)}", "lastTimestamp": ts,
                    "involvedObject": {"kind": "Pod", "namespace": ns, "name": name, "uid": uid}}
        elif kind == "ConfigMap":
            body = {"data": {"config.yaml": "".join(f"{k}: {r.getrandbits(20)}\n" for k in ("replicas", "timeout", "port"))}}
        else:
            body = {"spec": {"holderIdentity": f"{r.choice(self.NODES)}_{uid}", "leaseDurationSeconds": 40, "renewTime": ts}}
        return key, json.dumps({"apiVersion": "v1", "kind": kind, "metadata": meta, **body}, separators=(",", ":")).encode()

    def _page(self) -> bytes:
        roll = self.r.random()
        if roll < 0.03:
            return bytes(PAGE)  # never written
        if roll < 0.15 and self.stale:
            return self.r.choice(self.stale)  # free, still holding an old copy
        page = bytearray(struct.pack("<QHHI", self.rev, 0x02, 0, 0))
        while len(page) < PAGE - 400:
            key, value = self._object()
            page += struct.pack(">Q", self.rev) + b"_" + bytes(8) + key.encode() + value
            self.rev += 1
        out = bytes(page[:PAGE]).ljust(PAGE, b"\0")
        if len(self.stale) < 2000:
            self.stale.append(out)
        return out

    def pages(self) -> Iterator[bytes]:
        while True:
            yield b"".join(self._page() for _ in range(256))


# ---------------------------------------------------------------- the bed


class Bench:
    def __init__(self, net: NetnsBed, work: str, rounds: int, stream: str) -> None:
        self.net = net
        self.work = work
        self.rounds = rounds
        hosts = net.hosts
        etcd = release(DEFAULT).toml()
        for h in hosts:
            os.makedirs(os.path.join(h.etc_dir, "etcd-agent"), exist_ok=True)
            for sub in (f"{h.name}/backups", f"{h.name}/state", f"scp/{h.name}"):
                os.makedirs(os.path.join(work, sub), mode=0o700, exist_ok=True)
            with open(os.path.join(h.etc_dir, "etcd-agent", "agent.toml"), "w") as fh:
                fh.write(agent_toml(work, hosts, h, net, PREFIX, etcd))
        cfg, errors = parse_text(agent_toml(work, hosts, hosts[0], net, PREFIX, etcd), path=AGENT_TOML)
        assert cfg is not None and not errors, errors
        self.cfg: Config = dataclasses.replace(cfg, ssh=dataclasses.replace(cfg.ssh, stream=stream))
        self.owner = new_owner("ship bench")
        # every host over SSH (scp has no local shortcut either)
        self.nodes = [HostNode(h.ip, SshHost(h.name, h.ip, self.cfg.ssh), False, [cfg.member(h.name)]) for h in hosts]
        open_sessions(cfg, self.nodes, self.owner, lambda s: None)
        self.ops = 0

    def close(self) -> None:
        close_sessions(self.nodes)

    def agent(self, source: Source, k: int) -> Dict[str, float]:
        """One ship to the first ``k`` hosts: seconds until the slowest is done, sender CPU-s."""
        self.ops += 1
        op = f"bench-{self.ops}"
        nodes = self.nodes[:k]
        for n in nodes:
            n.ask(StepReply, "begin", member=n.members[0].name, op=op, token="bench", initial_cluster="",
                  sha256=source.sha256, size=source.size, backup=source.path, bump=None, fence_owner=False,
                  new_cluster=False)
        subprocess.run(["sync"], check=True)
        cpu0, t0 = os.times(), time.monotonic()
        shipped = ship_snapshot(self.cfg, source, [(n.members[0], n) for n in nodes], op=op, owner=self.owner,
                                say=lambda s: None)
        wall, cpu1 = time.monotonic() - t0, os.times()
        for n in nodes:  # drops the received copy; nothing else was touched
            n.ask(RollbackReply, "rollback", member=n.members[0].name, op=op)
        # this process and its children (the OpenSSH clients carrying the streams, reaped by now)
        cpu = sum(getattr(cpu1, f) - getattr(cpu0, f) for f in ("user", "system", "children_user", "children_system"))
        return {"seconds": max(shipped.hosts.values()), "wall": wall, "wire": shipped.wire, "cpu": cpu}

    def scp(self, source: Source, k: int) -> Dict[str, float]:
        argv = ["scp", "-q", "-o", f"UserKnownHostsFile={self.net.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "GlobalKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-i", self.net.client_key]
        dests = [os.path.join(self.work, "scp", h.name, "etcd_snapshot.db") for h in self.net.hosts[:k]]
        subprocess.run(["sync"], check=True)
        ch0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        procs = [(subprocess.Popen(argv + [source.path, f"root@{h.ip}:{d}"]), d) for h, d in zip(self.net.hosts, dests)]
        done = []
        for p, _d in procs:
            if p.wait(timeout=900) != 0:
                raise RuntimeError(f"scp exited {p.returncode}")
            done.append(time.monotonic() - t0)
        ch1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        for d in dests:
            if os.path.getsize(d) != source.size:
                raise RuntimeError(f"scp left {os.path.getsize(d)} bytes in {d}")
            os.unlink(d)
        return {"seconds": max(done), "wall": max(done), "wire": source.size,
                "cpu": (ch1.ru_utime - ch0.ru_utime) + (ch1.ru_stime - ch0.ru_stime)}


def run(bench: Bench, sources: Sequence[Tuple[str, Source]]) -> List[Dict[str, object]]:
    rows: List[Dict[str, object]] = []
    for rnd in range(bench.rounds):
        for label, src in sources:
            for k in (1, 3):
                ways: List[Tuple[str, Callable[[Source, int], Dict[str, float]]]] = [("agent", bench.agent),
                                                                                     ("scp", bench.scp)]
                for way, fn in ways if rnd % 2 == 0 else ways[::-1]:  # alternate who goes first
                    load = os.getloadavg()[0]
                    got = fn(src, k)
                    row = {"data": label, "hosts": k, "way": way, "round": rnd, "load1": round(load, 2), **got,
                           "mb_s": src.size / got["seconds"] / 1e6}
                    rows.append(row)
                    print(f"  round {rnd + 1} {label:16s} {k} host(s) {way:5s}: {row['mb_s']:7.1f} MB/s per host "
                          f"({got['seconds']:.2f}s, sender {got['cpu']:.2f} CPU-s, load {load:.1f})", flush=True)
    return rows


def report(rows: List[Dict[str, object]], size: int) -> None:
    print("\nMB/s per host (median of rounds; seconds until the slowest host is done), agent vs scp:")
    print(f"{'data':16s} hosts {'agent':>8s} {'scp':>8s}  ratio  agent CPU-s/GiB  scp CPU-s/GiB  load1")
    for label in dict.fromkeys(str(r["data"]) for r in rows):
        for k in (1, 3):
            sel = [r for r in rows if r["data"] == label and r["hosts"] == k]
            med = {w: statistics.median(float(r["mb_s"]) for r in sel if r["way"] == w) for w in ("agent", "scp")}
            cpu = {w: statistics.median(float(r["cpu"]) for r in sel if r["way"] == w) / (size / 2**30)
                   for w in ("agent", "scp")}
            loads = [float(str(r["load1"])) for r in sel]
            print(f"{label:16s} {k:5d} {med['agent']:8.1f} {med['scp']:8.1f}  {med['agent'] / med['scp']:5.2f}  "
                  f"{cpu['agent']:15.2f}  {cpu['scp']:13.2f}  {min(loads):.1f}-{max(loads):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--dir", default="/var/tmp/ship-bench")
    ap.add_argument("--stream", choices=("auto", "openssh", "paramiko"), default="auto",
                    help="[ssh] stream: what carries the agent's streams (default auto: the OpenSSH client)")
    ap.add_argument("--keep", action="store_true", help="keep the generated snapshots (and reuse them next time)")
    a = ap.parse_args()
    byte_compile()
    size = a.size_mib << 20
    os.makedirs(a.dir, mode=0o700, exist_ok=True)
    sources = []
    for label, gen in (("kubernetes-like", lambda: KubernetesLike().pages()), ("random", random_pages)):
        path = os.path.join(a.dir, f"{label}-{a.size_mib}m.db")
        t = time.monotonic()
        if not (os.path.exists(path) and os.path.exists(path + ".sha256")):
            with open(path + ".sha256", "w") as fh:
                fh.write(write_snapshot(path, size, gen()))
            print(f"made {path} in {time.monotonic() - t:.0f}s", flush=True)
        with open(path + ".sha256") as fh:
            sha = fh.read().strip()
        sources.append((label, Source(path, "agent", os.path.getsize(path), sha, None, None, None, snapshot_path=path)))
    bedlock.acquire(say=print)
    made_etc = not os.path.exists(ETC_DIR)
    net = NetnsBed(3, prefix=PREFIX, subnet=SUBNET)
    try:
        if made_etc:
            os.makedirs(ETC_DIR, mode=0o755)
        net.up()
        for h in net.hosts:  # before sshd: `ip netns exec` binds only what exists when it starts
            os.makedirs(os.path.join(h.etc_dir, "etcd-agent"), exist_ok=True)
        net.start_sshd()
        try:
            bench = Bench(net, os.path.join(a.dir, "bed"), a.rounds, a.stream)
        except AgentError as exc:
            raise SystemExit("\n  - ".join([f"ship_bench: {exc.message}", *exc.details])) from None
        try:
            print(f"load averages at the start: {os.getloadavg()}", flush=True)
            rows = run(bench, sources)
            print(f"load averages at the end: {os.getloadavg()}")
        finally:
            bench.close()
        report(rows, sources[0][1].size)
    finally:
        net.down()
        if made_etc:
            os.rmdir(ETC_DIR)
        bedlock.release()
        shutil.rmtree(os.path.join(a.dir, "bed"), ignore_errors=True)
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
