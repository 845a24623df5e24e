"""Test hosts that boot real systemd: nspawn containers on overlay clones of the base tree.

Each container gets an overlayfs clone of the cached base tree (tests/harness/rootfs.py) with the
cached etcd releases layer above it (/opt/etcd/<version>: 3.4.23 linked to the tree's own etcd,
3.5.16, 3.5.30), its own hostname, /etc/hosts, machine-id and ssh host keys, and boots `systemd-nspawn -b` inside a network
namespace of a NetnsBed. This machine has no systemd as PID 1 and no machined, hence
`--register=no --keep-unit` and one cgroup per container (machine.slice/NAME) made by hand:
without it, the containers' systemd instances kill each other's services (status=219/CGROUP).
Commands run inside through `nsenter -t <container PID 1> -a`.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Dict, List, Optional, Sequence, Tuple

import psutil

from .rootfs import BASE_DIR, DEPS_VENV, ensure_releases_layer, lock_path, mounts_under, remove_tree

log = logging.getLogger(__name__)

RUN_ROOT = "/var/tmp/etcd-agent-tb"
# What a command run inside sees: never the test runner's environment.
INNER_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
}
# Files of the project copied into a container for `pip install` (the product ships as an RPM;
# this tier runs the agent from the current source).
SOURCE_ITEMS = ("pyproject.toml", "README.md", "etcd_agent")
# Mounted by systemd or nspawn inside: files the host writes beneath them through the overlay
# are invisible to the container.
INNER_MOUNTS = ("tmp", "run", "dev", "proc", "sys")


def cgroup_roots() -> List[str]:
    """Mounted hierarchies a container cgroup must exist in: v1 name=systemd and cgroup2."""
    roots = []
    with open("/proc/self/mounts", encoding="utf-8") as f:
        for line in f:
            _src, mnt, fstype, opts = line.split()[:4]
            if fstype == "cgroup2" or (fstype == "cgroup" and "name=systemd" in opts.split(",")):
                roots.append(mnt)
    return roots


def _cgroup_pids(path: str) -> List[int]:
    pids: List[int] = []
    for dirpath, _dirs, files in os.walk(path):
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(dirpath, "cgroup.procs"), encoding="utf-8") as f:
                    pids.extend(int(x) for x in f.read().split())
            except OSError:
                pass
    return sorted(set(pids))


def _rmdir_tree(path: str) -> None:
    """Remove a cgroup directory tree, deepest first (cgroup dirs only go with rmdir)."""
    if not os.path.isdir(path):
        return
    for dirpath, _dirs, _files in sorted(os.walk(path), key=lambda t: len(t[0]), reverse=True):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass


class InnerCommandError(subprocess.CalledProcessError):
    """A command inside a container failed; the message carries its stderr's tail."""

    def __init__(self, host: str, result: "subprocess.CompletedProcess[str]") -> None:
        super().__init__(result.returncode, result.args, result.stdout, result.stderr)
        self.host = host

    def __str__(self) -> str:
        tail = "\n".join((self.stderr or self.stdout or "").strip().splitlines()[-15:])
        return f"{self.host}: {super().__str__()}\n{tail}"


