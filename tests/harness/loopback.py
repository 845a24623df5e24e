"""Real etcd clusters on 127.0.0.1 for the integration tier, started through the agent's own code.

Ports are picked at random from a high range and checked free (never the fixed 2379: a developer
may run the demo or a real etcd beside the tests). Every etcd is started by the process backend
and stopped by PID in ``stop()``.
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
from typing import List, Optional, Tuple

from etcd_agent.cluster.demo import ports as demo_ports
from etcd_agent.config import Config, load, with_local
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.member.local import LocalMember
from etcd_agent.member.process import ProcessBackend
from etcd_agent.topology import NEW, Bootstrap, initial_cluster, member_pairs
from tests.harness.releases import DEFAULT, release


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# Below the kernel's ephemeral range (32768-60999 by default): a port from that range, free when
# it was picked, can be taken by any outgoing connection (a gRPC client, say) before etcd binds it
# seconds later - seen as an etcd that "exited while starting" mid-test. Above the range the
# agent's own throwaway etcds draw from (delta.scratch.PORT_RANGE, 10000-21998: drills and
# point-in-time replays started by a test on another xdist worker), and clear of the demo's fixed
# ports (2379/2380, 22379/22380, 32379/32380 ...).
PORT_RANGE = (22000, 32300)
DEMO_PORTS = frozenset(p for i in range(4) for p in demo_ports(i))


def worker_port_range() -> Tuple[int, int]:
    """This pytest-xdist worker's share of PORT_RANGE (all of it without xdist): two workers
    probing the same range could both find a port free and race to bind it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    span = (PORT_RANGE[1] - PORT_RANGE[0]) // max(count, 1) // 2 * 2
    low = PORT_RANGE[0] + index * span
    return low, low + span


def free_port_pairs(n: int) -> List[Tuple[int, int]]:
    """n (client, peer) port pairs, all free right now."""
    rng = random.Random()
    low, high = worker_port_range()
    out: List[Tuple[int, int]] = []
    used = set()
    while len(out) < n:
        c = rng.randrange(low, high, 2)
        if c in used or c in DEMO_PORTS or c + 1 in DEMO_PORTS or not (_free(c) and _free(c + 1)):
            continue
        used |= {c, c + 1}
        out.append((c, c + 1))
    return out


def config_text(
    directory: str,
    n: int,
    *,
    bootstrap: str = "static",
    token: str = "test-token",
    ports: Optional[List[Tuple[int, int]]] = None,
    extra: str = "",
    version: str = DEFAULT,
    cluster_extra: str = "",
) -> str:
    """The agent.toml of an n-member loopback cluster on the installed etcd ``version``
    (tests/harness/releases.py; 3.5+ with etcdutl, so restores use it); ``cluster_extra`` adds
    [cluster] keys."""
    ports = ports or free_port_pairs(n)
    rel = release(version)
    lines = [
        "[cluster]",
        'name = "test"',
        f'token = "{token}"',
        f'bootstrap = "{bootstrap}"',
        cluster_extra,
        "[etcd]",
        rel.toml(),
        'service_manager = "process"',
        # test dirs live under pytest's 0700 temp root: etcd runs as the test's own user
        'user = "root"', 'group = "root"',
        f'data_dir = "{directory}/data/{{name}}.etcd"',
        f'conf_file = "{directory}/conf/{{name}}.conf"',
        f'unit_file = "{directory}/conf/etcd.service"',
        f'run_dir = "{directory}/run"',
        "start_timeout = 30.0",
        "[backup]",
        f'dir = "{directory}/backups"',
        extra,
        # the agent's state (bootstrap records, markers, lineage) per cluster, never the host's
        "" if "[daemon]" in extra else f'[daemon]\nstate_dir = "{directory}/state"',
    ]
    for i, (c, p) in enumerate(ports):
        lines += [
            "[[member]]",
            f'name = "m{i + 1}"',
            'host = "127.0.0.1"',
            f'client_url = "http://127.0.0.1:{c}"',
            f'peer_url = "http://127.0.0.1:{p}"',
        ]
    return "\n".join(lines) + "\n"


