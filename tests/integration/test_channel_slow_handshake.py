"""A loaded master answers the HTTP/2 handshake late: a channel must wait for it.

gRPC's ``min_reconnect_backoff_ms`` is also its minimum connect timeout (the connection-backoff
protocol's MIN_CONNECT_TIMEOUT): at 100 ms, a server whose SETTINGS frame comes later than that
(a busy etcd during an outage, a loaded CI machine: "timed out before receiving SETTINGS frame")
is never reached - every attempt is abandoned, and the call fails after its whole deadline.
Real etcd behind a proxy that holds the server's first bytes for a while.
"""
import socket
import threading
import time

import pytest

from etcd_agent.etcd.rpc import EtcdRpc

HOLD = 0.6  # the server's first bytes held this long: six times the old connect timeout


class SlowHandshake:
    """A TCP proxy to ``upstream`` that forwards the server's first bytes only after ``HOLD``."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, HOLD), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, hold: float) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if hold:
                    time.sleep(hold)
                    hold = 0.0
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


@pytest.fixture
def slow(cluster_factory):
    c = cluster_factory(1)
    c.start_static()
    host, port = c.cfg.client_urls[0].split("//")[1].rsplit(":", 1)
    proxy = SlowHandshake(host, int(port))
    yield proxy
    proxy.close()


def test_a_handshake_slower_than_the_old_connect_timeout_still_connects(slow):
    rpc = EtcdRpc(f"http://127.0.0.1:{slow.port}", timeout=5.0)
    try:
        header = rpc.header()
    finally:
        rpc.close()
    assert header.revision >= 1
    assert slow.accepted >= 1


def test_the_client_of_status_and_snapshots_waits_for_it_too(slow):
    from etcd_agent.etcd.client import EtcdClient

    endpoint = f"http://127.0.0.1:{slow.port}"
    with EtcdClient([endpoint], timeout=5.0) as c:
        st = c.status(endpoint)
    assert st.leader