class Container:
    """One nspawn host: prepare() the overlay clone, boot(), exec(), stop(). Idempotent."""

    def __init__(self, name: str, *, run_dir: str, base: str = BASE_DIR,
                 netns: Optional[str] = None, ip: Optional[str] = None,
                 hosts: Sequence[Tuple[str, str]] = (), authorized_key: Optional[str] = None,
                 layers: Sequence[str] = ()) -> None:
        self.name = name
        self.base = base
        self.layers = list(layers)  # read-only trees above the base (topmost first)
        self.netns = netns
        self.ip = ip
        self.hosts = list(hosts)
        self.authorized_key = authorized_key
        self.dir = os.path.join(run_dir, name)
        self.root = os.path.join(self.dir, "root")
        self.upper = os.path.join(self.dir, "upper")
        self.work = os.path.join(self.dir, "work")
        self.log_path = os.path.join(self.dir, "nspawn.log")
        self.proc: Optional[subprocess.Popen] = None
        self.leader: Optional[int] = None
        self.host_keys: List[str] = []  # "type base64" lines of the fresh ssh host keys
        self.boot_seconds = 0.0
        self._stop_requested = False

    # -- lifecycle -------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Mount the overlay clone and give it its identity. Leftovers of a dead run go first."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name} is running: stop() before prepare()")
        self._cleanup_files()
        for d in (self.root, self.upper, self.work):
            os.makedirs(d, exist_ok=True)
        lower = ":".join([*self.layers, self.base])
        opts = f"lowerdir={lower},upperdir={self.upper},workdir={self.work}"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, self.root],
                       check=True, capture_output=True, timeout=30)
        etc = os.path.join(self.root, "etc")
        with open(os.path.join(etc, "hostname"), "w", encoding="utf-8") as f:
            f.write(self.name + "\n")
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{ip} {name}" for name, ip in self.hosts]
        with open(os.path.join(etc, "hosts"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        # a fresh id per host: with an empty file, systemd inside nspawn-on-a-VM derives the same
        # id for every container (and takes the boot for a first boot, running preset-all)
        with open(os.path.join(etc, "machine-id"), "w", encoding="utf-8") as f:
            f.write(uuid.uuid4().hex + "\n")
        subprocess.run(["chroot", self.root, "ssh-keygen", "-A"], check=True,
                       capture_output=True, timeout=60, env=INNER_ENV)
        self.host_keys = []
        for pub in sorted(os.listdir(os.path.join(etc, "ssh"))):
            if pub.startswith("ssh_host_") and pub.endswith(".pub"):
                with open(os.path.join(etc, "ssh", pub), encoding="utf-8") as f:
                    self.host_keys.append(" ".join(f.read().split()[:2]))
        if self.authorized_key:
            ssh_dir = os.path.join(self.root, "root/.ssh")
            os.makedirs(ssh_dir, mode=0o700, exist_ok=True)
            auth = os.path.join(ssh_dir, "authorized_keys")
            with open(auth, "w", encoding="utf-8") as f:
                f.write(self.authorized_key.strip() + "\n")
            os.chmod(auth, 0o600)

    def start(self) -> None:
        """Start systemd-nspawn in the container's own cgroup (does not wait for the boot)."""
        if self.proc is not None:
            return
        if not os.path.ismount(self.root):
            self.prepare()
        self._t_start = time.monotonic()
        cgroups = []
        for root in cgroup_roots():
            cg = os.path.join(root, "machine.slice", self.name)
            os.makedirs(cg, exist_ok=True)
            cgroups.append(os.path.join(cg, "cgroup.procs"))

        def join_cgroup() -> None:  # runs in the child between fork and exec
            for procs in cgroups:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))

        argv = ["systemd-nspawn", "-D", self.root, "-M", self.name, "-b", "--console=pipe",
                # no machined and no host systemd: without these two, "Failed to open system bus"
                "--register=no", "--keep-unit"]
        if self.netns:
            argv.append(f"--network-namespace-path=/run/netns/{self.netns}")
        logf = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, preexec_fn=join_cgroup,
                                         start_new_session=True)
        finally:
            logf.close()
        self._stop_requested = False
        log.info("%s: systemd-nspawn pid %d", self.name, self.proc.pid)

    def wait_booted(self, timeout: float = 90.0) -> str:
        """Wait until systemd inside says running or degraded; return that state."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: systemd-nspawn exited {self.proc.returncode}:\n"
                                   + self.log_tail())
            if self.leader is None:
                self.leader = self._find_leader()
            if self.leader is not None:
                state = self.exec(["systemctl", "is-system-running"], timeout=10).stdout.strip()
                if state in ("running", "degraded"):
                    self.boot_seconds = time.monotonic() - self._t_start
                    if state == "degraded":
                        failed = self.exec(["systemctl", "--failed", "--no-legend"], timeout=10)
                        log.warning("%s degraded: %s", self.name, failed.stdout.strip())
                    return state
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: not booted after {timeout:.0f} s (state {state!r}):\n"
                           + self.log_tail())

    def boot(self, timeout: float = 90.0) -> str:
        """prepare (if needed), start and wait for the boot."""
        self.start()
        return self.wait_booted(timeout)

    def request_stop(self) -> None:
        """Ask for a clean poweroff: nspawn turns SIGTERM into SIGRTMIN+3 for the inner systemd."""
        # only once: nspawn takes a second SIGTERM as "kill the container now"
        if self.proc is not None and self.proc.poll() is None and not self._stop_requested:
            self._stop_requested = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop by escalation (TERM, wait, TERM, KILL), then remove cgroups, mount and files."""
        if self.proc is not None:
            self.request_stop()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)  # a second TERM is immediate
                try:
                    self.proc.wait(3)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            if self.proc.returncode == 0:
                log.info("%s: systemd-nspawn exited 0", self.name)
            else:
                log.warning("%s: systemd-nspawn exited %s:\n%s", self.name,
                            self.proc.returncode, self.log_tail())
            self.proc = None
        self.leader = None
        self._kill_cgroup()
        self._cleanup_files()

    def power_cut(self) -> None:
        """A node death: every process of the container SIGKILLed at once (cgroup.kill: nspawn,
        the inner systemd and all services, no shutdown). The disk - the overlay clone - stays
        mounted, so ``boot()`` brings the same host back, as a reboot would."""
        if self.proc is None:
            return
        killed = False
        for root in cgroup_roots():
            path = os.path.join(root, "machine.slice", self.name, "cgroup.kill")
            if os.path.exists(path):  # cgroup2 on Linux 5.14+: atomic, nothing forks away
                with open(path, "w", encoding="utf-8") as f:
                    f.write("1")
                killed = True
        if not killed:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        log.info("%s: power cut (systemd-nspawn exit %s)", self.name, self.proc.returncode)
        self.proc = None
        self.leader = None
        self._kill_cgroup()  # stragglers, and the cgroup dirs the next boot makes afresh

    def __enter__(self) -> "Container":
        try:
            self.boot()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- inside the container --------------------------------------------------------------------
    def exec(self, argv: Sequence[str], timeout: float = 60.0, check: bool = False,
             input: Optional[str] = None) -> "subprocess.CompletedProcess[str]":
        """Run argv inside every namespace of the container; a timeout kills the whole group."""
        if self.leader is None:
            raise RuntimeError(f"{self.name} is not running")
        full = ["nsenter", "-t", str(self.leader), "-a", *argv]
        proc = subprocess.Popen(full, stdin=subprocess.PIPE if input is not None else
                                subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=INNER_ENV,
                                start_new_session=True)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            # nsenter forks to enter the pid namespace: kill the group, not only nsenter
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and result.returncode != 0:
            raise InnerCommandError(self.name, result)
        return result

    def systemctl(self, *args: str, timeout: float = 60.0, check: bool = False
                  ) -> "subprocess.CompletedProcess[str]":
        return self.exec(["systemctl", *args], timeout=timeout, check=check)

    def write_file(self, path: str, content: str, mode: int = 0o644) -> None:
        """Write a file into the container's tree (from the host side, through the overlay)."""
        if not path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"need an absolute path without '..': {path}")
        if path.split("/")[1] in INNER_MOUNTS:
            raise ValueError(f"{path}: a mount inside the container hides it; use exec()")
        full = os.path.join(self.root, path.lstrip("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        tmp = full + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(content)
        os.chmod(tmp, mode)
        os.replace(tmp, full)

    def install_agent(self, src_dir: str, timeout: float = 300.0
                      ) -> "subprocess.CompletedProcess[str]":
        """Install the project from src_dir into the deps venv; /usr/bin/etcd-agent runs it."""
        # not /tmp or /run: those are tmpfs mounts inside, hiding what the host writes below them
        inner_src = "/var/tmp/etcd-agent-src"
        dest = os.path.join(self.root, inner_src.lstrip("/"))
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
        for item in SOURCE_ITEMS:
            src = os.path.join(src_dir, item)
            if os.path.isdir(src):
                shutil.copytree(src, os.path.join(dest, item), ignore=ignore)
            elif os.path.exists(src):
                shutil.copy2(src, dest)
        try:
            res = self.exec([DEPS_VENV + "/bin/pip", "install", "-q", "--no-deps", "--no-index",
                             "--no-build-isolation", "--force-reinstall", inner_src],
                            timeout=timeout, check=True)
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        link = os.path.join(self.root, "usr/bin/etcd-agent")
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(DEPS_VENV + "/bin/etcd-agent", link)
        return res

    # -- observation -----------------------------------------------------------------------------
    def pids(self) -> List[int]:
        """Every process in the container's cgroup tree (the nspawn process included)."""
        pids: List[int] = []
        for root in cgroup_roots():
            pids.extend(_cgroup_pids(os.path.join(root, "machine.slice", self.name)))
        return sorted(set(pids))

    def pss_bytes(self) -> int:
        """Proportional memory of the container's processes (shared pages split fairly)."""
        total = 0
        for pid in self.pids():
            try:
                total += psutil.Process(pid).memory_full_info().pss
            except (psutil.Error, AttributeError):
                pass
        return total

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    # -- internals -------------------------------------------------------------------------------
    def _find_leader(self) -> Optional[int]:
        """The container's PID 1 as seen from here: nspawn's child that exec'd systemd."""
        assert self.proc is not None
        try:
            for child in psutil.Process(self.proc.pid).children():
                if child.name() == "systemd":
                    return child.pid
        except psutil.Error:
            pass
        return None

    def _kill_cgroup(self) -> None:
        """KILL whatever is left in the container's cgroups (our own processes), then rmdir them."""
        deadline = time.monotonic() + 10
        while True:
            left = self.pids()
            if not left or time.monotonic() > deadline:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if left:
            log.warning("%s: processes survive in its cgroup: %s", self.name, left)
        for root in cgroup_roots():
            _rmdir_tree(os.path.join(root, "machine.slice", self.name))
            try:
                os.rmdir(os.path.join(root, "machine.slice"))  # only when no one else uses it
            except OSError:
                pass
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.name}", ignore_errors=True)

    def _cleanup_files(self) -> None:
        """Unmount the overlay (and anything below it) and delete the run dir."""
        if os.path.lexists(self.dir):
            for mnt in mounts_under(self.dir):
                r = subprocess.run(["umount", mnt], capture_output=True, timeout=30)
                if r.returncode != 0:
                    subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=30)
            remove_tree(self.dir)


