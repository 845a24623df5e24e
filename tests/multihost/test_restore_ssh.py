"""`etcd-agent restore` over real SSH: three namespace hosts, each with sshd and its own agent.toml.

Each host er1..er3 (10.213.4.11-13) sees its own ``/etc/etcd-agent/agent.toml`` (``ip netns exec``
bind-mounts ``/etc/netns/<ns>/etcd-agent`` over ``/etc/etcd-agent``, and sshd started that way
hands the mount to its sessions), with ``[local] name`` set and its own backup and state dirs;
data dirs and conf files are distinct per member under this module's temp dir. etcd runs with the
process backend inside each namespace. The operator's command runs inside er1's namespace, as it
would on master 1: er1 is driven through LocalHost, er2/er3 over SSH (known_hosts enforced).

The tests build on each other in file order (one cluster), like an operator's session.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterator, List, Optional

import pytest

from etcd_agent.config import Config, load
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.member.process import ProcessBackend
from etcd_agent.restore.plan import BUMP_REVISION
from etcd_agent.restore.precheck import work_dir_for
from tests.harness.netns import NetnsBed, NsHost
from tests.harness.releases import DEFAULT, release

pytestmark = pytest.mark.multihost

PREFIX, SUBNET = "er", "10.213.4"
AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
ETC_DIR = "/etc/etcd-agent"
AGENT_TOML = f"{ETC_DIR}/agent.toml"
KEYS = 10_000
COMMAND_TIMEOUT = 20.0  # per node call: bounds how long a dead link holds up the orchestrator


def agent_toml(work: str, hosts: List[NsHost], me: NsHost, bed: NetnsBed) -> str:
    lines = [
        "[cluster]", 'name = "er"', 'token = "er-token"', 'bootstrap = "static"',
        "[local]", f'name = "{me.name}"',
        "[etcd]", release(DEFAULT).toml(), 'service_manager = "process"', 'user = "root"', 'group = "root"',  # etcdutl: restores bump the revision
        # the same path in every host's config (the pre-check compares them); distinct per member
        f'data_dir = "{work}/data/{{name}}.etcd"', f'conf_file = "{work}/conf/{{name}}.conf"',
        f'unit_file = "{work}/conf/etcd.service"', f'run_dir = "{work}/run"', "start_timeout = 30.0",
        "[backup]", f'dir = "{work}/{me.name}/backups"',  # per host: the operation lock lives here
        "[daemon]", f'state_dir = "{work}/{me.name}/state"',
        "[ssh]", 'user = "root"', f'identity_file = "{bed.client_key}"', f'known_hosts = "{bed.known_hosts}"',
        "connect_timeout = 3.0", f"command_timeout = {COMMAND_TIMEOUT}", f'agent_path = "{AGENT}"',
    ]
    for h in hosts:
        lines += ["[[member]]", f'name = "{h.name}"', f'host = "{h.ip}"']
    return "\n".join(lines) + "\n"


class Bed:
    def __init__(self, net: NetnsBed, work: str) -> None:
        self.net = net
        self.work = work
        self.cfgs: Dict[str, Config] = {}

    @property
    def h1(self) -> NsHost:
        return self.net.hosts[0]

    def cfg(self, name: Optional[str] = None) -> Config:
        return self.cfgs[name or self.h1.name]

    def toml(self, h: NsHost) -> str:
        return os.path.join(h.etc_dir, "etcd-agent", "agent.toml")

    def agent(self, h: NsHost, *args: str, timeout: float = 300) -> "subprocess.CompletedProcess[str]":
        """The operator's command on host ``h`` (inside its namespace and /etc)."""
        return subprocess.run(self.net.exec_argv(h, [AGENT, "-c", AGENT_TOML, *args]), capture_output=True,
                              text=True, timeout=timeout)

    def pids(self) -> Dict[str, Optional[int]]:
        cfg = self.cfg()
        return {m.name: ProcessBackend(cfg, m.name).pid() for m in cfg.members}

    def listing(self) -> Dict[str, List[str]]:
        cfg = self.cfg()
        out = {}
        for m in cfg.members:
            d = cfg.data_dir(m.name)
            out[m.name] = sorted(os.listdir(d)) if os.path.isdir(d) else []
        out["data"] = sorted(os.listdir(os.path.dirname(cfg.data_dir(self.h1.name))))
        return out

    def journal(self, member: str) -> Dict:
        p = os.path.join(work_dir_for(self.cfg().data_dir(member), member), "journal.json")
        try:
            with open(p) as fh:
                return json.load(fh)
        except (FileNotFoundError, ValueError):
            return {}


