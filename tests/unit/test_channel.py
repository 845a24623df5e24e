"""The one place etcd's gRPC channels and credentials are built (``etcd/channel``): the options each
use gets, the TLS files read from ``[tls]``, and what an unreadable one looks like to an operator."""
from __future__ import annotations

import ast
import os

import pytest

from etcd_agent.config import TlsSection
from etcd_agent.errors import ConfigError, EtcdError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "etcd_agent")

RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 2000),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _modules():
    for d, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py") and not f.endswith("_pb2.py"):
                path = os.path.join(d, f)
                yield os.path.relpath(path, ROOT), ast.parse(open(path, encoding="utf-8").read())


def test_only_the_channel_module_builds_channels_and_credentials() -> None:
    builders = {"secure_channel", "insecure_channel", "ssl_channel_credentials"}
    found = sorted(
        f"{rel}:{node.lineno} {node.func.attr}"
        for rel, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in builders
    )
    assert found and all(f.startswith("etcd_agent/etcd/channel.py:") for f in found), found


def test_grpc_and_etcd3_are_imported_only_in_the_etcd_room() -> None:
    outside = []
    for rel, tree in _modules():
        if rel.startswith("etcd_agent/etcd/"):
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            outside += [f"{rel}: {n}" for n in names if n.split(".")[0] in ("grpc", "etcd3")]
    assert outside == []


def test_options_of_each_use() -> None:
    from etcd_agent.etcd.channel import options

    # the client's unary calls: reconnect within a second, responses up to its bound
    assert options(64 << 20) == RECONNECT + [("grpc.max_receive_message_length", 64 << 20)]
    # the snapshot download: read on the caller's thread, a fixed 1 MiB window
    assert options(64 << 20, single_threaded_streams=True, fixed_window=True) == RECONNECT + [
        ("grpc.max_receive_message_length", 64 << 20),
        ("SingleThreadedUnaryStream", 1),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 1024 * 1024),
    ]
    # watches and replays: both directions bounded, a dead peer noticed by keepalive
    assert options(256 << 20, max_send=256 << 20, keepalive=True, single_threaded_streams=True) == RECONNECT + [
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 256 << 20),
        ("grpc.keepalive_time_ms", 10000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("SingleThreadedUnaryStream", 1),
    ]


def test_each_client_opens_its_channel_here_with_its_options(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent.etcd import channel
    from etcd_agent.etcd.client import MAX_RESPONSE, EtcdClient
    from etcd_agent.etcd.rpc import MAX_MESSAGE, EtcdRpc

    opened = []

    class Refused(Exception):
        pass

    def recording(endpoint, tls, opts):  # type: ignore[no-untyped-def]
        opened.append((endpoint, tls, opts))
        raise Refused(endpoint)  # fails closed: nothing is called on a channel that is not there

    monkeypatch.setattr(channel, "open_channel", recording)
    tls = TlsSection(client_ca="/etc/ca.crt")
    with pytest.raises(Refused):
        EtcdClient(["https://10.0.0.1:2379"], tls=tls).status("https://10.0.0.1:2379")
    with pytest.raises(Refused):
        next(EtcdClient(["https://10.0.0.1:2379"], tls=tls).snapshot_chunks("https://10.0.0.1:2379"))
    for single in (False, True):
        with pytest.raises(Refused):
            EtcdRpc("https://10.0.0.2:2379", tls=tls, single_threaded_streams=single)
    assert opened == [
        ("https://10.0.0.1:2379", tls, channel.options(MAX_RESPONSE)),
        ("https://10.0.0.1:2379", tls, channel.options(MAX_RESPONSE, single_threaded_streams=True, fixed_window=True)),
        ("https://10.0.0.2:2379", tls, channel.options(MAX_MESSAGE, max_send=MAX_MESSAGE, keepalive=True)),
        ("https://10.0.0.2:2379", tls, channel.options(MAX_MESSAGE, max_send=MAX_MESSAGE, keepalive=True,
                                                       single_threaded_streams=True)),
    ]


def test_endpoints_and_targets() -> None:
    from etcd_agent.etcd.channel import parse_endpoint, target

    assert parse_endpoint("https://10.0.0.1:2379") == ("10.0.0.1", 2379, True)
    assert parse_endpoint("http://[fd00::1]:2379") == ("fd00::1", 2379, False)
    assert target("fd00::1", 2379) == "[fd00::1]:2379" and target("m1", 2379) == "m1:2379"
    for bad in ("unix:///run/etcd.sock", "https://10.0.0.1", "10.0.0.1:2379"):
        with pytest.raises(EtcdError, match="bad etcd endpoint"):
            parse_endpoint(bad)


def test_tls_files_come_from_the_config_in_grpcs_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent.etcd.channel import tls_material

    for name in ("ca.crt", "me.crt", "me.key"):
        (tmp_path / name).write_bytes(f"-- {name} --".encode())
    os.symlink(tmp_path / "ca.crt", tmp_path / "ca-link.crt")  # certificates are often links
    full = TlsSection(client_ca=str(tmp_path / "ca-link.crt"), client_cert=str(tmp_path / "me.crt"),
                      client_key=str(tmp_path / "me.key"), peer_cert="/nonexistent/peer.crt")
    # grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
    assert tls_material(full) == (b"-- ca.crt --", b"-- me.key --", b"-- me.crt --")
    assert tls_material(TlsSection(client_ca=str(tmp_path / "ca.crt"))) == (b"-- ca.crt --", None, None)


def test_https_without_a_client_ca_is_refused() -> None:
    from etcd_agent.etcd.channel import credentials, open_channel

    for tls in (None, TlsSection(client_cert="/x.crt", client_key="/x.key")):
        with pytest.raises(EtcdError, match=r"https endpoint but no \[tls\] client_ca configured"):
            credentials(tls)
        with pytest.raises(EtcdError, match=r"no \[tls\] client_ca"):
            open_channel("https://127.0.0.1:2379", tls, [])


def test_only_https_reads_the_tls_files() -> None:
    from etcd_agent.etcd.channel import open_channel

    tls = TlsSection(client_ca="/nonexistent/ca.crt")
    open_channel("http://127.0.0.1:1", tls, []).close()  # plain http: the files are never read
    with pytest.raises(ConfigError, match="tls.client_ca: cannot read /nonexistent/ca.crt"):
        open_channel("https://127.0.0.1:1", tls, [])


def test_an_unreadable_tls_file_is_a_config_error_naming_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent.etcd.channel import credentials

    (tmp_path / "ca.crt").write_bytes(b"ca")
    gone = str(tmp_path / "gone.crt")
    with pytest.raises(ConfigError) as err:
        credentials(TlsSection(client_ca=str(tmp_path / "ca.crt"), client_cert=gone, client_key=gone))
    assert err.value.message == f"tls.client_key: cannot read {gone}: No such file or directory"
    # a FIFO where the CA should be: refused at once, never a read that blocks
    fifo = str(tmp_path / "ca.fifo")
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as err:
        credentials(TlsSection(client_ca=fifo))
    assert err.value.message == f"tls.client_ca: {fifo} is a FIFO, not a regular file"
    with pytest.raises(ConfigError, match=r"tls.client_ca: .* is a directory, not a regular file"):
        credentials(TlsSection(client_ca=str(tmp_path)))
