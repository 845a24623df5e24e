"""SshHost: another master, through paramiko (argv quoted, host keys enforced, timeouts everywhere),
and a restore's snapshot through the OpenSSH client under the same trust (``spawn_stream``).

Host keys are checked only against the configured known_hosts file: an unknown or changed key
refuses the connection (never auto-added, ~/.ssh/known_hosts never read). One transport per host
is opened lazily, reused for every command and SFTP call, and reopened when it died.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import select
import shlex
import socket
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

# paramiko imports invoke (with unittest.mock: ~0.1 s of every restore's start) only to run an
# ssh_config's "Match exec" lines; the agent never reads an ssh_config. A None in sys.modules
# makes that import fail, which paramiko expects (invoke is optional to it); one already
# imported by someone else is left as it is.
sys.modules.setdefault("invoke", None)  # type: ignore[arg-type]

import paramiko  # noqa: E402
from paramiko.sftp import CMD_EXTENDED  # noqa: E402

from etcd_agent.config import SshSection  # noqa: E402 - after the invoke stub above
from etcd_agent.errors import CommandTimedOut, HostKeyRejected, HostUnreachable  # noqa: E402 - after the invoke stub above
from etcd_agent.hosts import openssh  # noqa: E402 - after the invoke stub above
from etcd_agent.hosts.base import Result, Session  # noqa: E402 - after the invoke stub above
from etcd_agent.hosts.local import LocalSession  # noqa: E402 - after the invoke stub above
from etcd_agent.hosts.openssh import FAST_CIPHERS  # noqa: E402 - after the invoke stub above
from etcd_agent.hosts.sshsession import CHUNK, SshSession  # noqa: E402 - after the invoke stub above

log = logging.getLogger(__name__)

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# keys tried when no identity_file is configured (never the agent, never a password)
DEFAULT_KEYS = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")
# after TERM on timeout, how long the remote command gets before KILL
KILL_GRACE = 1.0
# how long past timeout + KILL_GRACE this side waits for the remote exit status
NETWORK_GRACE = 1.0
# how a command ends when coreutils `timeout` fired: 124 (TERM worked), 137, or -1 (its KILL
# goes to its whole process group, itself included: sshd reports a signal, paramiko no status)
TIMEOUT_EXITS = (124, 137, -1)
LOCAL_TIMEOUT = "local-timeout"


def preferred_ciphers(offered: Sequence[str]) -> Tuple[str, ...]:
    """``offered`` with the AES-GCM ciphers it holds moved to the front, the rest in order
    (``openssh.FAST_CIPHERS``: only the order changes, the server still has to offer them)."""
    return tuple([c for c in FAST_CIPHERS if c in offered] + [c for c in offered if c not in FAST_CIPHERS])


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint (what `ssh-keygen -lf` prints)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


def remote_command(
    argv: Sequence[str], env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None
) -> str:
    """The command string for the remote shell: every word quoted; env as ``env NAME=value``;
    with ``timeout``, coreutils ``timeout`` enforces it on the remote side (TERM, then KILL)."""
    if not argv:
        raise ValueError("empty argv")
    words: List[str] = []
    if timeout is not None:
        if timeout < 0.001:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        words += ["timeout", "-k", f"{KILL_GRACE:.3f}", f"{timeout:.3f}"]
    if env:
        words.append("env")
        for name, value in env.items():
            if not ENV_NAME_RE.match(name):
                raise ValueError(f"invalid environment variable name {name!r}")
            words.append(f"{name}={value}")
    words.extend(str(a) for a in argv)
    return " ".join(shlex.quote(w) for w in words)


class SshHost:
    """A remote machine reached over SSH; implements the ``Host`` protocol."""

    def __init__(self, name: str, address: str, ssh: SshSection) -> None:
        self.name = name
        self.address = address
        self.cfg = ssh
        self._lock = threading.RLock()
        self._transport: Optional[paramiko.Transport] = None
        self._sftp: Optional[paramiko.SFTPClient] = None
        self.connects = 0  # how many transports were opened (tests check reuse)

    def __repr__(self) -> str:
        return f"SshHost({self.name!r}, {self.address}:{self.cfg.port})"

    @property
    def _where(self) -> str:
        return f"{self.name} ({self.cfg.user}@{self.address}:{self.cfg.port})"

    # ------------------------------------------------------------ connection

    def _known_name(self) -> str:
        return self.address if self.cfg.port == 22 else f"[{self.address}]:{self.cfg.port}"

    def _known_keys(self) -> Dict[str, paramiko.PKey]:
        path = self.cfg.known_hosts
        if not os.path.isfile(path):
            raise HostKeyRejected(
                f"{self._where}: known_hosts file {path} does not exist; cannot verify the host key"
            )
        keys = paramiko.HostKeys()
        try:
            keys.load(path)
        except (OSError, paramiko.SSHException) as exc:
            raise HostKeyRejected(f"{self._where}: cannot read known_hosts file {path}: {exc}") from exc
        entry = keys.lookup(self._known_name())
        return dict(entry) if entry else {}

    def _identity_paths(self) -> List[str]:
        """``identity_file``, or those of ``DEFAULT_KEYS`` that exist (both transports use these)."""
        if self.cfg.identity_file:
            return [self.cfg.identity_file]
        return [os.path.expanduser(p) for p in DEFAULT_KEYS if os.path.exists(os.path.expanduser(p))]

    def _client_keys(self) -> List[paramiko.PKey]:
        keys = []
        for path in self._identity_paths():
            try:
                keys.append(paramiko.PKey.from_path(path))
            except (OSError, paramiko.SSHException, ValueError) as exc:
                raise HostUnreachable(f"{self._where}: cannot load SSH identity {path}: {exc}") from exc
        if not keys:
            raise HostUnreachable(f"{self._where}: no SSH identity (set ssh.identity_file)")
        return keys

    def _connect(self) -> paramiko.Transport:
        """Open, verify and authenticate a transport, all within ``connect_timeout``."""
        known = self._known_keys()
        pkeys = self._client_keys()
        limit = self.cfg.connect_timeout
        deadline = time.monotonic() + limit

        def left() -> float:
            return max(0.01, deadline - time.monotonic())

        try:
            sock = socket.create_connection((self.address, self.cfg.port), timeout=limit)
        except socket.timeout:
            raise HostUnreachable(f"{self._where}: connect timed out after {limit:g}s") from None
        except OSError as exc:
            raise HostUnreachable(f"{self._where}: cannot connect: {exc.strerror or exc}") from exc
        t = paramiko.Transport(sock)
        try:
            t.banner_timeout = left()
            t.handshake_timeout = left()
            opts = t.get_security_options()
            opts.ciphers = preferred_ciphers(opts.ciphers)
            if known:
                # negotiate the key type we know, so a host with several keys is verified
                ours = [k for k in known if k in opts.key_types]
                opts.key_types = ours + [k for k in opts.key_types if k not in ours]
            t.start_client(timeout=left())
            if not t.is_active() or t.host_key is None:
                raise HostUnreachable(f"{self._where}: SSH handshake timed out after {limit:g}s")
            self._verify(t.get_remote_server_key(), known)
            t.auth_timeout = left()
            self._authenticate(t, pkeys)
        except HostUnreachable:
            t.close()
            raise
        except (paramiko.SSHException, EOFError, OSError) as exc:
            t.close()
            if time.monotonic() >= deadline:
                raise HostUnreachable(f"{self._where}: SSH setup timed out after {limit:g}s ({exc})") from exc
            raise HostUnreachable(f"{self._where}: SSH connection failed: {exc or type(exc).__name__}") from exc
        except BaseException:
            t.close()
            raise
        self.connects += 1
        log.debug("connected to %s", self._where)
        return t

    def _verify(self, key: paramiko.PKey, known: Mapping[str, paramiko.PKey]) -> None:
        fp = fingerprint(key)
        if not known:
            raise HostKeyRejected(
                f"{self._where}: host key {key.get_name()} {fp} is not in {self.cfg.known_hosts}; "
                "refusing to connect (add the key after checking it out of band)"
            )
        expected = known.get(key.get_name())
        if expected is None or expected.asbytes() != key.asbytes():
            listed = ", ".join(f"{t} {fingerprint(k)}" for t, k in known.items())
            raise HostKeyRejected(
                f"{self._where}: HOST KEY CHANGED: server offered {key.get_name()} {fp}, "
                f"{self.cfg.known_hosts} lists {listed}; refusing to connect"
            )

    def _authenticate(self, t: paramiko.Transport, pkeys: Sequence[paramiko.PKey]) -> None:
        errors = []
        for pkey in pkeys:
            try:
                t.auth_publickey(self.cfg.user, pkey)
            except paramiko.AuthenticationException as exc:
                errors.append(str(exc))
                continue
            if t.is_authenticated():
                return
        raise HostUnreachable(
            f"{self._where}: public key authentication failed as {self.cfg.user!r}"
            + (f": {errors[-1]}" if errors else "")
        )

    def _get_transport(self) -> Tuple[paramiko.Transport, bool]:
        """The live transport, connecting lazily; the flag says whether it is a fresh one."""
        with self._lock:
            t = self._transport
            if t is not None and t.is_active():
                return t, False
            self._drop()
            self._transport = self._connect()
            return self._transport, True

    def _drop(self) -> None:
        """Forget (and close) the current transport and its SFTP session."""
        sftp, t = self._sftp, self._transport
        self._sftp = self._transport = None
        for thing in (sftp, t):
            if thing is not None:
                try:
                    thing.close()
                except Exception:  # closing a dead connection may fail in many ways
                    pass

    def _open_channel(self) -> paramiko.Channel:
        """A new session channel; reconnects once when a reused transport turned out dead."""
        while True:
            t, fresh = self._get_transport()
            start = time.monotonic()
            try:
                return t.open_session(timeout=self.cfg.connect_timeout)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                with self._lock:
                    if self._transport is t:
                        self._drop()
                timed_out = time.monotonic() - start >= self.cfg.connect_timeout
                if fresh or timed_out:
                    why = f"no answer within {self.cfg.connect_timeout:g}s" if timed_out else str(exc)
                    raise HostUnreachable(f"{self._where}: cannot open an SSH channel: {why}") from exc
                log.debug("transport to %s was dead (%s); reconnecting", self._where, exc)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def spawn(self, argv: Sequence[str]) -> "SshSession":
        """A long-running command over its own channel (no remote `timeout`: it lives as long as
        the session; when this side dies, sshd closes the channel and the command sees EOF)."""
        argv = tuple(str(a) for a in argv)
        chan = self._open_channel()
        try:
            chan.exec_command(remote_command(argv))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            chan.close()
            raise HostUnreachable(f"{self._where}: cannot start `{shlex.join(argv)}`: {exc}") from None
        return SshSession(self._where, chan)

    def spawn_stream(self, argv: Sequence[str]) -> Session:
        """Like ``spawn``, for a command that takes bulk data on its stdin (a restore's snapshot):
        through the OpenSSH client when ``ssh.stream`` says so ("auto": when one is installed), so
        the ciphers run in C in a process of its own instead of in this one under the GIL (on two
        cores, 2-3x the throughput). The same trust as ``spawn``: the configured known_hosts only
        (``StrictHostKeyChecking=yes``, nothing written back, no other file read, ``-F /dev/null``:
        no ssh_config), the configured identity only (no agent), never a prompt (``BatchMode``).
        ``abort`` ends that client alone; the host's own connection (its lock) lives on."""
        argv = tuple(str(a) for a in argv)
        words = self.openssh_argv(remote_command(argv))
        if words is None:
            return self.spawn(argv)
        if not self._known_keys():
            raise HostKeyRejected(f"{self._where}: no host key for {self._known_name()} in {self.cfg.known_hosts}; "
                                  "refusing to connect (add the key after checking it out of band)")
        return LocalSession(self._where, words, bulk=True)

    def openssh_argv(self, command: str) -> Optional[List[str]]:
        """The OpenSSH client's command line running ``command`` on this host, or None when the
        stream stays on paramiko (``openssh.client_argv``)."""
        return openssh.client_argv(self.cfg, self.address, self._where, self._identity_paths(), command)

    # ------------------------------------------------------------ commands

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = True,
        input: Optional[bytes] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> Result:
        argv = tuple(str(a) for a in argv)
        # The remote `timeout` kills the command's whole process group even when this side is
        # gone; closing the channel alone would leave a command that never writes running (and
        # OpenSSH ignores "signal" requests on root sessions).
        command = remote_command(argv, env, timeout)
        start = time.monotonic()
        chan = self._open_channel()
        try:
            chan.exec_command(command)
            # the local deadline only matters when the remote side stops answering
            rc, out, err = self._pump(chan, input, start + timeout + KILL_GRACE + NETWORK_GRACE)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            chan.close()
            self.close()
            raise HostUnreachable(f"{self._where}: connection lost running `{shlex.join(argv)}`: {exc}") from exc
        finally:
            chan.close()
        elapsed = time.monotonic() - start
        timed_out = rc == LOCAL_TIMEOUT or (rc in TIMEOUT_EXITS and elapsed >= timeout)
        res = Result(self.name, argv, -1 if timed_out else rc, _text(out), _text(err), elapsed)
        if timed_out:
            raise CommandTimedOut(f"{self.name}: `{res.command}` timed out after {timeout:g}s", res)
        if rc is None:
            self.close()
            raise HostUnreachable(f"{self._where}: connection lost running `{res.command}`")
        return res.check() if check else res

    def _pump(
        self, chan: paramiko.Channel, data: Optional[bytes], deadline: float
    ) -> Tuple[Any, bytes, bytes]:
        """Feed stdin, collect stdout/stderr until exit or ``deadline``. Returns (rc, out, err); rc is
        LOCAL_TIMEOUT at the deadline and None when the connection broke before an exit status."""
        out: List[bytes] = []
        err: List[bytes] = []
        pending = memoryview(data) if data else None
        if pending is None:
            chan.shutdown_write()  # the command sees EOF on stdin, like DEVNULL locally
        fd = chan.fileno()  # readable whenever stdout/stderr data or EOF arrives

        def drain() -> None:
            while chan.recv_ready():
                out.append(chan.recv(CHUNK))
            while chan.recv_stderr_ready():
                err.append(chan.recv_stderr(CHUNK))

        while True:
            drain()
            if pending is not None and chan.send_ready():
                n = chan.send(pending[:CHUNK].tobytes())
                pending = pending[n:]
                if not pending:
                    chan.shutdown_write()
                    pending = None
            if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                drain()
                return chan.recv_exit_status(), b"".join(out), b"".join(err)
            if chan.closed:
                drain()
                # paramiko ignores "exit-signal": closed without a status while the transport
                # lives means the command died of a signal; otherwise the connection broke
                alive = chan.transport is not None and chan.transport.is_active()
                return (-1 if alive else None), b"".join(out), b"".join(err)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                drain()
                return LOCAL_TIMEOUT, b"".join(out), b"".join(err)
            # while stdin is pending, poll briefly: send readiness has no file descriptor
            select.select([fd], [], [], min(remaining, 0.01 if pending is not None else 0.2))

    # ------------------------------------------------------------ files (SFTP)

    def _sftp_client(self) -> paramiko.SFTPClient:
        with self._lock:
            if self._sftp is not None and self._transport is not None and self._transport.is_active():
                return self._sftp
            chan = self._open_channel()
            try:
                chan.invoke_subsystem("sftp")
                # bound every SFTP round trip: a stalled network fails instead of hanging
                chan.settimeout(max(self.cfg.connect_timeout, 15.0))
                self._sftp = paramiko.SFTPClient(chan)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                chan.close()
                raise HostUnreachable(f"{self._where}: cannot start SFTP: {exc}") from exc
            return self._sftp

    def _sftp_call(self, what: str, fn: Any) -> Any:
        """Run ``fn(sftp)``; connection trouble becomes HostUnreachable, file errors stay OSError."""
        sftp = self._sftp_client()
        try:
            return fn(sftp)
        except (socket.timeout, paramiko.SSHException, EOFError) as exc:
            self.close()
            raise HostUnreachable(f"{self._where}: SFTP {what} failed: {exc or type(exc).__name__}") from exc

    def read(self, path: str) -> bytes:
        def do(sftp: paramiko.SFTPClient) -> bytes:
            with sftp.open(path, "rb") as fh:
                fh.prefetch()
                data: bytes = fh.read()
                return data

        return bytes(self._sftp_call(f"read {path}", do))

    def exists(self, path: str) -> bool:
        def do(sftp: paramiko.SFTPClient) -> bool:
            try:
                sftp.stat(path)
                return True
            except FileNotFoundError:
                return False

        return bool(self._sftp_call(f"stat {path}", do))

    def write_atomic(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        def fill(fh: paramiko.SFTPFile) -> None:
            fh.write(data)

        self._put_atomic(path, mode, fill)

    def put(self, local_path: str, remote_path: str, *, mode: int = 0o600) -> None:
        def fill(fh: paramiko.SFTPFile) -> None:
            with open(local_path, "rb") as src:
                while True:
                    block = src.read(1 << 20)
                    if not block:
                        break
                    fh.write(block)

        os.stat(local_path)  # a missing source fails before anything remote is touched
        self._put_atomic(remote_path, mode, fill)

    def _put_atomic(self, path: str, mode: int, fill: Any) -> None:
        """Write to ``.<name>.<random>.tmp`` beside ``path``, chmod before any byte lands, fsync,
        then posix-rename over ``path``: readers never see half a file or loose permissions."""
        directory, base = os.path.split(path)
        tmp = os.path.join(directory, f".{base}.{uuid.uuid4().hex[:12]}.tmp")

        def do(sftp: paramiko.SFTPClient) -> None:
            try:
                with sftp.open(tmp, "wb") as fh:
                    fh.chmod(mode)
                    fh.set_pipelined(True)
                    fill(fh)
                    fh.flush()
                    _fsync(sftp, fh)
                sftp.posix_rename(tmp, path)
            except BaseException:
                try:
                    sftp.remove(tmp)
                except Exception:  # best effort: the connection may be gone
                    pass
                raise

        self._sftp_call(f"write {path}", do)

    def get(self, remote_path: str, local_path: str) -> None:
        """Copy to ``local_path`` via a 0600 temp file in the same dir, then rename."""
        directory = os.path.dirname(os.path.abspath(local_path))
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(local_path)}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as fh:
                self._sftp_call(f"get {remote_path}", lambda sftp: sftp.getfo(remote_path, fh))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, local_path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise


def _fsync(sftp: paramiko.SFTPClient, fh: paramiko.SFTPFile) -> None:
    """fsync the remote file through OpenSSH's ``fsync@openssh.com`` extension (no public API)."""
    try:
        sftp._request(CMD_EXTENDED, "fsync@openssh.com", fh.handle)  # type: ignore[attr-defined]
    except IOError as exc:  # a server without the extension: the rename is still atomic
        log.debug("remote fsync not supported: %s", exc)


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")