def put_many(cfg: Config, prefix: str, n: int, workers: int = 4) -> None:
    def chunk(k: int) -> None:
        with EtcdClient.from_config(cfg, timeout=10.0) as cl:
            for i in range(k, n, workers):
                cl.put(f"{prefix}{i:06d}", b"x" * 64)

    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(chunk, range(workers)))


def counts(cfg: Config, *prefixes: str, endpoint: Optional[str] = None) -> List[int]:
    with EtcdClient.from_config(cfg, timeout=5.0) as cl:
        return [cl.count_prefix(p, endpoint=endpoint) if endpoint else cl.count_prefix(p) for p in prefixes]


def revisions(cfg: Config) -> Dict[str, int]:
    with EtcdClient.from_config(cfg, timeout=3.0) as cl:
        return {m.name: cl.status(m.client_url).revision for m in cfg.members}


def wait_healthy(cfg: Config, timeout: float, members: Optional[List[str]] = None) -> float:
    t0 = time.monotonic()
    names = members or [m.name for m in cfg.members]
    last = ""
    with EtcdClient.from_config(cfg, timeout=2.0) as cl:
        while time.monotonic() - t0 < timeout:
            bad = [n for n in names if not cl.healthy(cfg.member(n).client_url, timeout=2.0)[0]]
            if not bad:
                return time.monotonic() - t0
            last = ",".join(bad)
            time.sleep(0.2)
    raise AssertionError(f"not healthy after {timeout:.0f}s: {last}")


def start_static(bed: Bed, h: NsHost) -> None:
    """Bootstrap a member inside its namespace with the agent's own code (the process backend
    detaches etcd into its own session, so it outlives this command)."""
    code = ("import sys\nfrom etcd_agent.config import load, with_local\nfrom etcd_agent.member.local import LocalMember\n"
            "cfg = with_local(load(sys.argv[1]), sys.argv[2])\nLocalMember(cfg, cfg.member(sys.argv[2])).start_static()\n")
    bed.net.run(h, [sys.executable, "-c", code, AGENT_TOML, h.name], timeout=60)


def wait_journal(bed: Bed, member: str, step: str, proc: "subprocess.Popen[bytes]", timeout: float = 120) -> Dict:
    deadline = time.monotonic() + timeout
    while True:
        j = bed.journal(member)
        if step in j.get("steps", {}) and j.get("state") == "running":
            return j
        assert proc.poll() is None, f"restore ended (exit {proc.returncode}) before {member} reached {step}"
        assert time.monotonic() < deadline, f"{member} did not reach {step}"
        time.sleep(0.01)


def build(net: NetnsBed, work: str) -> Bed:
    """The bed up: namespaces, sshd, every host's agent.toml, a healthy static cluster (also
    bench/restore_netns.py's bed, with its own prefix and subnet)."""
    net.up()
    b = Bed(net, work)
    for h in net.hosts:
        os.makedirs(os.path.join(h.etc_dir, "etcd-agent"), exist_ok=True)
        for sub in (f"{h.name}/backups", f"{h.name}/state"):
            os.makedirs(os.path.join(work, sub), mode=0o700, exist_ok=True)
    net.start_sshd()  # known_hosts exists from here on; the configs name it
    for h in net.hosts:
        with open(b.toml(h), "w") as fh:
            fh.write(agent_toml(work, net.hosts, h, net))
        b.cfgs[h.name] = load(b.toml(h))
    for h in net.hosts:
        start_static(b, h)
    wait_healthy(b.cfg(net.hosts[0].name), 60)
    return b


