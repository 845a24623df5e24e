"""Test "hosts" as network namespaces on one bridge, each with its own IP (and optionally sshd).

Host i (1-based) is namespace ``f"{prefix}{i}"`` with address ``f"{subnet}.{10 + i}"`` on its
``eth0``; the root namespace holds ``f"{subnet}.1"`` on the bridge, so tests talk to every host from
here. No forwarding, no NAT: the subnet is isolated. ``ip netns exec`` bind-mounts
``/etc/netns/<ns>/*`` over ``/etc/*``, which gives every host its own ``/etc`` files.

Everything is named after the prefix, so several beds (different prefixes *and* subnets) can
coexist, and leftovers of a crashed run with the same prefix are found and removed at ``up()``.
Every process is stopped by PID (``ip netns pids``), never by name. Needs root.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import psutil

log = logging.getLogger(__name__)

SSHD = "/usr/sbin/sshd"
# interface names are limited to 15 characters: "veth-" + prefix + index must fit
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,6}$")
SUBNET_RE = re.compile(r"^(\d{1,3})\.(\d{1,3})\.(\d{1,3})$")


@dataclass
class NsHost:
    """One namespace host."""

    name: str
    netns: str
    ip: str
    etc_dir: str  # /etc/netns/<netns>, bind-mounted over /etc/* inside the namespace


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one `ip` command (argv, no shell); failures raise with ip's own message."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _netns_pids(netns: str) -> List[int]:
    proc = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


class NetnsBed:
    """N namespace hosts on one bridge; a context manager (``up`` on enter, ``down`` on exit)."""

    def __init__(
        self,
        n: int,
        *,
        prefix: str = "ea",
        subnet: str = "10.213.0",
        bridge: Optional[str] = None,
        workdir: Optional[str] = None,
    ) -> None:
        if not PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r} must match {PREFIX_RE.pattern}")
        m = SUBNET_RE.match(subnet)
        if not m or any(int(x) > 255 for x in m.groups()):
            raise ValueError(f"subnet {subnet!r} must be three octets like 10.213.0")
        if not 1 <= n <= 200:
            raise ValueError("n must be 1..200")
        self.n = n
        self.prefix = prefix
        self.subnet = subnet
        self.bridge = bridge or f"br-{prefix}"
        self.workdir = workdir or f"/var/tmp/etcd-agent-tb/{prefix}"
        self.gateway = f"{subnet}.1"
        self.hosts: List[NsHost] = [
            NsHost(f"{prefix}{i}", f"{prefix}{i}", f"{subnet}.{10 + i}", f"/etc/netns/{prefix}{i}")
            for i in range(1, n + 1)
        ]
        self.known_hosts = os.path.join(self.workdir, "ssh", "known_hosts")
        self.client_key = os.path.join(self.workdir, "ssh", "id_ed25519")
        self._procs: List[subprocess.Popen] = []
        self._sshd: Dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> "NetnsBed":
        self.up()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def veth(self, host: NsHost) -> str:
        """The root-side end of the host's veth pair (on the bridge)."""
        return f"veth-{host.netns}"

    def host(self, name: str) -> NsHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def up(self) -> None:
        """Create bridge, namespaces, veths, addresses and /etc/netns files."""
        if os.geteuid() != 0:
            raise PermissionError("network-namespace hosts need root")
        self._cleanup()  # leftovers of a crashed run with the same prefix
        self._check_subnet_free()
        os.makedirs(self.workdir, mode=0o700, exist_ok=True)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for h in self.hosts:
                self._add_host(h)
        except BaseException:
            self.down()
            raise
        log.info("netns bed %s up: %s", self.prefix, ", ".join(f"{h.netns}={h.ip}" for h in self.hosts))

    def _add_host(self, h: NsHost) -> None:
        _ip("netns", "add", h.netns)
        _ip("link", "add", self.veth(h), "type", "veth", "peer", "name", "eth0", "netns", h.netns)
        _ip("link", "set", self.veth(h), "master", self.bridge, "up")
        _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        _ip("-n", h.netns, "link", "set", "lo", "up")
        _ip("-n", h.netns, "link", "set", "eth0", "up")
        _ip("-n", h.netns, "route", "add", "default", "via", self.gateway)
        os.makedirs(h.etc_dir, exist_ok=True)
        with open(os.path.join(h.etc_dir, "hostname"), "w") as fh:
            fh.write(h.name + "\n")
        with open(os.path.join(h.etc_dir, "hosts"), "w") as fh:
            fh.write("127.0.0.1 localhost\n")
            fh.writelines(f"{o.ip} {o.name}\n" for o in self.hosts)

    def _check_subnet_free(self) -> None:
        """Refuse to share a subnet with another bed: two bridges with one address break routing."""
        out = _ip("-4", "-o", "addr", "show", check=False).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[3].startswith(f"{self.subnet}."):
                raise RuntimeError(
                    f"subnet {self.subnet}.0/24 is already used on {parts[1]}: pick another subnet"
                )

    def down(self) -> None:
        """Stop every process in the namespaces (by PID), then delete veths, netns, bridge, dirs.

        Idempotent; it works from names alone, so it also cleans a bed that never came up fully.
        """
        self._cleanup()
        self._procs.clear()
        self._sshd.clear()

    def _own_netns(self) -> List[str]:
        pat = re.compile(rf"^{re.escape(self.prefix)}\d+$")
        names = {h.netns for h in self.hosts}
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if pat.match(name):
                names.add(name)
        return sorted(names)

    def _cleanup(self) -> None:
        namespaces = self._own_netns()
        self._stop_pids(namespaces)
        # delete the root-side veths first: a deleted namespace can linger and keep its veth
        pat = re.compile(rf"^veth-{re.escape(self.prefix)}\d+$")
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            parts = line.split(":")
            if len(parts) > 1:
                name = parts[1].strip().split("@")[0]
                if pat.match(name):
                    _ip("link", "del", name, check=False)
        for ns in namespaces:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if os.path.isdir("/etc/netns"):
            epat = re.compile(rf"^{re.escape(self.prefix)}\d+$")
            for name in os.listdir("/etc/netns"):
                if epat.match(name):
                    shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _stop_pids(self, namespaces: Sequence[str], timeout: float = 5.0) -> None:
        """TERM, wait, KILL every process of these namespaces; wait on our own children."""
        self._signal_all(namespaces, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self._procs:
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while time.monotonic() < deadline and any(_netns_pids(ns) for ns in namespaces):
            time.sleep(0.05)
        self._signal_all(namespaces, signal.SIGKILL)
        for p in self._procs:
            try:
                p.kill()
            except OSError:
                pass
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not exit after SIGKILL", p.pid)

    @staticmethod
    def _signal_all(namespaces: Sequence[str], sig: int) -> None:
        for ns in namespaces:
            for pid in _netns_pids(ns):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------ processes

    def exec_argv(self, host: NsHost, argv: Sequence[str]) -> List[str]:
        """argv that runs ``argv`` inside the host's namespace (and its /etc/netns files)."""
        return ["ip", "netns", "exec", host.netns, *argv]

    def popen(self, host: NsHost, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` in the host; the process is tracked and stopped by ``down()``."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self.exec_argv(host, argv), **kw)
        self._procs.append(proc)
        return proc

    def run(self, host: NsHost, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run ``argv`` in the host to completion (for setup steps in tests)."""
        return subprocess.run(
            self.exec_argv(host, argv), capture_output=True, text=True, timeout=timeout, check=True
        )

    def set_link(self, host: NsHost, up: bool) -> None:
        """Partition (``False``) or reconnect (``True``) a host by its root-side veth."""
        _ip("link", "set", self.veth(host), "up" if up else "down")

    def reset_peers(self, host: NsHost) -> None:
        """Abort every TCP connection between ``host`` and the other hosts, on both ends
        (``ss -K``). After a cut of a minute, connections opened before it (etcd's peer streams)
        otherwise linger in TCP's retransmission backoff and break one by one for minutes: a
        test that healed the link hands the next one a bed whose reads through ``host`` can
        still time out. Aborted, they are opened again at once."""
        for other in self.hosts:
            if other is host:
                continue
            for where, peer in ((other, host.ip), (host, other.ip)):
                subprocess.run(self.exec_argv(where, ["ss", "-K", "dst", peer]), capture_output=True, timeout=30)

    # ------------------------------------------------------------ sshd

    def _ssh_dir(self, host: Optional[NsHost] = None) -> str:
        base = os.path.join(self.workdir, "ssh")
        return os.path.join(base, host.netns) if host else base

    def start_sshd(self) -> None:
        """One sshd per host on <ip>:22 with its own ed25519 host key; writes known_hosts and the
        client key (authorized for root on every host)."""
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation dir
        os.makedirs(self._ssh_dir(), mode=0o700, exist_ok=True)
        if not os.path.exists(self.client_key):
            _keygen(self.client_key, "etcd-agent-test")
        for h in self.hosts:
            self._write_sshd_files(h)
        for h in self.hosts:
            self._launch_sshd(h)
        for h in self.hosts:
            self._wait_sshd(h)
        lines = [f"{h.ip} {self.host_public_key(h)}\n" for h in self.hosts]
        with open(self.known_hosts, "w") as fh:
            fh.writelines(lines)

    def host_public_key(self, host: NsHost) -> str:
        """``"<type> <base64>"`` of the host's sshd key, as known_hosts wants it."""
        with open(os.path.join(self._ssh_dir(host), "ssh_host_ed25519_key.pub")) as fh:
            return " ".join(fh.read().split()[:2])

    def _write_sshd_files(self, h: NsHost) -> None:
        d = self._ssh_dir(h)
        os.makedirs(d, mode=0o700, exist_ok=True)
        key = os.path.join(d, "ssh_host_ed25519_key")
        if not os.path.exists(key):
            _keygen(key, h.name)
        shutil.copyfile(self.client_key + ".pub", os.path.join(d, "authorized_keys"))
        os.chmod(os.path.join(d, "authorized_keys"), 0o600)
        with open(os.path.join(d, "sshd_config"), "w") as fh:
            fh.write(
                f"ListenAddress {h.ip}:22\n"
                f"HostKey {key}\n"
                f"PidFile {d}/sshd.pid\n"
                f"AuthorizedKeysFile {d}/authorized_keys\n"
                # the key dir sits under /var/tmp: StrictModes would refuse it
                "StrictModes no\n"
                "PermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\n"
                "Subsystem sftp internal-sftp\n"
            )

    def _launch_sshd(self, h: NsHost) -> None:
        d = self._ssh_dir(h)
        with open(os.path.join(d, "sshd.log"), "ab") as logf:
            # own UTS namespace so `hostname` says the host's name inside SSH sessions;
            # the name and sshd argv are positional parameters, never spliced into the script
            argv = [
                "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', h.name,
                SSHD, "-D", "-e", "-f", os.path.join(d, "sshd_config"),
            ]
            self._sshd[h.netns] = self.popen(h, argv, stdout=logf, stderr=subprocess.STDOUT)

    def _wait_sshd(self, h: NsHost, timeout: float = 10.0) -> None:
        proc = self._sshd[h.netns]
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((h.ip, 22), timeout=0.5) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"sshd on {h.name} exited {proc.returncode}: {self.sshd_log(h)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {h.name} not listening after {timeout}s: {self.sshd_log(h)}")
            time.sleep(0.05)

    def run_in_sshd_mounts(self, host: NsHost, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run ``argv`` in the mount namespace of the host's sshd: a mount made there is what the
        host's SSH sessions see (each ``ip netns exec`` makes a namespace of its own, and / is
        private, so a mount made anywhere else never reaches them)."""
        proc = self._sshd[host.netns]
        return subprocess.run(["nsenter", "-t", str(proc.pid), "-m", "--", *argv], capture_output=True, text=True,
                              timeout=timeout, check=True)

    def shape(self, host: NsHost, rate: Optional[str]) -> None:
        """Cap what reaches the host at ``rate`` (tc tbf, e.g. "40mbit"), or lift the cap (None)."""
        dev = self.veth(host)
        if rate is None:
            subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
            return
        subprocess.run(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                        "latency", "50ms"], capture_output=True, text=True, timeout=30, check=True)

    def sshd_log(self, host: NsHost) -> str:
        try:
            with open(os.path.join(self._ssh_dir(host), "sshd.log"), errors="replace") as fh:
                return fh.read()[-2000:]
        except FileNotFoundError:
            return ""

    def stop_sshd(self, host: NsHost) -> None:
        """Stop the host's sshd and its session processes (by PID: the listener's descendants)."""
        proc = self._sshd.pop(host.netns, None)
        if proc is None:
            return
        try:
            victims = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            victims = []
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.kill()
        proc.wait(timeout=10)
        psutil.wait_procs(victims, timeout=5)

    def restart_sshd(self, host: NsHost) -> None:
        """Stop and start the host's sshd (same host key)."""
        self.stop_sshd(host)
        self._launch_sshd(host)
        self._wait_sshd(host)


def _keygen(path: str, comment: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", path],
        check=True, timeout=30, stdin=subprocess.DEVNULL,
    )
