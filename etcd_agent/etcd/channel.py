"""Every gRPC channel to etcd, and its credentials, built here: the client's calls and snapshots
(``client``, also the credentials of etcd3's KV client) and the raw Watch/Txn/Lease transport
(``rpc``) get their target, TLS files and options from one place, so the two cannot drift.

The TLS files are ``[tls]``'s client CA, certificate and key, read as regular files (a FIFO there
would block the read for ever) and bounded; one that cannot be read is a ConfigError naming the
key and the file, not an OSError from deep inside a call.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, List, Optional, Tuple
from urllib.parse import urlsplit

from etcd_agent.errors import ConfigError, EtcdError
from etcd_agent.fs import NotARegularFile, read_regular

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import TlsSection

# gRPC's fork handlers restart its poller in a forked child; with channels busy in the parent
# that child can abort (EBADF on epoll) before it execs - seen here with grpcio 1.80 as
# `etcdutl` "exiting" with SIGABRT; grpc/grpc#43055. The agent forks only to exec, so it needs
# no fork support (the CLI sets it too). Read when grpc initialises: grpc is imported after this
# module, which builds every channel.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# a PEM file: a CA bundle of every public CA is ~250 KiB
TLS_FILE_LIMIT = 16 << 20

Options = List[Tuple[str, int]]

# the least time a connect attempt is given (see ``options``): 20x a loaded machine's slowest
# handshake seen here, yet an attempt into a cut link (SYN dropped) still gives way to the next
# within 2 s once the link is back
CONNECT_TIMEOUT_MS = 2000


def parse_endpoint(url: str) -> Tuple[str, int, bool]:
    """``https://10.0.0.1:2379`` -> (host, port, secure)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
        raise EtcdError(f"bad etcd endpoint {url!r}")
    return parts.hostname, parts.port, parts.scheme == "https"


def target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def options(
    max_receive: int,
    *,
    max_send: Optional[int] = None,
    keepalive: bool = False,
    single_threaded_streams: bool = False,
    fixed_window: bool = False,
) -> Options:
    """A channel's options: ``max_receive`` (and ``max_send``) bound the messages; ``keepalive``
    for long streams; ``single_threaded_streams`` reads server streams on the caller's thread;
    ``fixed_window`` holds the receive window at 1 MiB (one long download)."""
    # gRPC's reconnect backoff grows to 120 s by default; an agent polling a restarted etcd wants
    # ~1 s. `min_reconnect_backoff_ms` is not part of that wait: it is the least time one connect
    # attempt is given (TCP, TLS and the server's HTTP/2 SETTINGS; MIN_CONNECT_TIMEOUT of gRPC's
    # connection-backoff protocol). At 100 ms a loaded master's etcd, or one still starting with its
    # port open, was never reached ("timed out before receiving SETTINGS frame"); each call's own
    # deadline still bounds the wait.
    out: Options = [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.max_receive_message_length", max_receive),
    ]
    if max_send is not None:
        out.append(("grpc.max_send_message_length", max_send))
    if keepalive:
        # a dead peer (host gone, no RST) under an open watch is noticed within ~15 s instead of
        # the TCP timeout. etcd's enforcement (--grpc-keepalive-min-time 5 s, pings only with a
        # stream open) answers pings on an idle channel with GOAWAY "too_many_pings": so none
        out += [
            ("grpc.keepalive_time_ms", 10000),
            ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    if single_threaded_streams:
        # server-streaming calls read their messages on the caller's thread instead of through
        # the channel's polling thread: one thread hop less per message (a snapshot: ~40 % less
        # CPU per MB; 500 watch responses/s: 4.8 % of a core against 5.6 %).
        # grpc.experimental.ChannelOptions.SingleThreadedUnaryStream
        out.append(("SingleThreadedUnaryStream", 1))
    if fixed_window:
        # the receive window fixed at 1 MiB instead of growing with BDP probing, which let gRPC
        # buffer tens of MB ahead of a busy reader (the agent's peak RSS)
        out += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024 * 1024)]
    return out


def _read_tls(key: str, path: Optional[str]) -> Optional[bytes]:
    if not path:
        return None
    try:
        return read_regular(path, TLS_FILE_LIMIT)
    except NotARegularFile as exc:
        raise ConfigError(f"tls.{key}: {path} {exc.strerror}") from None
    except OSError as exc:
        raise ConfigError(f"tls.{key}: cannot read {path}: {exc.strerror or exc}") from None


def tls_material(tls: "TlsSection") -> Tuple[Optional[bytes], Optional[bytes], Optional[bytes]]:
    """(CA, key, certificate) of ``[tls]``'s client side: ``grpc.ssl_channel_credentials``'s order."""
    return _read_tls("client_ca", tls.client_ca), _read_tls("client_key", tls.client_key), \
        _read_tls("client_cert", tls.client_cert)


def credentials(tls: "Optional[TlsSection]") -> Any:
    """The channel credentials of an https endpoint (also handed to etcd3's KV client)."""
    import grpc

    if tls is None or not tls.client_ca:
        raise EtcdError("https endpoint but no [tls] client_ca configured")
    return grpc.ssl_channel_credentials(*tls_material(tls))


def open_channel(endpoint: str, tls: "Optional[TlsSection]", opts: Options) -> Any:
    """A channel to one etcd endpoint: TLS with ``[tls]``'s files for https, plain for http."""
    import grpc
    import grpc.experimental  # noqa: F401  # read by grpc when a channel has SingleThreadedUnaryStream

    host, port, secure = parse_endpoint(endpoint)
    if secure:
        return grpc.secure_channel(target(host, port), credentials(tls), options=opts)
    return grpc.insecure_channel(target(host, port), options=opts)
