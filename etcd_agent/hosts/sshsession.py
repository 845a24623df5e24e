"""SshSession: the remote end of ``SshHost.spawn`` - one channel's stdin, stdout and stderr,
sent through memoryviews, read by lines with a deadline, aborted by closing the connection (the
one way to free a send stuck on a cut link)."""
from __future__ import annotations

import collections
import select
import socket
import threading
from typing import Deque, Optional, Union

import paramiko

from etcd_agent.errors import HostUnreachable, OperationFailed
from etcd_agent.hosts.base import LineBuffer
from etcd_agent.waiting import poll

CHUNK = 32768


class SshSession:
    """The remote end of ``SshHost.spawn``: stdin/stdout/stderr of one channel."""

    def __init__(self, where: str, chan: paramiko.Channel) -> None:
        self.where = where
        self._chan = chan
        self._send_lock = threading.Lock()
        self._err: Deque[str] = collections.deque(maxlen=20)
        self._err_buf = b""
        self._lines = LineBuffer(where, self._read_some)

    def _drain_stderr(self) -> None:
        while self._chan.recv_stderr_ready():
            self._err_buf += self._chan.recv_stderr(CHUNK)
        *full, self._err_buf = self._err_buf.split(b"\n")
        self._err.extend(line.decode("utf-8", "replace") for line in full)
        self._err_buf = self._err_buf[-4096:]

    def _read_some(self, timeout: float) -> Optional[bytes]:
        try:
            select.select([self._chan.fileno()], [], [], timeout)
            self._drain_stderr()
            if self._chan.recv_ready():
                data: bytes = self._chan.recv(CHUNK)
                return data
            if self._chan.eof_received or self._chan.closed:
                return b""
            return None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise HostUnreachable(f"{self.where}: session lost: {exc or type(exc).__name__}") from None

    def send(self, data: Union[bytes, memoryview]) -> None:
        # Channel.send through a memoryview: sendall slices the rest of a bytes object (a copy)
        # after every packet, and a MiB of snapshot is 32 packets
        view = memoryview(data)
        with self._send_lock:
            while view:
                t = self._chan.get_transport()
                if t is None or not t.is_active():  # paramiko drops what is sent on a dead transport
                    raise HostUnreachable(f"{self.where}: session lost: the connection is closed")
                try:
                    n = self._chan.send(view)  # type: ignore[arg-type]  # the stubs say bytes; it takes any buffer
                except (paramiko.SSHException, EOFError, OSError, socket.timeout) as exc:
                    raise HostUnreachable(f"{self.where}: session lost: {exc or type(exc).__name__}") from None
                if n <= 0:
                    raise HostUnreachable(f"{self.where}: the command stopped reading (its channel closed)")
                view = view[n:]

    def abort(self) -> None:
        """Close the whole connection: the one way to free a send or close that waits forever on
        a cut link (paramiko retries a full socket without end); the host reconnects on next use."""
        t = self._chan.get_transport()
        try:
            if t is not None:
                t.close()
            self._chan.close()
        except Exception:  # closing a broken connection may fail in many ways
            pass

    def close_input(self) -> None:
        try:
            self._chan.shutdown_write()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise HostUnreachable(f"{self.where}: session lost: {exc or type(exc).__name__}") from None

    def recv_line(self, timeout: float, limit: int) -> bytes:
        return self._lines.line(timeout, limit)

    def close(self, grace: float = 10.0) -> None:
        try:
            self._chan.shutdown_write()  # the command sees EOF and ends
            t = self._chan.get_transport()
            if grace > 0 and t is not None and t.is_active():  # a dead connection brings no exit status
                poll(self._chan.exit_status_ready, timeout=grace, what=f"{self.where}: session end", interval=0.05)
        except (paramiko.SSHException, EOFError, OSError, OperationFailed):
            pass  # gone already, or it did not end in time: closing the channel ends it
        self._chan.close()

    def exit_code(self) -> Optional[int]:
        if self._chan.exit_status_ready():
            return int(self._chan.recv_exit_status())
        return None

    def stderr_tail(self) -> str:
        return " / ".join(list(self._err)[-3:])
