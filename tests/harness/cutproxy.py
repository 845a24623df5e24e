"""A TCP proxy between the agent and a real S3 server (the shared RGW), for faults on the wire that
must not touch the shared gateway: a connection cut ``n`` bytes into a response (the store lost
mid-object), a response held ``n`` bytes in (a download in progress, to kill the agent during it),
and one header of a HEAD response rewritten (a size the store claims). A cut or a hold may be kept
for the response to one request among several at once: the one whose head (request line and
headers) holds a fragment, such as one range of a ranged download (``Range: bytes=8388608-``).
Nothing else is changed: the bytes it forwards are the server's. What was asked is recorded
(``asked``: each request's method, path and Range header, in the order they came).

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
_RANGE_RE = re.compile(rb"(?im)^range:[ \t]*(\S+)[ \t]*\r\n")
_HEAD_MAX = 64 * 1024  # a request head longer than this is matched on its first 64 KiB


class CutProxy:
    """127.0.0.1:<port> forwarding to ``upstream`` (host, port). ``cut_after(n)`` / ``hold_after(n)``
    fire once, on the first response longer than ``n`` bytes (its head counted too); with
    ``request=``, on the first such response to a request whose head holds that fragment (case
    ignored). ``claim_size(fragment, size)`` rewrites the Content-Length of every HEAD response
    for a path holding ``fragment``. ``asked``: (method, path, Range or "") of every request."""

    def __init__(self, upstream: Tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._mu = threading.Lock()
        self._armed: Optional[Tuple[str, int, bytes]] = None  # ("cut" | "hold", bytes, request fragment)
        self._claim: Optional[Tuple[bytes, int]] = None
        self.fired = threading.Event()  # the cut or the hold happened
        self.released = threading.Event()
        self._socks: List[socket.socket] = []
        self.asked: List[Tuple[str, str, str]] = []  # (method, path, Range header or "") of each request
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="cutproxy-accept").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut_after(self, n: int, *, request: str = "") -> None:
        with self._mu:
            self._armed, self._claim = ("cut", n, request.lower().encode()), None
            self.fired.clear()

    def hold_after(self, n: int, *, request: str = "") -> None:
        with self._mu:
            self._armed = ("hold", n, request.lower().encode())
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

    def _take(self, length: int, head: bytes) -> Optional[Tuple[str, int]]:
        """The armed fault, once, for a response that has reached ``length`` bytes past it, to a
        request whose (lowercased) ``head`` holds the fault's fragment."""
        with self._mu:
            if self._armed is None or length <= self._armed[1] or self._armed[2] not in head:
                return None
            (kind, n, _fragment), self._armed = self._armed, None
            return kind, n

    def _asked(self, method: bytes, path: bytes, head: bytes) -> None:
        m = _RANGE_RE.search(head)
        with self._mu:
            self.asked.append((method.decode(), path.decode(errors="replace"),
                               m.group(1).decode(errors="replace") if m else ""))

    def _claimed(self, method: bytes, path: bytes) -> Optional[int]:
        with self._mu:
            if self._claim is not None and method == b"HEAD" and self._claim[0] in path:
                return self._claim[1]
        return None


class _Conn:
    def __init__(self, proxy: CutProxy, client: socket.socket, server: socket.socket) -> None:
        self.p, self.client, self.server = proxy, client, server
        self.request: Tuple[bytes, bytes] = (b"", b"")
        self.head = b""  # the current request's head, lowercased, once whole (or _HEAD_MAX long)
        self.sent = 0  # bytes of the current response forwarded

    def up(self) -> None:
        head: Optional[bytes] = None  # the head of a request still coming in
        try:
            while True:
                data = self.client.recv(65536)
                if not data:
                    break
                m = _REQUEST_RE.match(data)
                if m:  # a new request: its response is counted from 0
                    self.request, self.head, self.sent, head = (m.group(1), m.group(2)), b"", 0, b""
                if head is not None:  # known before its last bytes go: the answer cannot come first
                    head += data
                    end = head.find(b"\r\n\r\n")
                    if end >= 0 or len(head) >= _HEAD_MAX:
                        head = head[:end + 4] if end >= 0 else head[:_HEAD_MAX]
                        self.p._asked(*self.request, head)
                        self.head, head = head.lower(), None
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
                fault = self.p._take(self.sent + len(data), self.head)
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
