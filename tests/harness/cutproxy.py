"""A TCP proxy between the agent and a real S3 server (the shared RGW), for faults on the wire that
must not touch the shared gateway: a connection cut ``n`` bytes into a response (the store lost
mid-object), a response held ``n`` bytes in (a download in progress, to kill the agent during it),
and one header of a HEAD response rewritten (a size the store claims). Nothing else is changed: the
bytes it forwards are the server's.

One response at a time per connection (what an HTTP/1.1 client without pipelining sends): the
count of a response's bytes starts again when the client sends its next request.
"""
from __future__ import annotations

import re
import socket
import threading
from typing import List, Optional, Tuple

_REQUEST_RE = re.compile(rb"^([A-Z]+) (\S+) HTTP/1\.[01]\r\n")
_LENGTH_RE = re.compile(rb"(?im)^content-length:[ \t]*\d+\r\n")


class CutProxy:
    """127.0.0.1:<port> forwarding to ``upstream`` (host, port). ``cut_after(n)`` / ``hold_after(n)``
    fire once, on the first response longer than ``n`` bytes; ``claim_size(fragment, size)`` rewrites
    the Content-Length of every HEAD response for a path holding ``fragment``."""

    def __init__(self, upstream: Tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._mu = threading.Lock()
        self._armed: Optional[Tuple[str, int]] = None  # ("cut" | "hold", bytes)
        self._claim: Optional[Tuple[bytes, int]] = None
        self.fired = threading.Event()  # the cut or the hold happened
        self.released = threading.Event()
        self._socks: List[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="cutproxy-accept").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut_after(self, n: int) -> None:
        with self._mu:
            self._armed, self._claim = ("cut", n), None
            self.fired.clear()

    def hold_after(self, n: int) -> None:
        with self._mu:
            self._armed = ("hold", n)
            self.fired.clear()
            self.released.clear()

    def claim_size(self, fragment: str, size: int) -> None:
        with self._mu:
            self._claim = (fragment.encode(), size)

    def reset(self) -> None:
        """Forward everything as it is again; a held response is let go (its connection closed)."""
        with self._mu:
            self._armed, self._claim = None, None
        self.released.set()

    def close(self) -> None:
        self._closed = True
        self.reset()
        self._listener.close()
        with self._mu:
            socks, self._socks = self._socks, []
        for s in socks:
            _close(s)

    # ---------------------------------------------------------------- the forwarding

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _addr = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._mu:
                self._socks += [client, server]
            conn = _Conn(self, client, server)
            threading.Thread(target=conn.up, daemon=True, name="cutproxy-up").start()
            threading.Thread(target=conn.down, daemon=True, name="cutproxy-down").start()

    def _take(self, length: int) -> Optional[Tuple[str, int]]:
        """The armed fault, once, for a response that has reached ``length`` bytes past it."""
        with self._mu:
            if self._armed is None or length <= self._armed[1]:
                return None
            fault, self._armed = self._armed, None
            return fault

    def _claimed(self, method: bytes, path: bytes) -> Optional[int]:
        with self._mu:
            if self._claim is not None and method == b"HEAD" and self._claim[0] in path:
                return self._claim[1]
        return None


class _Conn:
    def __init__(self, proxy: CutProxy, client: socket.socket, server: socket.socket) -> None:
        self.p, self.client, self.server = proxy, client, server
        self.request: Tuple[bytes, bytes] = (b"", b"")
        self.sent = 0  # bytes of the current response forwarded

    def up(self) -> None:
        try:
            while True:
                data = self.client.recv(65536)
                if not data:
                    break
                m = _REQUEST_RE.match(data)
                if m:  # a new request: its response is counted from 0
                    self.request, self.sent = (m.group(1), m.group(2)), 0
                self.server.sendall(data)
        except OSError:
            pass
        finally:
            _close(self.server)

    def down(self) -> None:
        pending = b""
        try:
            while True:
                data = self.server.recv(65536)
                if not data:
                    break
                claim = self.p._claimed(*self.request) if self.sent == 0 else None
                if claim is not None:  # a HEAD response has no body: its head is all of it
                    pending += data
                    if b"\r\n\r\n" not in pending:
                        continue
                    data, pending = _LENGTH_RE.sub(f"Content-Length: {claim}\r\n".encode(), pending, count=1), b""
                fault = self.p._take(self.sent + len(data))
                if fault is None:
                    self.client.sendall(data)
                    self.sent += len(data)
                    continue
                kind, n = fault
                self.client.sendall(data[:n - self.sent])
                self.sent = n
                self.p.fired.set()
                if kind == "hold":
                    self.p.released.wait(300)
                break
        except OSError:
            pass
        finally:
            _close(self.client)
            _close(self.server)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
