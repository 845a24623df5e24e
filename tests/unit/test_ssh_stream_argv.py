"""The OpenSSH client's command line for a restore's stream: the trust rules spelled out, and the
cases that keep the stream on paramiko (pure logic; tests/multihost/test_ssh_stream.py runs it)."""
from __future__ import annotations

import os
import shlex
from typing import Dict, List

import pytest

from etcd_agent.config import SshSection
from etcd_agent.errors import HostUnreachable
from etcd_agent.hosts import openssh as openssh_mod
from etcd_agent.hosts.ssh import SshHost, remote_command


@pytest.fixture
def key(tmp_path: object) -> str:
    path = os.path.join(str(tmp_path), "id_ed25519")
    open(path, "w").close()
    return path


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(openssh_mod.shutil, "which", lambda name: "/usr/bin/ssh" if name == "ssh" else None)
    return "/usr/bin/ssh"


def options(words: List[str]) -> Dict[str, str]:
    out = {}
    for flag, value in zip(words, words[1:]):
        if flag == "-o":
            name, _, v = value.partition("=")
            out[name] = v
    return out


def test_the_client_trusts_only_the_configured_known_hosts_and_identity(key: str, client: str) -> None:
    cfg = SshSection(user="etcdops", port=2222, identity_file=key, known_hosts="/etc/etcd-agent/known_hosts",
                     connect_timeout=2.5)
    command = remote_command(["/usr/bin/etcd-agent", "node", "receive", "--idle-timeout", "70"])
    words = SshHost("m2", "10.0.0.2", cfg).openssh_argv(command)
    assert words is not None
    assert words[:3] == [client, "-F", "/dev/null"], "no ssh_config is read"
    assert words[-3:] == ["--", "10.0.0.2", command], "the address can never be taken for an option"
    assert words[words.index("-p") + 1] == "2222" and words[words.index("-l") + 1] == "etcdops"
    assert [words[i + 1] for i, w in enumerate(words) if w == "-i"] == [key]
    o = options(words)
    assert o["StrictHostKeyChecking"] == "yes" and o["UserKnownHostsFile"] == "/etc/etcd-agent/known_hosts"
    assert o["GlobalKnownHostsFile"] == "/dev/null" and o["UpdateHostKeys"] == "no"
    assert o["BatchMode"] == "yes" and o["IdentitiesOnly"] == "yes" and o["IdentityAgent"] == "none"
    assert o["ForwardAgent"] == "no" and o["ClearAllForwardings"] == "yes"
    assert o["ConnectTimeout"] == "3", "whole seconds, rounded up"
    assert o["Ciphers"].split(",")[0] == "aes128-gcm@openssh.com"
    assert not any(c.endswith("-cbc") or "arcfour" in c for c in o["Ciphers"].split(","))
    assert shlex.split(words[-1])[2:4] == ["receive", "--idle-timeout"]


def test_stream_paramiko_or_no_client_keeps_the_stream_on_paramiko(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openssh_mod.shutil, "which", lambda name: "/usr/bin/ssh")
    assert SshHost("m2", "10.0.0.2", SshSection(identity_file=key, stream="paramiko")).openssh_argv("true") is None
    monkeypatch.setattr(openssh_mod.shutil, "which", lambda name: None)
    assert SshHost("m2", "10.0.0.2", SshSection(identity_file=key)).openssh_argv("true") is None
    with pytest.raises(HostUnreachable, match="no ssh client"):
        SshHost("m2", "10.0.0.2", SshSection(identity_file=key, stream="openssh")).openssh_argv("true")


@pytest.mark.parametrize("path", ["/etc/etcd agent/known_hosts", "/etc/%h/known_hosts", "~/.ssh/known_hosts",
                                  "relative/known_hosts", "/etc/k\"h"])
def test_a_path_the_client_would_read_differently_keeps_the_stream_on_paramiko(
        path: str, key: str, client: str) -> None:
    assert SshHost("m2", "10.0.0.2", SshSection(identity_file=key, known_hosts=path)).openssh_argv("true") is None
    with pytest.raises(HostUnreachable, match="cannot be given"):
        SshHost("m2", "10.0.0.2", SshSection(identity_file=key, known_hosts=path, stream="openssh")).openssh_argv("true")


def test_without_an_identity_file_the_default_keys_that_exist_are_named(
        tmp_path: object, client: str, monkeypatch: pytest.MonkeyPatch) -> None:
    home = str(tmp_path)
    os.makedirs(os.path.join(home, ".ssh"))
    open(os.path.join(home, ".ssh", "id_rsa"), "w").close()
    monkeypatch.setenv("HOME", home)
    words = SshHost("m2", "10.0.0.2", SshSection()).openssh_argv("true")
    assert words is not None
    assert [words[i + 1] for i, w in enumerate(words) if w == "-i"] == [os.path.join(home, ".ssh", "id_rsa")]
    os.unlink(os.path.join(home, ".ssh", "id_rsa"))
    assert SshHost("m2", "10.0.0.2", SshSection()).openssh_argv("true") is None, "no key: paramiko says why"
