"""A throwaway single-member etcd on loopback, restored from a snapshot file.

Never a live member: its own private 0700 dir (``mkdtemp``), its own random loopback ports in
10000-21998 (below the kernel's ephemeral range, so no outgoing connection takes them between
the pick and etcd's bind), a fresh cluster token, a clean environment (no inherited ETCD_*
variables), and it is stopped by escalation (TERM, wait, KILL) of the one process this module
started - the Popen object it holds, so a reused pid can never be hit - and its dir removed.

Options: low CPU/IO priority (``nice``, ``ionice``, set on the child right after it starts) and,
when running as root, running the etcd server as a given user (``etcd``) if that user exists
(Popen's ``user``/``group``/``extra_groups``, which set the ids in the child before exec, like a
preexec setuid/setgid but safe in a threaded process). ``etcdutl snapshot restore`` runs as the
caller - the snapshot lives in a root-only backup dir - and the restored data dir is then given
to that user; ``snapshot save`` also runs as the caller, so the result is the caller's file.
With ``snapshot=None`` the member starts empty
(tests and benchmarks use that as a stand-in for a live member).
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from etcd_agent import safejson
from etcd_agent.chain.errors import ScratchError
from etcd_agent.errors import CommandError, CommandTimedOut, EtcdError, OperationFailed
from etcd_agent.etcd import tools
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.fs import fsync_dir, fsync_path
from etcd_agent.hosts.base import Result
from etcd_agent.pdeath import die_with_parent
from etcd_agent.scratch.machine import chown_tree, etcd_flags, pick_ports, run_as, unreachable_by
from etcd_agent.waiting import poll

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.etcd.client import EtcdClient

log = logging.getLogger(__name__)

ETCD_DIR = "/opt/etcd/3.5.16"
_PASS_ENV = ("PATH", "LANG", "LC_ALL", "TZ")
# A restore with --bump-revision --mark-compacted leaves the snapshot's whole history to compact
# once the member starts, and a replay waits for that compaction (``compact(physical=True)``)
# before it defragments. etcd deletes 1000 revisions a batch and sleeps 10 ms between batches:
# 0.1-0.3 s of sleep on the bench's checkpoints, seconds on a cluster the apiserver compacts every
# 5 minutes. A lone throwaway member serves nobody meanwhile: larger batches, bounded so that one
# batch's transaction stays a fraction of the db. Passed only to a release that lists the flag.
COMPACTION_BATCH_FLAG = "--experimental-compaction-batch-limit"
COMPACTION_BATCH = 100_000
PROBE_TIMEOUT = 2.0  # one readiness try of a starting member


@dataclass(frozen=True)
class EtcdBinaries:
    etcd: str = f"{ETCD_DIR}/etcd"
    etcdutl: str = f"{ETCD_DIR}/etcdutl"
    etcdctl: str = f"{ETCD_DIR}/etcdctl"


@dataclass(frozen=True)
class ScratchOptions:
    binaries: EtcdBinaries = field(default_factory=EtcdBinaries)
    parent_dir: Optional[str] = None  # where the private dir is made (default: the temp dir)
    user: Optional[str] = None  # when root and the user exists: run the etcd server as it
    nice: Optional[int] = None  # e.g. 10: below the real member
    ionice: Optional[str] = None  # "idle" or "best-effort:N" (N 0-7)
    gomaxprocs: Optional[int] = None
    start_timeout: float = 60.0
    stop_timeout: float = 15.0
    restore_timeout: float = 600.0
    # a throwaway member: fsync buys nothing (the result leaves it by `snapshot save`)
    unsafe_no_fsync: bool = True
    quota_bytes: int = 8 * 1024**3
    max_request_bytes: int = 64 * 1024 * 1024
    max_txn_ops: int = 1_000_000
    skip_hash_check: bool = False
    log_level: str = "warn"
    extra_args: Tuple[str, ...] = ()


@dataclass(frozen=True)
class SnapshotStatus:
    """``etcdutl snapshot status -w json`` of a saved snapshot."""

    path: str
    revision: int
    total_keys: int  # bolt keys of every bucket, as etcdutl counts them
    total_size: int
    hash: int

    def to_json(self) -> Dict[str, object]:
        return {"path": self.path, "revision": self.revision, "totalKey": self.total_keys,
                "totalSize": self.total_size, "hash": self.hash}


@dataclass(frozen=True)
class EtcdutlStatus(tools.SnapshotStatus):
    """What etcdutl prints (its other keys, such as the version, ignored): the record the backup
    reads, refused here as the scratch member's own fault."""

    ERROR = ScratchError