@contextlib.contextmanager
def cluster_bed(prefix: str, subnet: str, work: str) -> Iterator[Bed]:
    """Three namespace hosts with sshd, each with its own agent.toml, running a healthy cluster."""
    if os.geteuid() != 0:
        pytest.skip("multihost tests need root (network namespaces, sshd)")
    # `ip netns exec` can only bind /etc/netns/<ns>/etcd-agent over an existing /etc/etcd-agent
    made_etc = not os.path.exists(ETC_DIR)
    if made_etc:
        os.makedirs(ETC_DIR, mode=0o755)
    net = NetnsBed(3, prefix=prefix, subnet=subnet)
    try:
        yield build(net, work)
    finally:
        net.down()  # every process of the namespaces by PID: etcd, sshd, lock holders
        if made_etc:
            try:
                os.rmdir(ETC_DIR)
            except OSError:
                pass


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    with cluster_bed(PREFIX, SUBNET, str(tmp_path_factory.mktemp("er"))) as b:
        yield b


@pytest.fixture(scope="module")
def backup(bed: Bed) -> Dict:
    cfg = bed.cfg()
    t = time.monotonic()
    put_many(cfg, "/k/", KEYS)
    print(f"\n[figure] netns: {KEYS} keys put in {time.monotonic() - t:.1f}s")
    res = bed.agent(bed.h1, "--json", "backup")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    put_many(cfg, "/later/", 300)
    return out


