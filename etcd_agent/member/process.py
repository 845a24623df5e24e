"""The process backend: the agent itself starts, watches and stops etcd (demo, dev, containers).

etcd gets exactly the ``ETCD_*`` variables of the rendered conf file, as systemd's
EnvironmentFile= would give it. The pid file records pid *and* start time; before any signal the
process is checked to be that same etcd (psutil: create time, executable, ETCD_NAME), so a stale
pid file can never make the agent kill an unrelated process. Stop escalates TERM -> wait -> KILL.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from etcd_agent.config import Config
from etcd_agent.errors import OperationFailed, ProtocolError
from etcd_agent.fs import makedirs, open_append, write_atomic
from etcd_agent.proctime import start_ticks
from etcd_agent.safejson import load as load_json
from etcd_agent.topology import parse_conf
from etcd_agent.typedjson import Document
from etcd_agent.waiting import poll

if TYPE_CHECKING:  # pragma: no cover - psutil is imported where a process is looked at
    import psutil

log = logging.getLogger(__name__)

# Variables of the agent's own environment that etcd may inherit; ETCD_* come from the conf only.
_PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "GOMAXPROCS")
MAX_PIDFILE = 64 << 10  # a pid record names the binary: a path, at most 4 KiB


@dataclass(frozen=True)
class PidRecord(Document):
    """``<run_dir>/<member>.pid``: which process is this member's etcd. A record that does not
    read (ProtocolError naming the field) means "not ours": no signal goes to that pid."""

    pid: int
    create_time: float  # psutil's, wall-clock seconds: the check of a record without start_ticks
    start_ticks: Optional[int] = None  # proctime.start_ticks; absent in an older agent's record
    binary: str = ""  # the etcd started (absent: the configured one)

    RANGES = {"pid": (1.0, float(1 << 31))}


class ProcessBackend:
    """One etcd member supervised as a child process of the agent."""

    kind = "process"

    def __init__(self, cfg: Config, member: str) -> None:
        self.cfg = cfg
        self.member = member
        self.run_dir = cfg.etcd.run_dir
        self.conf_file = cfg.conf_file(member)
        self.pid_file = os.path.join(self.run_dir, f"{member}.pid")
        self.log_file = os.path.join(self.run_dir, f"{member}.log")
        self._child: Optional[subprocess.Popen] = None  # type: ignore[type-arg]
        self._watched: Optional[int] = None  # the pid a watch_exit thread waits on

    # ------------------------------------------------------------ files

    def write_conf(self, text: str) -> bool:
        """Write the conf file atomically; True when it changed."""
        return _write_if_changed(self.conf_file, text, 0o644)

    def write_unit(self, text: str) -> bool:
        """The process backend has no unit to install; kept so both backends share one interface."""
        return False

    # ------------------------------------------------------------ lifecycle

    def _env(self) -> Dict[str, str]:
        try:
            with open(self.conf_file, encoding="utf-8") as fh:
                conf = parse_conf(fh.read())
        except FileNotFoundError:
            raise OperationFailed(f"{self.member}: conf file {self.conf_file} missing; render it first") from None
        env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
        env.update({k: v for k, v in conf.items() if k.startswith("ETCD_")})
        return env

    def start(self) -> None:
        """Start etcd unless this member's etcd already runs."""
        if self.pid() is not None:
            log.debug("%s: etcd already running", self.member)
            return
        makedirs(self.run_dir, 0o700)
        env = self._env()
        data_dir = env.get("ETCD_DATA_DIR", self.cfg.data_dir(self.member)).rstrip("/")
        makedirs(os.path.dirname(data_dir) or "/", 0o700)
        owner = etcd_owner(self.cfg)
        as_user: Dict[str, Any] = {}
        if owner is not None:
            # as root, etcd runs as [etcd] user, as the systemd unit's User= would have it
            _prepare_data_dir(self.member, self.cfg.etcd.user, data_dir, owner)
            as_user = {"user": owner[0], "group": owner[1], "extra_groups": []}
        logfh = open_append(self.log_file, mode=0o600)  # etcd logs can quote keys and requests
        try:
            # own session: a Ctrl-C in the operator's terminal reaches the agent, which then
            # stops etcd in order, instead of every etcd dying at once mid-write
            self._child = subprocess.Popen(
                [self.cfg.etcd.binary],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logfh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                **as_user,
            )
        except OSError as exc:
            raise OperationFailed(f"{self.member}: cannot start {self.cfg.etcd.binary}: {exc}") from None
        finally:
            logfh.close()
        import psutil

        rec = PidRecord(self._child.pid, psutil.Process(self._child.pid).create_time(), start_ticks(self._child.pid),
                        self.cfg.etcd.binary)
        write_atomic(self.pid_file, json.dumps(rec.to_json()).encode(), mode=0o600)
        log.info("%s: started etcd pid %d (log %s)", self.member, self._child.pid, self.log_file)

    def pid(self) -> Optional[int]:
        """PID of this member's etcd if it runs and is provably ours, else None."""
        proc = self._process()
        return proc.pid if proc is not None else None

    def _process(self) -> "Optional[psutil.Process]":
        import psutil

        try:
            with open(self.pid_file, encoding="utf-8") as fh:
                rec = PidRecord.from_json(load_json(fh, max_bytes=MAX_PIDFILE), f"pid file {self.pid_file}")
        except (FileNotFoundError, ValueError, ProtocolError):
            return None
        pid, created, ticks = rec.pid, rec.create_time, rec.start_ticks
        self._reap()
        try:
            proc = psutil.Process(pid)
            # the same process, not a recycled pid: by its start in ticks since boot, which no
            # clock moves (proctime); a pid file of an older agent has only the wall-clock time
            same = start_ticks(pid) == ticks if ticks is not None else abs(proc.create_time() - created) <= 0.01
            if not same or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            cmd = proc.cmdline()
            if not cmd or os.path.basename(cmd[0]) != os.path.basename(rec.binary or self.cfg.etcd.binary):
                return None
            env_name = proc.environ().get("ETCD_NAME")
            if env_name is not None and env_name != self.member:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None

    def watch_exit(self, on_exit: Callable[[int], None]) -> Optional[int]:
        """Call ``on_exit(pid)``, from a thread of its own, the moment this member's etcd exits,
        so the daemon need not wait for its next cycle to notice. The kernel tells through a pidfd
        (for a child of ours, or one an earlier agent started). One thread per etcd: a second call
        for the same one does nothing. Returns the pid watched, or None when none of ours runs or
        the kernel has no pidfd (Linux < 5.3: the next cycle notices, as before)."""
        proc = self._process()
        if proc is None:
            return None
        if self._watched == proc.pid:
            return proc.pid
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            return None
        if self.pid() != proc.pid:  # it exited before the pidfd was open (its pid maybe reused)
            os.close(fd)
            return None
        self._watched = proc.pid
        threading.Thread(target=self._await_exit, args=(fd, proc.pid, on_exit), name=f"etcd-exit-{self.member}",
                         daemon=True).start()
        return proc.pid

    def _await_exit(self, fd: int, pid: int, on_exit: Callable[[int], None]) -> None:
        try:
            waiter = select.poll()
            waiter.register(fd, select.POLLIN)  # readable once the process has exited
            waiter.poll()
        finally:
            os.close(fd)
        if self._watched == pid:
            self._watched = None
        on_exit(pid)

    def _reap(self) -> None:
        if self._child is not None:
            self._child.poll()  # collect a zombie; the exit code stays readable

    def is_active(self) -> bool:
        return self.pid() is not None

    def state(self) -> str:
        """active | failed (our child exited non-zero) | inactive, as systemd would say it."""
        if self.pid() is not None:
            return "active"
        code = self.exit_code()
        return "failed" if code not in (None, 0) else "inactive"

    def exit_code(self) -> Optional[int]:
        """Exit code of the etcd this backend started, if it has exited (None: running or unknown)."""
        if self._child is None:
            return None
        return self._child.poll()


    def stop(self, timeout: float = 15.0) -> None:
        """TERM, wait up to ``timeout``, then KILL; only the process proven to be ours."""
        proc = self._process()
        if proc is None:
            self._cleanup_pidfile()
            return
        log.info("%s: stopping etcd pid %d", self.member, proc.pid)
        stop_by_escalation(proc, self.member, timeout, lambda: self._gone(proc))
        self._child = None
        self._cleanup_pidfile()

    def signal_stop(self) -> None:
        """SIGTERM to the process proven to be ours, without waiting: ``stop`` (which sends it
        again, harmless to an etcd already stopping) waits for the exit."""
        proc = self._process()
        if proc is None:
            return
        import psutil

        log.info("%s: asking etcd pid %d to stop", self.member, proc.pid)
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass

    def _gone(self, proc: Any) -> bool:
        """``proc`` has exited: our own child is reaped here, another parent's is ``exited``."""
        if self._child is not None and self._child.pid == proc.pid:
            return self._child.poll() is not None
        return exited(proc)

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL our etcd (tests and fault drills)."""
        proc = self._process()
        if proc is not None:
            proc.kill()
            proc.wait(5)
            self._reap()

    def _cleanup_pidfile(self) -> None:
        try:
            os.unlink(self.pid_file)
        except FileNotFoundError:
            pass

    def describe(self) -> str:
        pid = self.pid()
        return f"running (pid {pid})" if pid else "stopped"


def etcd_owner(cfg: Config) -> Optional[Tuple[int, int]]:
    """(uid, gid) etcd runs as when the agent runs as root and ``[etcd] user`` exists and is not
    root; None when etcd runs as the agent's own user (nothing to switch to or chown to)."""
    if os.geteuid() != 0 or cfg.etcd.user == "root":
        return None
    import grp
    import pwd

    try:
        pw = pwd.getpwnam(cfg.etcd.user)
    except KeyError:
        return None
    try:
        gid = grp.getgrnam(cfg.etcd.group).gr_gid
    except KeyError:
        gid = pw.pw_gid
    return pw.pw_uid, gid