class NspawnBed:
    """N containers booting systemd, each in one network namespace of a NetnsBed.

    Host i is container and namespace ``f"{prefix}{i}"`` at ``f"{subnet}.{10 + i}"``; root in every
    container accepts ``client_key``; ``known_hosts`` lists every container's fresh host keys.
    """

    def __init__(self, n: int = 3, *, prefix: str = "es", subnet: str = "10.213.2",
                 base: str = BASE_DIR, run_dir: Optional[str] = None, releases: bool = True) -> None:
        from .netns import NetnsBed  # the namespaces: bridge, veths, addresses

        self.net = NetnsBed(n, prefix=prefix, subnet=subnet)
        self.prefix = prefix
        self.base = base
        # not under the NetnsBed's workdir: its cleanup deletes that tree without unmounting
        self.run_dir = run_dir or os.path.join(RUN_ROOT, f"nspawn-{prefix}")
        self.client_key = self.net.client_key
        self.known_hosts = self.net.known_hosts
        pairs = [(h.name, h.ip) for h in self.net.hosts]
        self.containers: List[Container] = [
            Container(h.name, run_dir=self.run_dir, base=base, netns=h.netns, ip=h.ip, hosts=pairs)
            for h in self.net.hosts
        ]
        self.timings: Dict[str, float] = {}
        self.releases = releases  # mount the etcd releases layer (tests/harness/rootfs.py)
        self.releases_layer: Optional[str] = None
        self._base_lock: Optional[IO[str]] = None
        # units stopped host by host before the poweroff (patterns match loaded units only)
        self.stop_first: Tuple[str, ...] = ("etcd*.service",)

    def container(self, name: str) -> Container:
        for c in self.containers:
            if c.name == name:
                return c
        raise KeyError(name)

    def __getitem__(self, index: int) -> Container:
        return self.containers[index]

    def __len__(self) -> int:
        return len(self.containers)

    def __enter__(self) -> "NspawnBed":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self, boot_timeout: float = 120.0) -> None:
        """Namespaces, clones, keys, then boot every container (in parallel) to running."""
        if os.geteuid() != 0:
            raise PermissionError("nspawn hosts need root")
        if not os.path.isdir(os.path.join(self.base, "usr")):
            raise RuntimeError(f"no base tree at {self.base}: python -m tests.harness.rootfs")
        t0 = time.monotonic()
        self._stop_containers()  # leftovers of a crashed run with the same prefix
        if self.releases:  # made (exclusively) before this bed takes the base tree shared
            layer = ensure_releases_layer(base=self.base)
            self.releases_layer = layer.path
            if layer.built:
                self.timings["releases_layer"] = layer.seconds
        # a rebuild of the base tree under mounted overlays would pull the floor from under them
        self._base_lock = open(lock_path(self.base), "a")
        fcntl.flock(self._base_lock, fcntl.LOCK_SH)
        try:
            if self.releases_layer is not None:
                if not os.path.isdir(self.releases_layer):  # replaced between the two locks
                    raise RuntimeError(f"releases layer {self.releases_layer} vanished: another session "
                                       "made a layer of another release list; re-run")
                for c in self.containers:
                    c.layers = [self.releases_layer]
            self.net.up()
            self.timings["netns_up"] = time.monotonic() - t0
            os.makedirs(os.path.dirname(self.client_key), mode=0o700, exist_ok=True)
            if not os.path.exists(self.client_key):
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                                f"etcd-agent-{self.prefix}", "-f", self.client_key],
                               check=True, timeout=30, stdin=subprocess.DEVNULL)
            with open(self.client_key + ".pub", encoding="utf-8") as f:
                pub = f.read()
            t1 = time.monotonic()
            for c in self.containers:
                c.authorized_key = pub
            # ssh-keygen -A (an RSA key each) dominates: make the clones side by side
            with ThreadPoolExecutor(max_workers=len(self.containers)) as pool:
                list(pool.map(lambda c: c.prepare(), self.containers))
            with open(self.known_hosts, "w", encoding="utf-8") as f:
                for c in self.containers:
                    f.writelines(f"{c.ip},{c.name} {key}\n" for key in c.host_keys)
            self.timings["prepare"] = time.monotonic() - t1
            t2 = time.monotonic()
            for c in self.containers:
                c.start()
            for c in self.containers:
                c.wait_booted(boot_timeout)
            self.timings["boot_all"] = time.monotonic() - t2
        except BaseException:
            self.down()
            raise
        self.timings["up"] = time.monotonic() - t0
        log.info("nspawn bed %s up in %.1f s", self.prefix, self.timings["up"])

    def down(self) -> None:
        """Stop every container (poweroff requested for all at once), then the namespaces."""
        t0 = time.monotonic()
        try:
            self._stop_containers()
        finally:
            self.net.down()
            if self._base_lock is not None:
                self._base_lock.close()  # releases the shared lock
                self._base_lock = None
        try:
            os.rmdir(self.run_dir)
        except OSError:
            pass
        self.timings["down"] = time.monotonic() - t0

    def _stop_containers(self) -> None:
        # Members stopped all at once by the poweroff each wait seconds for a leader transfer to
        # peers that are going too (7 s measured); stopped one host after another they take 0.2 s.
        for c in self.containers:
            if c.leader is not None and c.proc is not None and c.proc.poll() is None:
                try:
                    c.systemctl("stop", *self.stop_first, timeout=30)
                except subprocess.TimeoutExpired:
                    log.warning("%s: stopping %s timed out", c.name, " ".join(self.stop_first))
        for c in self.containers:
            c.request_stop()
        errors = []
        for c in self.containers:
            try:
                c.stop()
            except Exception as e:  # keep cleaning the others; report at the end
                errors.append(f"{c.name}: {e}")
        if errors:
            raise RuntimeError("teardown incomplete: " + "; ".join(errors))

    def install_agent(self, src_dir: str) -> None:
        """Install the project source into every container."""
        for c in self.containers:
            c.install_agent(src_dir)

    def endpoints(self, port: int = 2379) -> str:
        """Comma-separated client URLs of every host, for etcdctl --endpoints."""
        return ",".join(f"http://{c.ip}:{port}" for c in self.containers)
