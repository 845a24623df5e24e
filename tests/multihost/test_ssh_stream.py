"""SshHost.spawn_stream: the restore's snapshot through the real OpenSSH client to real sshd in
network namespaces - the bytes arrive intact, the host-key rule is the paramiko path's, and
ending the stream leaves the host's own connection (its lock) alone."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import uuid
from typing import Callable

import pytest

from etcd_agent.config import SshSection
from etcd_agent.errors import HostKeyRejected
from etcd_agent.hosts.local import LocalSession
from etcd_agent.hosts.ssh import SshHost
from etcd_agent.hosts.sshsession import SshSession
from tests.harness.netns import NetnsBed

pytestmark = pytest.mark.multihost

OpenSsh = Callable[..., SshHost]


def test_bulk_data_goes_through_the_openssh_client_intact(netns_bed: NetnsBed, open_ssh: OpenSsh) -> None:
    b = netns_bed.hosts[0]
    h = open_ssh(b.name, b.ip)
    data = os.urandom(24 << 20)
    s = h.spawn_stream(["sha256sum"])
    assert isinstance(s, LocalSession), "ssh.stream = auto with a client installed: the OpenSSH client"
    for i in range(0, len(data), 1 << 20):
        s.send(memoryview(data)[i : i + (1 << 20)])
    s.close_input()
    line = s.recv_line(60, 4096)
    assert line.split()[0].decode() == hashlib.sha256(data).hexdigest()
    s.close(10)
    assert s.exit_code() == 0
    assert h.connects == 0, "the stream did not need the agent's own connection"


def test_a_changed_host_key_stops_the_openssh_client_before_the_command_runs(
        netns_bed: NetnsBed, ssh_cfg: SshSection, open_ssh: OpenSsh, tmp_path: object) -> None:
    b, other = netns_bed.hosts[0], netns_bed.hosts[1]
    kh = os.path.join(str(tmp_path), "known_hosts")
    line = f"{b.ip} {netns_bed.host_public_key(other)}\n"  # ea1's address with ea2's key
    with open(kh, "w") as fh:
        fh.write(line)
    marker = f"/var/tmp/ea-stream-{uuid.uuid4().hex}"
    s = open_ssh(b.name, b.ip, dataclasses.replace(ssh_cfg, known_hosts=kh)).spawn_stream(["touch", marker])
    assert s.recv_line(30, 4096) == b"", "nothing comes back from a host that was not trusted"
    s.close(10)
    assert s.exit_code() == 255
    assert "host key" in s.stderr_tail().lower(), s.stderr_tail()
    with open(kh) as fh:
        assert fh.read() == line, "known_hosts is never written"
    trusted = open_ssh(b.name, b.ip)
    assert not trusted.exists(marker), "the command ran on a host whose key did not match"


def test_a_host_missing_from_known_hosts_is_refused_before_any_client_starts(
        netns_bed: NetnsBed, ssh_cfg: SshSection, open_ssh: OpenSsh, tmp_path: object) -> None:
    b = netns_bed.hosts[0]
    empty = os.path.join(str(tmp_path), "known_hosts")
    open(empty, "w").close()
    with pytest.raises(HostKeyRejected, match="no host key"):
        open_ssh(b.name, b.ip, dataclasses.replace(ssh_cfg, known_hosts=empty)).spawn_stream(["true"])
    assert os.path.getsize(empty) == 0


def test_aborting_the_stream_leaves_the_hosts_connection_up(netns_bed: NetnsBed, open_ssh: OpenSsh) -> None:
    b = netns_bed.hosts[0]
    h = open_ssh(b.name, b.ip)
    assert h.run(["true"], timeout=10).ok
    s = h.spawn_stream(["cat"])
    s.send(b"x" * 65536)
    s.abort()
    s.close(10)
    assert s.exit_code() is not None
    assert h.run(["true"], timeout=10).ok and h.connects == 1, "the same connection, still up"


def test_stream_paramiko_keeps_the_bulk_data_on_the_agents_connection(
        netns_bed: NetnsBed, ssh_cfg: SshSection, open_ssh: OpenSsh) -> None:
    b = netns_bed.hosts[0]
    h = open_ssh(b.name, b.ip, dataclasses.replace(ssh_cfg, stream="paramiko"))
    s = h.spawn_stream(["sha256sum"])
    assert isinstance(s, SshSession)
    s.send(b"etcd")
    s.close_input()
    assert s.recv_line(30, 4096).split()[0].decode() == hashlib.sha256(b"etcd").hexdigest()
    s.close(10)
