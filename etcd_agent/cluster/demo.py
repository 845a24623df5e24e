"""The one-host demo: N members on 127.0.0.1, bootstrapped incrementally through the agent's own
code path (seed, then member add + start with state=existing), supervised until Ctrl-C.

It writes ``DIR/agent.toml`` so every other command works against it with ``-c DIR/agent.toml``.
While it supervises, it runs the daemon's continuous backup (``delta.supervisor``): one watch for
the one-host cluster, delta segments beside the full backups in ``DIR/backups``, so a rehearsal
can restore to a point in time.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from etcd_agent.config import Config, load, with_local
from etcd_agent.errors import Interrupted, RefusedError, UsageError
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.fs import makedirs
from etcd_agent.member.local import LocalMember
from etcd_agent.member.process import ProcessBackend

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.continuous.supervisor import DeltaSupervisor

log = logging.getLogger(__name__)

MAX_MEMBERS = 6  # client ports 2379, 22379, 32379, ... 62379


def ports(i: int) -> Tuple[int, int]:
    """Client and peer port of member i (0-based) as the seed document lays them out:
    2379/2380, then 22379/22380, 32379/32380, ..."""
    base = 0 if i == 0 else 10000 * (i + 1)
    return 2379 + base, 2380 + base


# Segments close this often while writes come in: a rehearsal's write is in a closed segment (and
# restorable to the second) a moment later, where a master's 5 s default would keep it waiting.
DELTA_CLOSE_SECONDS = 1.0
DELTA_IDLE_SECONDS = 5.0  # with no writes, the chain's covered time still moves every 5 s


def demo_config_text(directory: str, members: int, etcd_binary: str, etcdctl: str,
                     etcdutl: Optional[str] = None) -> str:
    d = os.path.abspath(directory)
    # etcdutl (etcd >= 3.5) is what a point-in-time restore replays with; without it the
    # continuous backup still runs, and `restore --to-time` says what is missing
    utl = [f'etcdutl = "{etcdutl}"'] if etcdutl else []
    out = [
        "# One-host demo cluster written by `etcd-agent demo`. Use it with: etcd-agent -c THIS_FILE ...",
        "[cluster]",
        'name = "demo"',
        'token = "etcd-agent-demo"',
        'bootstrap = "incremental"',
        "",
        "[etcd]",
        f'binary = "{etcd_binary}"',
        f'etcdctl = "{etcdctl}"',
        *utl,
        'service_manager = "process"',
        # the demo's dirs live wherever the operator cloned the repo (perhaps under a 0700 home):
        # its etcd runs as the user running the demo, not as the etcd user a master would use
        f'user = "{_me()[0]}"',
        f'group = "{_me()[1]}"',
        f'data_dir = "{d}/data/{{name}}.etcd"',
        f'conf_file = "{d}/conf/{{name}}.conf"',
        f'unit_file = "{d}/conf/etcd.service"',
        f'run_dir = "{d}/run"',
        "",
        # A demo is a guest on the machine: every path the agent writes is set here, under its own
        # dir, never left to a default. The defaults are a master's machine-wide places
        # (/var/lib/etcd-agent, /var/lib/etcd-agent-drill, /etc/kubernetes ...): a demo writing
        # there would hand its state (bootstrap records, restore lineage, tokens) to every other
        # demo on the machine, which then reports conf-drift against a restore it never saw.
        "[backup]",
        f'dir = "{d}/backups"',
        f'metrics_file = "{d}/metrics/etcd_agent_backup.prom"',
        f'manifest_key = "{d}/manifest.key"',  # where it was before the setting: beside agent.toml
        "",
        "[backup.delta]",
        "enabled = true",
        f"close_seconds = {DELTA_CLOSE_SECONDS:g}",
        f"idle_seconds = {DELTA_IDLE_SECONDS:g}",
        f'metrics_file = "{d}/metrics/etcd_agent_delta.prom"',
        "",
        "[daemon]",
        f'state_dir = "{d}/state"',
        "",
        "[drill]",
        f'dir = "{d}/drill"',
        f'metrics_file = "{d}/metrics/etcd_agent_drill.prom"',
        "",
        "[ssh]",
        # one host, no SSH; set anyway so nothing of the demo's even reads the machine's agent config
        f'known_hosts = "{d}/conf/known_hosts"',
        "",
        "[kubernetes]",
        'fence = "none"',  # no apiservers here; the paths below only keep a fence's files in the demo's dir
        f'manifest = "{d}/conf/kube-apiserver.yaml"',
        f'manifest_aside_dir = "{d}/conf/manifests-aside"',
        "",
    ]
    for i in range(members):
        c, p = ports(i)
        out += [
            "[[member]]",
            f'name = "s{i + 1}"',
            'host = "127.0.0.1"',
            f'client_url = "http://127.0.0.1:{c}"',
            f'peer_url = "http://127.0.0.1:{p}"',
            "",
        ]
    return "\n".join(out)


def _me() -> Tuple[str, str]:
    import grp
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(os.getegid()).gr_name


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Demo:
    """Owns the demo members' etcd processes from start to clean stop."""

    def __init__(self, directory: str, members: int, etcd_binary: str, etcdctl: str,
                 etcdutl: Optional[str] = None) -> None:
        if not 1 <= members <= MAX_MEMBERS:
            raise UsageError(f"--members must be 1..{MAX_MEMBERS} (ports 2379, 22379, ... 62379)")
        self.dir = os.path.abspath(directory)
        self.n = members
        self.config_path = os.path.join(self.dir, "agent.toml")
        self.etcd_binary = etcd_binary
        self.etcdctl = etcdctl
        self.etcdutl = etcdutl
        self.cfg: Optional[Config] = None
        self.locals: List[LocalMember] = []
        self.delta: "Optional[DeltaSupervisor]" = None
        self._stop = threading.Event()

    def prepare(self) -> bool:
        """Write (or reuse) DIR/agent.toml; True when an earlier demo's data is resumed."""
        for i in range(self.n):
            for port in ports(i):
                if not port_free(port):
                    raise RefusedError(
                        f"port {port} on 127.0.0.1 is in use (another etcd or demo?); stop it first"
                    )
        makedirs(self.dir, 0o700)
        for sub in ("data", "conf", "run", "backups", "state", "metrics"):
            makedirs(os.path.join(self.dir, sub), 0o700)
        text = demo_config_text(self.dir, self.n, self.etcd_binary, self.etcdctl, self.etcdutl)
        resumed = False
        if os.path.exists(self.config_path):
            old = load(self.config_path)
            if len(old.members) != self.n:
                raise RefusedError(
                    f"{self.config_path} describes {len(old.members)} members, not {self.n}; "
                    "use another --dir or the same --members"
                )
            resumed = any(os.path.isdir(os.path.join(old.data_dir(m.name), "member")) for m in old.members)
        from etcd_agent.fs import write_atomic

        write_atomic(self.config_path, text.encode(), mode=0o600)
        self.cfg = load(self.config_path)
        self.locals = [
            LocalMember(with_local(self.cfg, m.name), m, ProcessBackend(self.cfg, m.name)) for m in self.cfg.members
        ]
        return resumed

    def bootstrap(self, progress: Callable[[str], None]) -> float:
        """Start the cluster; returns seconds until every member was healthy."""
        assert self.cfg is not None
        t0 = time.monotonic()
        timeout = self.cfg.etcd.start_timeout
        if all(lm.has_data() for lm in self.locals):
            for lm in self.locals:
                progress(f"{lm.member.name}: starting from its data dir")
                lm.start_existing()
            for lm in self.locals:
                lm.wait_healthy(timeout, cancel=self._stop.is_set)
            return time.monotonic() - t0
        if any(lm.has_data() for lm in self.locals):
            raise RefusedError(
                f"{self.dir}/data holds data for some members only; remove {self.dir} to start a fresh demo"
            )
        seed = self.locals[0]
        self._check_stop()
        progress(f"{seed.member.name}: seed member, state=new")
        seed.start_seed()
        seed.wait_healthy(timeout, cancel=self._stop.is_set)
        with EtcdClient.from_config(self.cfg, [seed.member.client_url], timeout=5.0) as client:
            for lm in self.locals[1:]:
                self._check_stop()
                progress(f"{lm.member.name}: member add, then start with state=existing")
                info = lm.join(client)
                lm.wait_healthy(timeout, cancel=self._stop.is_set)
                progress(f"{lm.member.name}: joined as {info.hex_id}")
                client.endpoints = [m.member.client_url for m in self.locals if m.backend.is_active()]
        return time.monotonic() - t0

    def start_continuous_backup(self) -> None:
        """The daemon's continuous backup, as ``etcd-agent run`` runs it on a master: one
        supervisor, watching the seed member (every member here shares ``DIR/backups``: one
        watch covers the cluster, as the watcher's lock would make it on a one-host cluster of
        daemons). It takes the first full backup itself, keeps its hands off while a restore is
        journaled for the member, and starts a new chain for the restored cluster afterwards."""
        from etcd_agent.continuous.supervisor import DeltaSupervisor

        assert self.cfg is not None
        watched = with_local(self.cfg, self.cfg.members[0].name)
        me = watched.member(self.cfg.members[0].name)
        self.delta = DeltaSupervisor(lambda: (watched, me))
        self.delta.start()

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise Interrupted("interrupted while bootstrapping")

    def supervise(self, report: Callable[[str], None], interval: float = 1.0) -> None:
        """Keep the members running until asked to stop: a crashed etcd is started again, like
        systemd's Restart=on-failure, at most once per 5 s per member - and, like the daemon on a
        master, never a member a restore or an upgrade stopped on purpose (their markers)."""
        last_restart = {lm.member.name: 0.0 for lm in self.locals}
        paused: Dict[str, str] = {}
        while not self._stop.wait(interval):
            for lm in self.locals:
                why = hands_off(lm.cfg, lm.member.name)
                if why:
                    if paused.get(lm.member.name) != why:
                        report(f"{lm.member.name}: {why}; hands off")
                        paused[lm.member.name] = why
                    continue
                if paused.pop(lm.member.name, None):
                    report(f"{lm.member.name}: supervising again")
                    last_restart[lm.member.name] = time.monotonic()  # let the operation's own start settle
                if lm.backend.is_active():
                    continue
                now = time.monotonic()
                if now - last_restart[lm.member.name] < 5:
                    continue
                last_restart[lm.member.name] = now
                if not lm.has_data():
                    report(f"{lm.member.name}: etcd is down and its data dir is gone; not restarting")
                    continue
                report(f"{lm.member.name}: etcd exited; restarting it")
                try:
                    lm.start_existing()
                except Exception as exc:  # keep supervising the others
                    report(f"{lm.member.name}: restart failed: {exc}")

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def stop_all(self) -> None:
        if self.delta is not None:  # first: its watch would otherwise see the members go as an outage
            try:
                self.delta.stop()
            except Exception as exc:
                log.error("stopping the continuous backup failed: %s", exc)
        for lm in reversed(self.locals):
            try:
                lm.backend.stop()
            except Exception as exc:
                log.error("stopping %s failed: %s", lm.member.name, exc)


def hands_off(cfg: Config, member: str) -> str:
    """Why nothing may restart ``member`` now ("" when something may): the same markers the
    daemon's decision reads (a restore in progress, a live upgrade step)."""
    from etcd_agent.state import markers

    rec = markers.read_restore(cfg, member)
    if rec is not None:
        return f"restore {rec.op} in progress"
    up = markers.upgrading(cfg, member)
    if up is not None:
        return f"upgrade to {up.version} in progress"
    return ""


def install_signal_handlers(demo: Demo) -> None:
    """SIGINT/SIGTERM set the stop flag; the main thread notices it between steps and stops every
    member in order. Raising from the handler could land between starting an etcd and recording
    its pid, leaving an untracked etcd behind; only a second signal interrupts at once."""

    def handler(signum: int, _frame: object) -> None:
        if demo.stop_requested:
            raise KeyboardInterrupt
        demo.request_stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