def test_dry_run_changes_nothing(bed: Bed, backup: Dict) -> None:
    pids, listing = bed.pids(), bed.listing()
    res = bed.agent(bed.h1, "restore", "--from", backup["path"], "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    cfg = bed.cfg()
    for m in cfg.members:
        where = "local" if m.name == "er1" else m.ssh_host
        assert f"member {m.name} on {where}:" in out
        assert f"--name={m.name}" in out and f"--initial-advertise-peer-urls={m.peer_url}" in out
    assert "pre-check ok" in res.stderr and res.stderr.count("pre-check ok") == 3
    # every host restores with etcdutl 3.5, which bumps the revision for the apiservers' watch caches
    assert f"revision bumped by {BUMP_REVISION}" in out and out.count("--mark-compacted") == 3
    print("\n--- restore --dry-run (namespace tier) ---\n" + out)
    assert bed.pids() == pids and bed.listing() == listing


def test_disaster_restore_over_ssh(bed: Bed, backup: Dict) -> None:
    cfg = bed.cfg()
    assert counts(cfg, "/k/", "/later/") == [KEYS, 300]
    # the disaster: every etcd gone, every data dir deleted
    for m in cfg.members:
        ProcessBackend(cfg, m.name).stop(timeout=10)
    for m in cfg.members:
        shutil.rmtree(cfg.data_dir(m.name))
    t = time.monotonic()
    res = bed.agent(bed.h1, "restore", "--from", backup["path"], "--yes")
    wall = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    revs = revisions(cfg)
    assert len(set(revs.values())) == 1 and min(revs.values()) > backup["revision"] + BUMP_REVISION, revs
    for m in cfg.members:  # every member serves every key of the backup, none of the later ones
        assert counts(cfg, "/k/", "/later/", endpoint=m.client_url) == [KEYS, 0]
    assert all(bed.pids().values())
    print(f"\n[figure] netns tier: restore --yes over SSH (3 hosts, {KEYS} keys, data dirs deleted): "
          f"wall {wall:.2f}s, revision {set(revs.values())}")
    print("\n".join(line for line in res.stderr.splitlines() if "restore:" in line))


def test_unreachable_host_refused_nothing_stopped(bed: Bed, backup: Dict) -> None:
    cfg = bed.cfg()
    put_many(cfg, "/after1/", 10)
    pids, listing = bed.pids(), bed.listing()
    er3 = bed.net.hosts[2]
    bed.net.set_link(er3, False)
    try:
        t = time.monotonic()
        res = bed.agent(bed.h1, "restore", "--from", backup["path"], "--yes")
        took = time.monotonic() - t
    finally:
        bed.net.set_link(er3, True)
    assert res.returncode == 3, res.stdout + res.stderr
    err = res.stderr
    assert "er3 (10.213.4.13): pre-check FAILED: unreachable" in err and "connect timed out" in err, err
    assert "er1 (local): pre-check ok" in err and "er2 (10.213.4.12): pre-check ok" in err
    assert "nothing touched" in err
    assert bed.pids() == pids, "a pre-check failure must not stop anything"
    assert bed.listing() == listing
    assert not any(bed.journal(m.name).get("state") == "running" for m in cfg.members)
    wait_healthy(cfg, 30)
    assert counts(cfg, "/k/", "/after1/") == [KEYS, 10]
    print(f"\n[figure] netns tier: host unreachable at pre-check -> refused (exit 3) in {took:.1f}s; "
          "etcd pids and data dirs unchanged")


def test_host_lost_mid_restore_rolled_back_then_rerun(bed: Bed, backup: Dict) -> None:
    cfg = bed.cfg()
    put_many(cfg, "/after2/", 10)
    er3 = bed.net.hosts[2]
    t = time.monotonic()
    proc = bed.net.popen(bed.h1, [AGENT, "-c", AGENT_TOML, "restore", "--from", backup["path"], "--yes"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # er3 dies for the network once its data dir is set aside (the orchestrator is mid-call)
        wait_journal(bed, "er3", "aside", proc)
        bed.net.set_link(er3, False)
        out, err_b = proc.communicate(timeout=180)
    finally:
        bed.net.set_link(er3, True)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = err_b.decode()
    took = time.monotonic() - t
    assert proc.returncode == 1, err
    assert "er3 (10.213.4.13): NOT rolled back" in err and "ROLLBACK INCOMPLETE" in err, err
    assert "etcd-agent restore rollback --yes" in err, err  # the next command, named
    assert "er1 (local) rolled back" in err and "er2 (10.213.4.12) rolled back" in err, err
    # er1 and er2 are back on the old data and hold quorum: the keys written after the backup serve
    wait_healthy(cfg, 30, ["er1", "er2"])
    for n in ("er1", "er2"):
        assert counts(cfg, "/k/", "/after2/", endpoint=cfg.member(n).client_url) == [KEYS, 10]
    print(f"\n[figure] netns tier: er3 lost after its data was set aside -> er1, er2 rolled back "
          f"and serving the old data; orchestrator exit 1 after {took:.1f}s")
    # er3 is back: the operator rolls back what could not be reached
    t = time.monotonic()
    res = bed.agent(bed.h1, "restore", "rollback", "--dry-run")
    assert res.returncode == 0 and "would roll back" in res.stdout, res.stdout + res.stderr
    res = bed.agent(bed.h1, "restore", "rollback", "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(cfg, 30)
    for m in cfg.members:
        assert counts(cfg, "/k/", "/after2/", endpoint=m.client_url) == [KEYS, 10]
        assert bed.journal(m.name).get("state") == "rolled-back"
    print(f"[figure] netns tier: `restore rollback` of er3 after it came back: {time.monotonic() - t:.1f}s; "
          "all 3 members serve the old data")
    # and the same restore run again completes
    t = time.monotonic()
    res = bed.agent(bed.h1, "restore", "--from", backup["path"], "--yes")
    assert res.returncode == 0, res.stderr
    for m in cfg.members:
        assert counts(cfg, "/k/", "/later/", "/after2/", endpoint=m.client_url) == [KEYS, 0, 0]
    print(f"[figure] netns tier: re-run after the rollback: {time.monotonic() - t:.1f}s, healthy on the backup")


def test_orchestrator_killed_then_resumed(bed: Bed, backup: Dict) -> None:
    cfg = bed.cfg()
    put_many(cfg, "/after3/", 10)
    proc = bed.net.popen(bed.h1, [AGENT, "-c", AGENT_TOML, "restore", "--from", backup["path"], "--yes"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        j = wait_journal(bed, "er2", "aside", proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    t = time.monotonic()
    res = bed.agent(bed.h1, "restore", "--from", backup["path"], "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"restore {j['op']} (resuming)" in res.stderr or "already done" in res.stderr, res.stderr
    revs = revisions(cfg)
    assert len(set(revs.values())) == 1
    for m in cfg.members:
        assert counts(cfg, "/k/", "/after3/", endpoint=m.client_url) == [KEYS, 0]
        assert bed.journal(m.name).get("state") == "done"
    print(f"\n[figure] netns tier: orchestrator SIGKILLed after er2's data was set aside; re-run resumed "
          f"op {j['op']} to healthy in {time.monotonic() - t:.1f}s")