def _prepare_data_dir(member: str, user: str, data_dir: str, owner: Tuple[int, int]) -> None:
    """The data dir exists, is etcd's, and etcd can reach it through every parent dir."""
    uid, gid = owner
    for parent in _ancestors(os.path.dirname(data_dir)):
        st = os.stat(parent)
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        if not st.st_mode & bit:
            raise OperationFailed(
                f"{member}: etcd runs as {user}, which cannot reach {data_dir}: {parent} is mode "
                f"{st.st_mode & 0o777:o}; give etcd a data dir it can reach, or set [etcd] user = \"root\""
            )
    if not os.path.exists(data_dir):
        makedirs(data_dir, 0o700)
        os.chown(data_dir, uid, gid)
        return
    st = os.stat(data_dir)
    if (st.st_uid, st.st_gid) != (uid, gid):
        log.warning("%s: %s is not owned by %s; handing it over (chown -R)", member, data_dir, user)
        for root, dirs, files in os.walk(data_dir):
            os.chown(root, uid, gid)
            for n in dirs + files:
                os.lchown(os.path.join(root, n), uid, gid)


def _ancestors(path: str) -> List[str]:
    out = []
    p = os.path.abspath(path)
    while True:
        out.append(p)
        if p == "/":
            return out
        p = os.path.dirname(p)