class LoopbackCluster:
    """n members on loopback, each a LocalMember with the process backend, on etcd ``version``."""

    def __init__(
        self,
        directory: str,
        n: int = 3,
        *,
        bootstrap: str = "static",
        extra: str = "",
        version: str = DEFAULT,
        cluster_extra: str = "",
    ) -> None:
        self.dir = directory
        self.version = version
        os.makedirs(os.path.join(directory, "conf"), exist_ok=True)
        self.config_path = os.path.join(directory, "agent.toml")
        with open(self.config_path, "w") as fh:
            fh.write(config_text(directory, n, bootstrap=bootstrap, extra=extra, version=version,
                                 cluster_extra=cluster_extra))
        self.cfg: Config = load(self.config_path)
        self.members = [
            LocalMember(with_local(self.cfg, m.name), m, ProcessBackend(self.cfg, m.name)) for m in self.cfg.members
        ]

    @classmethod
    def existing(cls, directory: str) -> "LoopbackCluster":
        """The cluster made in ``directory`` earlier (its agent.toml, its ports, its data), to be
        started again with ``start_existing`` (the benchmarks keep a filled one between runs)."""
        self = cls.__new__(cls)
        self.dir = directory
        self.config_path = os.path.join(directory, "agent.toml")
        self.cfg = load(self.config_path)
        self.version = ""
        self.members = [
            LocalMember(with_local(self.cfg, m.name), m, ProcessBackend(self.cfg, m.name)) for m in self.cfg.members
        ]
        return self

    def start_existing(self) -> None:
        for lm in self.members:
            lm.start_existing()
        for lm in self.members:
            lm.wait_healthy(60)

    def start_static(self, count: Optional[int] = None) -> None:
        """Static bootstrap of all members, or of the first ``count`` only (the others stay
        configured but unstarted: the scale tests add them later)."""
        if count is None:
            for lm in self.members:
                lm.start_static()
        else:
            first = self.cfg.members[:count]
            for lm in self.members[:count]:
                lm.render(Bootstrap(lm.member.name, NEW, initial_cluster(member_pairs(first)), self.cfg.cluster.token))
                lm.backend.start()
        for lm in self.members[: count or len(self.members)]:
            lm.wait_healthy(30)

    def start_incremental(self) -> None:
        seed = self.members[0]
        seed.start_seed()
        seed.wait_healthy(30)
        with self.client() as c:
            for lm in self.members[1:]:
                lm.join(c)
                lm.wait_healthy(30)

    def client(self, timeout: float = 5.0) -> EtcdClient:
        return EtcdClient.from_config(self.cfg, timeout=timeout)

    def stop(self) -> None:
        for lm in self.members:
            lm.backend.stop(timeout=10)


def orphan_etcd(directory: str, binary: str) -> "subprocess.Popen[bytes]":
    """What a run killed with -9 leaves: a single-member etcd running in ``directory`` (its
    working directory, as the agent's throwaway members run), in its own session, healthy."""
    from etcd_agent.waiting import poll

    os.makedirs(os.path.join(directory, "data"), exist_ok=True)
    (cp, pp), = free_port_pairs(1)
    proc = subprocess.Popen([binary, "--name", "x", "--data-dir", os.path.join(directory, "data"),
                             "--listen-client-urls", f"http://127.0.0.1:{cp}",
                             "--advertise-client-urls", f"http://127.0.0.1:{cp}",
                             "--listen-peer-urls", f"http://127.0.0.1:{pp}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{pp}",
                             "--initial-cluster", f"x=http://127.0.0.1:{pp}"], cwd=directory,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with EtcdClient([f"http://127.0.0.1:{cp}"], timeout=2.0) as cl:
            poll(lambda: cl.healthy(f"http://127.0.0.1:{cp}")[0], timeout=30, what=f"the etcd in {directory}")
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc
