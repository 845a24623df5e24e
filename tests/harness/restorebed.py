"""A 3-master cluster on namespace hosts with real sshd, for restore tests over SSH.

The bed of the restore and ship tests over SSH (``tests/multihost/test_restore*_ssh.py``,
``test_ship_ssh.py``) and of ``bench/restore_netns.py`` and ``bench/ship_bench.py``: host i is ``f"{prefix}{i}"`` at ``f"{subnet}.{10 + i}"``, each sees its own
``/etc/etcd-agent/agent.toml`` (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/etcd-agent``) with
``[local] name`` set and its own backup and state dirs; data dirs and conf files are distinct per
member under one temp dir; etcd runs with the process backend inside each namespace. The
operator's command runs inside a host's namespace *and* its own UTS namespace with the host's
name, as on that master: the lock records and busy messages then name the master it ran on.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from etcd_agent.config import Config, load
from etcd_agent.errors import EtcdUnavailable
from etcd_agent.etcd import proto
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.member.process import ProcessBackend
from etcd_agent.restore.host.facts import work_dir_for
from tests.harness.netns import NetnsBed, NsHost

ETCD = "/usr/bin/etcd"  # the harness's default release (3.4.23)
ETCDCTL = "/usr/bin/etcdctl"
AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
ETC_DIR = "/etc/etcd-agent"
AGENT_TOML = f"{ETC_DIR}/agent.toml"
COMMAND_TIMEOUT = 20.0  # per node call: bounds how long a dead link holds up the orchestrator
CTL_ENV = dict(os.environ, ETCDCTL_API="3")
ETCD_TOML = f'binary = "{ETCD}"\netcdctl = "{ETCDCTL}"'  # the [etcd] keys that pick the binaries


def agent_toml(work: str, hosts: List[NsHost], me: NsHost, bed: NetnsBed, cluster: str,
               etcd: str = ETCD_TOML) -> str:
    """Host ``me``'s agent.toml; ``etcd`` selects the binaries (e.g. ``release(DEFAULT).toml()``)."""
    lines = [
        "[cluster]", f'name = "{cluster}"', f'token = "{cluster}-token"', 'bootstrap = "static"',
        "[local]", f'name = "{me.name}"',
        "[etcd]", etcd, 'service_manager = "process"', 'user = "root"', 'group = "root"',
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


class RestoreBed:
    def __init__(self, net: NetnsBed, work: str) -> None:
        self.net = net
        self.work = work
        self.cfgs: Dict[str, Config] = {}

    def h(self, i: int) -> NsHost:
        """Host i, 1-based."""
        return self.net.hosts[i - 1]

    def cfg(self, name: Optional[str] = None) -> Config:
        return self.cfgs[name or self.h(1).name]

    def toml(self, h: NsHost) -> str:
        return os.path.join(h.etc_dir, "etcd-agent", "agent.toml")

    def backup_dir(self, h: NsHost) -> str:
        return self.cfg(h.name).backup.dir

    def agent_argv(self, h: NsHost, *args: str) -> List[str]:
        """The operator's command on host ``h``: its network namespace, its /etc, its hostname."""
        return self.net.exec_argv(h, ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', h.name,
                                      AGENT, "-c", AGENT_TOML, *args])

    def agent(self, h: NsHost, *args: str, timeout: float = 300) -> "subprocess.CompletedProcess[str]":
        return subprocess.run(self.agent_argv(h, *args), capture_output=True, text=True, timeout=timeout)

    def backup(self, h: Optional[NsHost] = None) -> Dict[str, Any]:
        """``etcd-agent --json backup`` on host ``h`` (the first by default): its record."""
        res = self.agent(h or self.h(1), "--json", "backup")
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        assert isinstance(doc, dict), doc
        return doc

    def popen_agent(self, h: NsHost, *args: str, **kw: Any) -> "subprocess.Popen[bytes]":
        """Started in the background (tracked: ``down()`` stops it); its pid is the agent's own
        (``ip netns exec``, ``unshare`` and ``sh -c exec`` all exec)."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self.agent_argv(h, *args), **kw)
        self.net._procs.append(proc)
        return proc

    def ctl(self, h: NsHost, *args: str, cwd: Optional[str] = None, endpoint: Optional[str] = None) -> str:
        """etcdctl inside host ``h`` against its member (or ``endpoint``)."""
        ep = endpoint or self.cfg().member(h.name).client_url
        proc = subprocess.run(self.net.exec_argv(h, [ETCDCTL, f"--endpoints={ep}", *args]), capture_output=True,
                              text=True, timeout=120, env=CTL_ENV, cwd=cwd)
        assert proc.returncode == 0, f"etcdctl {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def sh(self, h: NsHost, argv: List[str], cwd: Optional[str] = None) -> None:
        """A command inside host ``h`` (tar, mv ...), as the operator types it."""
        proc = subprocess.run(self.net.exec_argv(h, argv), capture_output=True, text=True, timeout=120, cwd=cwd)
        assert proc.returncode == 0, f"{' '.join(argv)}: {proc.stderr}"

    # ------------------------------------------------------------ what the tests look at

    def pids(self) -> Dict[str, Optional[int]]:
        cfg = self.cfg()
        return {m.name: ProcessBackend(cfg, m.name).pid() for m in cfg.members}

    def inodes(self) -> Dict[str, Tuple[int, int]]:
        """member -> (data dir inode, its member/snap/db inode): changes when a data dir is moved
        aside or restored."""
        cfg = self.cfg()
        out = {}
        for m in cfg.members:
            d = cfg.data_dir(m.name)
            out[m.name] = (os.stat(d).st_ino, os.stat(os.path.join(d, "member", "snap", "db")).st_ino)
        return out

    def data_listing(self) -> List[str]:
        return sorted(os.listdir(os.path.dirname(self.cfg().data_dir(self.h(1).name))))

    def listing(self) -> Dict[str, List[str]]:
        """member -> what its data dir holds, and "data" -> the data dirs' parent: what a refused
        restore must leave as it was."""
        cfg = self.cfg()
        out = {}
        for m in cfg.members:
            d = cfg.data_dir(m.name)
            out[m.name] = sorted(os.listdir(d)) if os.path.isdir(d) else []
        out["data"] = self.data_listing()
        return out

    def work_dir(self, member: str) -> str:
        return work_dir_for(self.cfg().data_dir(member), member)

    def work_files(self, member: str) -> List[str]:
        d = self.work_dir(member)
        return sorted(os.listdir(d)) if os.path.isdir(d) else []

    def journal(self, member: str) -> Dict[str, Any]:
        try:
            with open(os.path.join(self.work_dir(member), "journal.json")) as fh:
                doc = json.load(fh)
        except (FileNotFoundError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}


# A put_many batch: under etcd's default limits (--max-txn-ops 128, --max-request-bytes 1.5 MiB)
BATCH_OPS, BATCH_BYTES = 100, 1 << 20


def put_many(cfg: Config, prefix: str, n: int, workers: int = 4, size: int = 64, random: bool = False) -> None:
    """``n`` keys of ``size`` bytes each: ``x``s, or random bytes (values that do not compress).
    In multi-put transactions, as a bulk load does: the same keys and values as one put each, in
    a fraction of the round trips (a bed's setup filled one put at a time took tens of seconds)."""
    value = b"x" * size
    per = max(1, min(BATCH_OPS, BATCH_BYTES // max(1, size + len(prefix) + 6)))
    urls = cfg.client_urls

    def chunk(k: int) -> None:
        rpcs = [EtcdRpc(u, tls=cfg.tls, timeout=30.0) for u in urls[k % len(urls):] + urls[:k % len(urls)]]
        try:
            for start in range(k * per, n, workers * per):  # this worker's batches
                ops = [proto.op_put(f"{prefix}{i:06d}".encode(), os.urandom(size) if random else value)
                       for i in range(start, min(n, start + per))]
                for j, r in enumerate(rpcs):  # a member that is down: the next one (the puts are idempotent)
                    try:
                        r.txn(ops)
                        break
                    except EtcdUnavailable:
                        if j == len(rpcs) - 1:
                            raise
        finally:
            for r in rpcs:
                r.close()

    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(chunk, range(workers)))


def counts(cfg: Config, *prefixes: str, endpoint: Optional[str] = None) -> List[int]:
    with EtcdClient.from_config(cfg, timeout=5.0) as cl:
        return [cl.count_prefix(p, endpoint=endpoint) if endpoint else cl.count_prefix(p) for p in prefixes]


def every_member(cfg: Config, *prefixes: str) -> Dict[str, List[int]]:
    """member -> key counts of ``prefixes`` as that member serves them."""
    return {m.name: counts(cfg, *prefixes, endpoint=m.client_url) for m in cfg.members}


def revisions(cfg: Config) -> Dict[str, int]:
    with EtcdClient.from_config(cfg, timeout=3.0) as cl:
        return {m.name: cl.status(m.client_url).revision for m in cfg.members}


def wait_healthy(cfg: Config, timeout: float, members: Optional[List[str]] = None) -> float:
    t0 = time.monotonic()
    names = members or [m.name for m in cfg.members]
    last = ""
    with EtcdClient.from_config(cfg, timeout=2.0) as cl:
        while time.monotonic() - t0 < timeout:
            bad = {n: why for n in names for ok, why in [cl.healthy(cfg.member(n).client_url, timeout=2.0)] if not ok}
            if not bad:
                return time.monotonic() - t0
            last = "; ".join(f"{n}: {why}" for n, why in bad.items())
            time.sleep(0.2)
    raise AssertionError(f"not healthy after {timeout:.0f}s: {last}")


def start_static(bed: RestoreBed, h: NsHost) -> None:
    """Bootstrap a member inside its namespace with the agent's own code (the process backend
    detaches etcd into its own session, so it outlives this command)."""
    code = ("import sys\nfrom etcd_agent.config import load, with_local\nfrom etcd_agent.member.local import LocalMember\n"
            "cfg = with_local(load(sys.argv[1]), sys.argv[2])\nLocalMember(cfg, cfg.member(sys.argv[2])).start_static()\n")
    bed.net.run(h, [sys.executable, "-c", code, AGENT_TOML, h.name], timeout=60)


def wait_journal(bed: RestoreBed, member: str, step: str, proc: "subprocess.Popen[bytes]", timeout: float = 120,
                 poll: float = 0.01) -> Dict[str, Any]:
    """The member's journal once ``step`` is recorded in a running restore."""
    deadline = time.monotonic() + timeout
    while True:
        j = bed.journal(member)
        if step in j.get("steps", {}) and j.get("state") == "running":
            return j
        assert proc.poll() is None, f"restore ended (exit {proc.returncode}) before {member} reached {step}"
        assert time.monotonic() < deadline, f"{member} did not reach {step}"
        time.sleep(poll)


def retry_busy(run: Any, timeout: float = 120.0) -> Tuple["subprocess.CompletedProcess[str]", int, float]:
    """``run()`` again while it exits 4 (busy: a session of a run that is gone still ends), as an
    operator re-runs what the busy message tells it to; (last result, busy exits, seconds)."""
    t0 = time.monotonic()
    busy = 0
    while True:
        res = run()
        if res.returncode != 4 or time.monotonic() - t0 > timeout:
            return res, busy, time.monotonic() - t0
        busy += 1
        time.sleep(1.0)


def build(net: NetnsBed, work: str, cluster: str, *, etcd: str = ETCD_TOML,
          before_start: Any = None) -> RestoreBed:
    """The bed up on ``net``: namespaces, sshd, every host's config written, the cluster started and
    healthy. ``before_start(bed)`` runs once the hosts and sshd are up, before the cluster is
    bootstrapped (e.g. to run another cluster there first). The caller brings it down."""
    net.up()
    b = RestoreBed(net, work)
    for h in net.hosts:
        os.makedirs(os.path.join(h.etc_dir, "etcd-agent"), exist_ok=True)
        for sub in (f"{h.name}/backups", f"{h.name}/state"):
            os.makedirs(os.path.join(work, sub), mode=0o700, exist_ok=True)
    net.start_sshd()  # known_hosts exists from here on; the configs name it
    for h in net.hosts:
        with open(b.toml(h), "w") as fh:
            fh.write(agent_toml(work, net.hosts, h, net, cluster, etcd))
        b.cfgs[h.name] = load(b.toml(h))
    if before_start is not None:
        before_start(b)
    for h in net.hosts:
        start_static(b, h)
    wait_healthy(b.cfg(), 60)
    return b


@contextmanager
def restore_bed(tmp_path_factory: pytest.TempPathFactory, prefix: str, subnet: str, *,
                etcd: str = ETCD_TOML, before_start: Any = None) -> Iterator[RestoreBed]:
    """``build``'s bed, cluster ``prefix``, in a temp dir of its own; everything stopped by PID on
    the way out."""
    if os.geteuid() != 0:
        pytest.skip("multihost tests need root (network namespaces, sshd)")
    # `ip netns exec` can only bind /etc/netns/<ns>/etcd-agent over an existing /etc/etcd-agent
    made_etc = not os.path.exists(ETC_DIR)
    if made_etc:
        os.makedirs(ETC_DIR, mode=0o755)
    net = NetnsBed(3, prefix=prefix, subnet=subnet)
    work = str(tmp_path_factory.mktemp(prefix))
    try:
        yield build(net, work, prefix, etcd=etcd, before_start=before_start)
    finally:
        net.down()  # every process of the namespaces by PID: etcd, sshd, lock holders
        if made_etc:
            try:
                os.rmdir(ETC_DIR)
            except OSError:
                pass


def copy_into(src: str, directory: str, name: Optional[str] = None) -> str:
    """A copy of ``src`` in ``directory`` (another master's backup dir), mode 0600."""
    dst = os.path.join(directory, name or os.path.basename(src))
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o600)
    return dst