def snapshot_status(path: str, out: Union[str, bytes]) -> SnapshotStatus:
    """``etcdutl snapshot status -w json``'s output ``out`` about ``path``; ScratchError if it is not that."""
    where = f"snapshot status of {path}"
    try:
        data = safejson.loads(out, max_bytes=1 << 16)
    except ValueError:  # UnsafeJson included: one line of a tool's output, bounded
        raise ScratchError(f"{where} printed no JSON: {out[:200]!r}") from None
    s = EtcdutlStatus.from_json(data, where)
    return SnapshotStatus(path, s.revision, s.total_keys, s.total_size, s.hash)


def _accepting(port: int) -> bool:
    """Something accepts connections on loopback ``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _landing(dest: str) -> Iterator[str]:
    """A temporary name beside ``dest`` for a saved snapshot: written there whole (by the
    caller), it is linked to ``dest`` (never replacing a file) and the dir fsynced; removed either
    way (with the ``.part`` etcdctl writes first). A failed save or write is a ScratchError."""
    directory = os.path.dirname(os.path.abspath(dest))
    tmp = os.path.join(directory, f".{os.path.basename(dest)}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        os.link(tmp, dest)
        fsync_dir(directory)
    except (CommandError, EtcdError) as exc:
        raise ScratchError(f"snapshot save from the scratch etcd failed: {exc.message}") from None
    except OSError as exc:
        raise ScratchError(f"writing {dest} failed: {exc.strerror or exc}") from None
    finally:
        for p in (tmp, tmp + ".part"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


class ScratchEtcd:
    """A running throwaway member. ``stop()`` ends it and removes its dir."""

    def __init__(self, options: ScratchOptions, name: str = "scratch") -> None:
        self.options = options
        self.name = name
        parent = options.parent_dir or tempfile.gettempdir()
        self.dir = tempfile.mkdtemp(prefix="etcd-scratch-", dir=parent)  # 0700
        self.data_dir = os.path.join(self.dir, "data")
        self.log_path = os.path.join(self.dir, "etcd.log")
        self.ids = run_as(options.user)
        if self.ids is not None:
            os.chown(self.dir, *self.ids)
            blocked = unreachable_by(parent, *self.ids)
            if blocked:
                shutil.rmtree(self.dir, ignore_errors=True)
                raise ScratchError(
                    f"user {options.user} cannot reach a scratch dir under {parent}: {blocked} is not "
                    "searchable by it (choose a parent_dir it can traverse)"
                )
        self.client_port = self.peer_port = 0
        self.token = f"scratch-{secrets.token_hex(8)}"
        self._proc: Optional["subprocess.Popen[bytes]"] = None
        self._rpc: Optional[EtcdRpc] = None
        self.timings: Dict[str, float] = {}  # step -> seconds: restore, start, save, status

    def _took(self, step: str, since: float) -> None:
        self.timings[step] = self.timings.get(step, 0.0) + time.monotonic() - since

    # ------------------------------------------------------------ urls

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    @property
    def rpc(self) -> EtcdRpc:
        if self._rpc is None:
            self._rpc = EtcdRpc(self.endpoint, timeout=30.0)
        return self._rpc

    def client(self, timeout: float = 5.0) -> "EtcdClient":
        """The agent's EtcdClient for this member (status, health, compact ...)."""
        from etcd_agent.etcd.client import EtcdClient

        return EtcdClient([self.endpoint], timeout=timeout)

    # ------------------------------------------------------------ processes

    def _env(self) -> Dict[str, str]:
        env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
        env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        env["ETCDCTL_API"] = "3"
        if self.options.gomaxprocs:
            env["GOMAXPROCS"] = str(self.options.gomaxprocs)
        return env

    def _spawn(
        self, argv: Sequence[str], stdout: Union[int, IO[bytes]], stderr: Union[int, IO[bytes]], *,
        as_user: bool = True,
    ) -> "subprocess.Popen[bytes]":
        ids = self.ids if as_user else None
        try:
            proc = subprocess.Popen(
                list(argv),
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                cwd=self.dir,
                close_fds=True,
                start_new_session=True,  # an operator's Ctrl-C reaches us, not etcd mid-write
                user=ids[0] if ids else None,
                group=ids[1] if ids else None,
                extra_groups=[] if ids else None,
                # killed with its run, even by -9 (the dir is then removed by the next run's sweep)
                preexec_fn=die_with_parent(),
            )
        except OSError as exc:
            raise ScratchError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
        self._lower_priority(proc.pid)
        return proc

    def _lower_priority(self, pid: int) -> None:
        import psutil

        o = self.options
        try:
            p = psutil.Process(pid)
            if o.nice is not None:
                p.nice(o.nice)
            if o.ionice == "idle":
                p.ionice(psutil.IOPRIO_CLASS_IDLE)
            elif o.ionice and o.ionice.startswith("best-effort:"):
                p.ionice(psutil.IOPRIO_CLASS_BE, int(o.ionice.split(":", 1)[1]))
        except psutil.NoSuchProcess:
            pass  # exited already; its exit status tells why
        except (psutil.AccessDenied, ValueError) as exc:
            log.warning("could not lower the priority of pid %d: %s", pid, exc)

    def _run(self, argv: Sequence[str], timeout: float, *, as_user: bool = True) -> Result:
        start = time.monotonic()
        proc = self._spawn(argv, subprocess.PIPE, subprocess.PIPE, as_user=as_user)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=10)
            res = Result("localhost", tuple(argv), -1, out.decode(errors="replace"), err.decode(errors="replace"),
                         time.monotonic() - start)
            raise CommandTimedOut(f"`{res.command}` timed out after {timeout:g}s", res) from None
        res = Result("localhost", tuple(argv), proc.returncode, out.decode(errors="replace"),
                     err.decode(errors="replace"), time.monotonic() - start)
        return res.check()

    def restore(self, snapshot: str, *, bump_revision: int = 0) -> None:
        """``etcdutl snapshot restore`` into the private data dir; ``bump_revision`` > 0 moves the
        store's revision that far on (etcdutl 3.5.10+, marked compacted there)."""
        argv = [
            self.options.binaries.etcdutl,
            "snapshot",
            "restore",
            snapshot,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--initial-cluster={self.name}={self.peer_url}",
            f"--initial-cluster-token={self.token}",
            f"--initial-advertise-peer-urls={self.peer_url}",
        ]
        if self.options.skip_hash_check:
            argv.append("--skip-hash-check")
        if bump_revision > 0:
            argv += [f"--bump-revision={bump_revision}", "--mark-compacted"]
        try:
            # as ourselves: the snapshot sits in a root-only backup dir; the data dir is then
            # handed to the scratch user, and only the long-running server drops privileges
            self._run(argv, self.options.restore_timeout, as_user=False)
        except CommandError as exc:
            raise ScratchError(f"restoring {snapshot} into a scratch dir failed: {exc.message}") from None
        if self.ids is not None:
            chown_tree(self.data_dir, *self.ids)

    def _etcd_argv(self) -> List[str]:
        o = self.options
        argv = [
            o.binaries.etcd,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.endpoint}",
            f"--advertise-client-urls={self.endpoint}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.name}={self.peer_url}",
            f"--initial-cluster-token={self.token}",
            "--initial-cluster-state=new",
            f"--quota-backend-bytes={o.quota_bytes}",
            f"--max-request-bytes={o.max_request_bytes}",
            f"--max-txn-ops={o.max_txn_ops}",
            f"--log-level={o.log_level}",
            # a lone member elects itself once its election timeout passes: at etcd's 1000 ms that
            # was ~1 s of every replay and drill (measured 1.05 s to serving; 0.06 s at these).
            # With one voter there is nobody to lose leadership to, so short timers cost nothing
            "--heartbeat-interval=10",
            "--election-timeout=50",
        ]
        if o.unsafe_no_fsync:
            argv.append("--unsafe-no-fsync")
        if COMPACTION_BATCH_FLAG in etcd_flags(o.binaries.etcd):
            argv.append(f"{COMPACTION_BATCH_FLAG}={COMPACTION_BATCH}")
        return argv + list(o.extra_args)

    def start(self, snapshot: Optional[str], *, bump_revision: int = 0) -> None:
        """Restore ``snapshot`` (None: start empty), start etcd, wait until it serves (deadline)."""
        last: Optional[ScratchError] = None
        for attempt in range(3):
            self.client_port, self.peer_port = pick_ports()
            if os.path.exists(self.data_dir):
                shutil.rmtree(self.data_dir)
            if snapshot is not None:
                t = time.monotonic()
                self.restore(snapshot, bump_revision=bump_revision)
                self._took("restore", t)
            try:
                t = time.monotonic()
                self._start_etcd()
                self._took("start", t)
                return
            except ScratchError as exc:
                last = exc
                if "address already in use" not in " ".join(exc.details):
                    raise
                log.info("scratch etcd lost its port to another process; trying other ports (%d)", attempt + 1)
        assert last is not None
        raise last

    def _start_etcd(self) -> None:
        logfh = open(self.log_path, "ab")
        try:
            if self.ids is not None:
                os.fchown(logfh.fileno(), *self.ids)
            self._proc = self._spawn(self._etcd_argv(), logfh, subprocess.STDOUT)
        finally:
            logfh.close()
        log.info("scratch etcd pid %d on %s (dir %s)", self._proc.pid, self.endpoint, self.dir)

        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                return True
            # gRPC only once etcd listens, and each try on a channel of its own: a failed connect
            # holds a channel in its reconnect backoff (100 ms and up), which was most of the
            # wait here (start to serving 0.22-0.41 s, 0.16-0.23 s this way, loaded machine)
            if not _accepting(self.client_port):
                return False
            probe = EtcdRpc(self.endpoint, timeout=PROBE_TIMEOUT)
            try:
                # linearizable: answered only once the member has elected itself leader
                probe.header(serializable=False)
            except EtcdError:
                probe.close()
                return False
            if self._rpc is not None:  # a restart: the caller's client reconnects on its own
                probe.close()
                return True
            # the channel that answered becomes ``rpc``: a new one would connect again, and its
            # first call fails outright when that connect takes longer than the channel's 100 ms
            # connect deadline (``channel.options``: seen on a machine at load average 20)
            probe.timeout = 30.0
            self._rpc = probe
            return True

        try:
            poll(ready, timeout=self.options.start_timeout, what="the scratch etcd", interval=0.01)
            ok = True
        except OperationFailed:
            ok = False
        code = self._proc.poll()
        if code is not None or not ok:
            tail = self.log_tail()
            self.stop_process()
            what = f"exited with {code}" if code is not None else f"not serving after {self.options.start_timeout:g}s"
            raise ScratchError(f"scratch etcd on {self.endpoint} {what}", details=tail)

    def log_tail(self, lines: int = 10) -> List[str]:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(max(0, os.fstat(fh.fileno()).st_size - 16384))
                return fh.read().decode("utf-8", "replace").splitlines()[-lines:]
        except OSError:
            return []

    def snapshot_save(self, dest: str, *, timeout: float = 3600.0) -> SnapshotStatus:
        """``etcdctl snapshot save`` into ``dest`` (0600, fsynced, never replacing a file), then
        ``etcdutl snapshot status`` of it."""
        b = self.options.binaries
        with _landing(dest) as tmp:
            # etcdctl writes tmp.part, then renames it to tmp; run as ourselves: dest is ours
            t = time.monotonic()
            self._run([b.etcdctl, f"--endpoints={self.endpoint}", "snapshot", "save", tmp], timeout, as_user=False)
            self._took("save", t)
            t = time.monotonic()
            shown = self._run([b.etcdutl, "snapshot", "status", tmp, "-w", "json"], 300.0, as_user=False)
            self._took("status", t)
            os.chmod(tmp, 0o600)
            fsync_path(tmp)
        return snapshot_status(dest, shown.stdout)

    def save(self, dest: str, *, timeout: float = 3600.0) -> None:
        """``snapshot_save`` without the status (a full read of the saved db by another process):
        for a caller that reads what it needs from the db itself. Streamed by the agent itself
        (``Maintenance.Snapshot``, as a backup is), not by an etcdctl process: the same bytes,
        written 0600, fsynced, then linked to ``dest``, without a Go process's start and connect
        (0.17-0.24 s against 0.09-0.11 s for a 12.5 MB db here)."""
        t = time.monotonic()
        client = self.client(timeout=timeout)
        try:
            with _landing(dest) as tmp:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    for chunk in client.snapshot_chunks(self.endpoint, timeout=timeout):
                        fh.write(chunk)
                    fh.flush()
                    os.fsync(fh.fileno())
                self._took("save", t)
        finally:
            client.close()

    def stop_process(self, *, keep_client: bool = False) -> None:
        """TERM, wait, KILL - only the process this object started."""
        if self._rpc is not None and not keep_client:
            self._rpc.close()
            self._rpc = None
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(self.options.stop_timeout)
        except subprocess.TimeoutExpired:
            log.warning("scratch etcd pid %d ignored SIGTERM for %.0fs; killing", proc.pid, self.options.stop_timeout)
            proc.kill()
            proc.wait(10)

    def restart(self, down_seconds: float = 0.0) -> None:
        """Stop etcd and start it again on the same data and ports (outage drills); the
        ``rpc`` client stays usable (gRPC reconnects)."""
        self.stop_process(keep_client=True)
        if down_seconds:
            time.sleep(down_seconds)
        self._start_etcd()

    def stop(self) -> None:
        """Stop etcd and remove the private dir."""
        try:
            self.stop_process()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            if os.path.exists(self.dir):  # pragma: no cover
                log.warning("could not remove scratch dir %s", self.dir)


def start_scratch(
    snapshot: Optional[str], options: Optional[ScratchOptions] = None, name: str = "scratch", *,
    bump_revision: int = 0,
) -> ScratchEtcd:
    """Restore and start; on any failure nothing is left running or on disk."""
    s = ScratchEtcd(options or ScratchOptions(), name)
    try:
        s.start(snapshot, bump_revision=bump_revision)
    except BaseException:
        s.stop()
        raise
    return s


@contextlib.contextmanager
def scratch_etcd(
    snapshot: Optional[str], options: Optional[ScratchOptions] = None, name: str = "scratch", *,
    bump_revision: int = 0,
) -> Iterator[ScratchEtcd]:
    """``with scratch_etcd(path) as s:`` - a member restored from ``path``, gone afterwards."""
    s = start_scratch(snapshot, options, name, bump_revision=bump_revision)
    try:
        yield s
    finally:
        s.stop()