def _write_if_changed(path: str, text: str, mode: int) -> bool:
    data = text.encode()
    try:
        with open(path, "rb") as fh:
            if fh.read() == data:
                return False
    except FileNotFoundError:
        pass
    makedirs(os.path.dirname(os.path.abspath(path)), 0o755)  # like /etc/etcd: readable, nobody else's to swap
    write_atomic(path, data, mode=mode)
    return True


KILL_WAIT = 5.0  # seconds a SIGKILLed etcd has to be gone


def exited(proc: Any) -> bool:
    """``proc`` has exited. Another parent (a daemon or the demo that started it) may reap it only
    later: a zombie has exited, so it counts."""
    import psutil

    try:
        return bool(proc.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def stop_by_escalation(proc: Any, member: str, timeout: float, gone: Callable[[], bool]) -> None:
    """SIGTERM, wait up to ``timeout`` for ``gone()``, then SIGKILL and wait ``KILL_WAIT``: the one way
    an etcd is stopped, after its caller has proven it is the one to stop. OperationFailed when it
    still runs; a process gone before a signal is no error (other ``psutil.Error``s propagate)."""
    import psutil

    def waited(limit: float) -> bool:
        try:
            poll(gone, timeout=limit, what=f"etcd pid {proc.pid} to exit", interval=0.05)
            return True
        except OperationFailed:
            return False

    try:
        proc.send_signal(signal.SIGTERM)
        if waited(timeout):
            return
        log.warning("%s: etcd pid %d ignored SIGTERM for %.0fs; killing", member, proc.pid, timeout)
        proc.kill()
    except psutil.NoSuchProcess:
        return
    if not waited(KILL_WAIT):
        raise OperationFailed(f"{member}: etcd pid {proc.pid} still runs after SIGKILL")
