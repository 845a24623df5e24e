"""The Host interface: one way to run commands and move files, local or remote.

Local and SSH hosts are twins behind this protocol; the logic above never branches on which one
it holds. Commands are argv lists, never shell strings; every call has a timeout; failures raise
typed errors that carry the ``Result``.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol, Sequence, Tuple, Union

from etcd_agent.errors import CommandError


@dataclass(frozen=True)
class Result:
    """What one command did."""

    host: str
    argv: Tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def check(self) -> "Result":
        """Raise CommandError unless the command exited 0."""
        if self.returncode != 0:
            tail = (self.stderr.strip() or self.stdout.strip()).splitlines()[-3:]
            raise CommandError(
                f"{self.host}: `{self.command}` exited {self.returncode}"
                + (f": {' / '.join(tail)}" if tail else ""),
                self,
            )
        return self


class Session(Protocol):
    """A long-running command on a host, spoken to through its stdin and stdout (the node
    protocol's session). It ends when either side closes: a dead caller closes the stream, so
    the command sees end-of-file."""

    def send(self, data: "Union[bytes, memoryview]") -> None:
        """Write all of ``data`` to the command's stdin; HostUnreachable when the stream is gone.
        It may block for as long as the command does not read (or a cut link does not carry):
        ``abort`` from another thread ends that."""
        ...

    def abort(self) -> None:
        """Drop the session at once, from any thread, waiting for nothing: a send or close
        blocked on it fails. Over SSH this closes the host's connection (every session on it);
        locally it ends the command."""
        ...

    def close_input(self) -> None:
        """Close its stdin (it sees end-of-file) and keep reading what it answers."""
        ...

    def recv_line(self, timeout: float, limit: int) -> bytes:
        """One line of its stdout (with the newline); b"" once it closed stdout; CommandTimedOut
        after ``timeout`` seconds without a full line; OperationFailed past ``limit`` bytes."""
        ...

    def close(self, grace: float = 10.0) -> None:
        """End the session: close stdin and wait up to ``grace`` seconds for the command to end.
        A command still busy then is left to finish on its own (it sees end-of-file next): the
        node server never stops half-way through a step, and is never killed for being slow."""
        ...

    def exit_code(self) -> Optional[int]:
        """Its exit status once it has exited, else None."""
        ...

    def stderr_tail(self) -> str:
        """The last lines it wrote to stderr (for error messages)."""
        ...


class Host(Protocol):
    """A machine the agent can act on."""

    name: str

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = True,
        input: Optional[bytes] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> Result:
        """Run ``argv`` (no shell); raise CommandError on failure when ``check``,
        CommandTimedOut after ``timeout`` seconds (the command is killed)."""
        ...

    def read(self, path: str) -> bytes:
        """The whole content of a (small) file; FileNotFoundError if it is missing."""
        ...

    def write_atomic(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Write via a temporary file in the same dir, fsync, rename: readers never see half."""
        ...

    def exists(self, path: str) -> bool:
        ...

    def put(self, local_path: str, remote_path: str, *, mode: int = 0o600) -> None:
        """Copy a local file to this host (atomically, same rules as write_atomic)."""
        ...

    def get(self, remote_path: str, local_path: str) -> None:
        """Copy a file from this host to a local path."""
        ...

    def spawn(self, argv: Sequence[str]) -> Session:
        """Start ``argv`` (no shell) as a long-running session; HostUnreachable if it cannot."""
        ...

    def spawn_stream(self, argv: Sequence[str]) -> Session:
        """Like ``spawn``, for a session fed bulk data (a restore's snapshot): over SSH it may go
        through the OpenSSH client instead of this process's own connection (``ssh.stream``)."""
        ...

    def close(self) -> None:
        ...


class LineBuffer:
    """Lines out of a byte stream read piecewise: ``read_some(timeout)`` returns bytes, b"" at
    end-of-file, or None when nothing arrived within ``timeout``. Shared by both session twins."""

    def __init__(self, where: str, read_some: "Callable[[float], Optional[bytes]]") -> None:
        self.where = where
        self._read_some = read_some
        self._buf = bytearray()
        self._eof = False

    def line(self, timeout: float, limit: int) -> bytes:
        import time

        from etcd_agent.errors import CommandTimedOut, OperationFailed

        deadline = time.monotonic() + timeout
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                out = bytes(self._buf[: nl + 1])
                del self._buf[: nl + 1]
                return out
            if len(self._buf) > limit:
                raise OperationFailed(f"{self.where}: a reply line longer than {limit} bytes; session dropped")
            if self._eof:
                out = bytes(self._buf)  # a last line without its newline: incomplete, the caller decides
                self._buf.clear()
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommandTimedOut(f"{self.where}: no reply within {timeout:g}s")
            chunk = self._read_some(min(left, 1.0))
            if chunk is None:
                continue
            if not chunk:
                self._eof = True
            self._buf += chunk
