"""SshHost against real sshd processes in network namespaces (host keys, timeouts, SFTP, partitions)."""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import subprocess
import time
from typing import Callable, Iterator, List

import psutil
import pytest

from etcd_agent.config import SshSection
from etcd_agent.errors import (
    CommandError,
    CommandTimedOut,
    HostKeyRejected,
    HostUnreachable,
)
from etcd_agent.hosts.ssh import KILL_GRACE, SshHost
from tests.harness.netns import NetnsBed

from .conftest import CONNECT_TIMEOUT

pytestmark = pytest.mark.multihost

OpenSsh = Callable[..., SshHost]
# The timeouts under test are seconds; the commands they cut would run 31 s. A bound well above
# the timeout and far below the command proves the cut without timing the machine (loaded CI).
SLACK = 5.0


def fp_of(public_key_line: str) -> str:
    """SHA256 fingerprint of ``"<type> <base64>"``, computed independently of the code under test."""
    blob = base64.b64decode(public_key_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


@pytest.fixture
def h1(netns_bed: NetnsBed, open_ssh: OpenSsh) -> SshHost:
    b = netns_bed.hosts[0]
    return open_ssh(b.name, b.ip)


@pytest.fixture
def remote_dir(h1: SshHost) -> Iterator[str]:
    d = h1.run(["mktemp", "-d", "/var/tmp/ea-sftp.XXXXXX"], timeout=10).stdout.strip()
    yield d
    h1.run(["rm", "-rf", "--", d], timeout=10)


def _procs_with_cmdline(argv: List[str]) -> List[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if p.info["cmdline"] == argv:
            found.append(p)
    return found


def _gone(argv: List[str], within: float) -> bool:
    deadline = time.monotonic() + within
    while _procs_with_cmdline(argv):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ------------------------------------------------------------------ commands


def test_runs_on_each_host_with_exit_codes_and_streams(netns_bed: NetnsBed, open_ssh: OpenSsh) -> None:
    for b in netns_bed.hosts:
        h = open_ssh(b.name, b.ip)
        res = h.run(["hostname"], timeout=10)
        assert res.stdout.strip() == b.name and res.returncode == 0 and res.host == b.name
    h = open_ssh("ea1", netns_bed.hosts[0].ip)
    res = h.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10, check=False)
    assert (res.returncode, res.stdout, res.stderr) == (3, "out\n", "err\n")
    with pytest.raises(CommandError) as ei:
        h.run(["sh", "-c", "echo boom >&2; exit 7"], timeout=10)
    assert ei.value.result.returncode == 7 and "boom" in str(ei.value)
    # a command that does not exist is a CommandError with the shell's 127, not a transport error
    with pytest.raises(CommandError) as ei:
        h.run(["/nonexistent/cmd"], timeout=10)
    assert ei.value.result.returncode == 127


def test_argv_arrives_intact_without_shell_injection(h1: SshHost, tmp_path: object) -> None:
    marker = f"/tmp/ea-pwned-{os.getpid()}"
    nasty = [
        "a b", "it's", '"dq"', f"$(touch {marker})", f"; touch {marker}", f"`touch {marker}`",
        "*", "~", "$HOME", "\\", "", "x\ny", "-n", "ünï", "a|b&c>d",
    ]
    res = h1.run(["printf", "%s\\0", *nasty], timeout=10)
    assert res.stdout.split("\0")[:-1] == nasty
    assert not h1.exists(marker) and not os.path.exists(marker)


def test_env_is_passed_quoted_and_names_validated(h1: SshHost) -> None:
    value = "a b $(id) ' \" ; `x`"
    res = h1.run(["sh", "-c", 'printf %s "$EA_VALUE"'], timeout=10, env={"EA_VALUE": value})
    assert res.stdout == value
    with pytest.raises(ValueError):
        h1.run(["true"], timeout=10, env={"BAD NAME; rm": "x"})


def test_stdin_small_and_large(h1: SshHost) -> None:
    assert h1.run(["cat"], timeout=10, input=b"hello\nworld").stdout == "hello\nworld"
    # larger than every SSH window: stdin and stdout must be pumped together
    big = (b"0123456789abcdef" * 65536) * 3  # 3 MiB
    res = h1.run(["sh", "-c", "cat; echo done >&2"], timeout=30, input=big)
    assert res.stdout.encode() == big and res.stderr == "done\n"
    # without input the command sees EOF at once instead of hanging
    assert h1.run(["cat"], timeout=5).stdout == ""


def test_timeout_kills_remote_command_and_keeps_partial_output(h1: SshHost) -> None:
    sleeper = ["sleep", "31.4159"]
    start = time.monotonic()
    with pytest.raises(CommandTimedOut) as ei:
        h1.run(["sh", "-c", "echo partial; exec sleep 31.4159"], timeout=1.0)
    elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 1.0 + SLACK
    res = ei.value.result
    assert res.returncode == -1 and res.stdout == "partial\n"
    assert _gone(sleeper, 2.0), "the remote command survived its timeout"
    # a command that ignores TERM gets KILL after the grace period
    start = time.monotonic()
    with pytest.raises(CommandTimedOut):
        h1.run(["sh", "-c", "trap '' TERM; exec sleep 27.1828"], timeout=0.5)
    assert time.monotonic() - start < 0.5 + KILL_GRACE + SLACK
    assert _gone(["sleep", "27.1828"], 2.0)
    # the same transport still works afterwards
    assert h1.run(["echo", "ok"], timeout=10).stdout == "ok\n" and h1.connects == 1


def test_one_transport_is_reused(h1: SshHost, remote_dir: str) -> None:
    h1.run(["true"], timeout=10)
    t = h1._transport
    h1.run(["true"], timeout=10)
    h1.write_atomic(f"{remote_dir}/f", b"x")
    assert h1.read(f"{remote_dir}/f") == b"x"
    assert h1.connects == 1 and h1._transport is t


# ------------------------------------------------------------------ host keys and reachability


def test_unknown_host_key_is_refused(netns_bed: NetnsBed, ssh_cfg: SshSection, open_ssh: OpenSsh, tmp_path: object) -> None:
    b = netns_bed.hosts[0]
    empty = os.path.join(str(tmp_path), "known_hosts")
    open(empty, "w").close()
    with pytest.raises(HostKeyRejected) as ei:
        open_ssh(b.name, b.ip, dataclasses.replace(ssh_cfg, known_hosts=empty)).run(["true"], timeout=10)
    msg = str(ei.value)
    assert b.name in msg and b.ip in msg and fp_of(netns_bed.host_public_key(b)) in msg
    assert "not in" in msg
    assert os.path.getsize(empty) == 0, "an unknown key must never be added"
    # entries for other hosts do not help
    other = os.path.join(str(tmp_path), "known_hosts_other")
    with open(other, "w") as fh:
        fh.write(f"{netns_bed.hosts[1].ip} {netns_bed.host_public_key(netns_bed.hosts[1])}\n")
    with pytest.raises(HostKeyRejected):
        open_ssh(b.name, b.ip, dataclasses.replace(ssh_cfg, known_hosts=other)).run(["true"], timeout=10)
    # a missing known_hosts file is a refusal too, not an implicit ~/.ssh/known_hosts
    with pytest.raises(HostKeyRejected, match="does not exist"):
        open_ssh(b.name, b.ip, dataclasses.replace(ssh_cfg, known_hosts=empty + ".missing")).run(
            ["true"], timeout=10
        )


def test_changed_host_key_is_refused(netns_bed: NetnsBed, ssh_cfg: SshSection, open_ssh: OpenSsh, tmp_path: object) -> None:
    b, other = netns_bed.hosts[0], netns_bed.hosts[1]
    kh = os.path.join(str(tmp_path), "known_hosts")
    with open(kh, "w") as fh:  # ea1's address with ea2's key: what a changed key looks like
        fh.write(f"{b.ip} {netns_bed.host_public_key(other)}\n")
    with pytest.raises(HostKeyRejected) as ei:
        open_ssh(b.name, b.ip, dataclasses.replace(ssh_cfg, known_hosts=kh)).run(["true"], timeout=10)
    msg = str(ei.value)
    assert "CHANGED" in msg and b.name in msg
    assert fp_of(netns_bed.host_public_key(b)) in msg and fp_of(netns_bed.host_public_key(other)) in msg


def test_auth_failure_is_unreachable(netns_bed: NetnsBed, ssh_cfg: SshSection, open_ssh: OpenSsh, tmp_path: object) -> None:
    key = os.path.join(str(tmp_path), "stranger")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True, timeout=30)
    b = netns_bed.hosts[0]
    start = time.monotonic()
    with pytest.raises(HostUnreachable) as ei:
        open_ssh(b.name, b.ip, dataclasses.replace(ssh_cfg, identity_file=key)).run(["true"], timeout=10)
    assert not isinstance(ei.value, HostKeyRejected)
    assert "authentication failed" in str(ei.value)
    assert time.monotonic() - start < CONNECT_TIMEOUT + SLACK


def test_address_without_host_times_out_within_connect_timeout(netns_bed: NetnsBed, open_ssh: OpenSsh) -> None:
    h = open_ssh("ghost", f"{netns_bed.subnet}.200")  # in the bed's subnet, nobody answers
    start = time.monotonic()
    with pytest.raises(HostUnreachable) as ei:
        h.run(["true"], timeout=30)
    elapsed = time.monotonic() - start
    assert elapsed < CONNECT_TIMEOUT + SLACK
    assert "ghost" in str(ei.value) and "timed out" in str(ei.value)


def test_stopped_sshd_is_unreachable_then_reconnects(netns_bed: NetnsBed, open_ssh: OpenSsh) -> None:
    b = netns_bed.hosts[1]
    h = open_ssh(b.name, b.ip)
    assert h.run(["hostname"], timeout=10).stdout.strip() == b.name
    try:
        netns_bed.stop_sshd(b)
        start = time.monotonic()
        with pytest.raises(HostUnreachable) as ei:
            h.run(["true"], timeout=10)
        assert time.monotonic() - start < CONNECT_TIMEOUT + SLACK
        assert "refused" in str(ei.value).lower()
    finally:
        netns_bed.restart_sshd(b)
    assert h.run(["hostname"], timeout=10).stdout.strip() == b.name
    assert h.connects == 2


def test_reconnects_after_sshd_restart(netns_bed: NetnsBed, open_ssh: OpenSsh) -> None:
    b = netns_bed.hosts[1]
    h = open_ssh(b.name, b.ip)
    h.run(["true"], timeout=10)
    netns_bed.restart_sshd(b)  # kills the sessions too: the old transport is dead
    assert h.run(["hostname"], timeout=10).stdout.strip() == b.name
    assert h.connects == 2


def test_partition_makes_host_unreachable_and_heals(netns_bed: NetnsBed, open_ssh: OpenSsh) -> None:
    b = netns_bed.hosts[2]
    h = open_ssh(b.name, b.ip)
    h.run(["true"], timeout=10)
    netns_bed.set_link(b, False)
    try:
        start = time.monotonic()
        with pytest.raises((HostUnreachable, CommandTimedOut)):
            h.run(["true"], timeout=5)  # on the existing transport
        assert time.monotonic() - start < CONNECT_TIMEOUT + SLACK
        fresh = open_ssh(b.name, b.ip)
        start = time.monotonic()
        with pytest.raises(HostUnreachable, match="timed out"):
            fresh.run(["true"], timeout=5)  # a new connection
        assert time.monotonic() - start < CONNECT_TIMEOUT + SLACK
    finally:
        netns_bed.set_link(b, True)
    assert h.run(["hostname"], timeout=10).stdout.strip() == b.name


# ------------------------------------------------------------------ files over SFTP


def _stat_mode(h: SshHost, path: str) -> str:
    return h.run(["stat", "-c", "%a", path], timeout=10).stdout.strip()


def test_write_atomic_read_exists_and_modes(h1: SshHost, remote_dir: str) -> None:
    p = f"{remote_dir}/secret.conf"
    assert not h1.exists(p)
    h1.write_atomic(p, b"token=s3cret\n")
    assert h1.exists(p) and h1.read(p) == b"token=s3cret\n" and _stat_mode(h1, p) == "600"
    h1.write_atomic(p, b"v2", mode=0o644)  # replaces, with the new mode
    assert h1.read(p) == b"v2" and _stat_mode(h1, p) == "644"
    h1.write_atomic(f"{remote_dir}/empty", b"")
    assert h1.read(f"{remote_dir}/empty") == b""
    assert sorted(h1.run(["ls", "-A", remote_dir], timeout=10).stdout.split()) == ["empty", "secret.conf"]
    with pytest.raises(FileNotFoundError):
        h1.read(f"{remote_dir}/missing")
    with pytest.raises(FileNotFoundError):  # the directory must exist; nothing is left behind
        h1.write_atomic(f"{remote_dir}/no/such/dir/f", b"x")


def test_put_and_get_round_trip(h1: SshHost, remote_dir: str, tmp_path: object) -> None:
    src = os.path.join(str(tmp_path), "snapshot.db")
    data = os.urandom(3 * 1024 * 1024 + 17)
    with open(src, "wb") as fh:
        fh.write(data)
    dst = f"{remote_dir}/etcd_snapshot.db"
    h1.put(src, dst)
    assert _stat_mode(h1, dst) == "600"
    remote_sum = h1.run(["sha256sum", dst], timeout=10).stdout.split()[0]
    assert remote_sum == hashlib.sha256(data).hexdigest()
    back = os.path.join(str(tmp_path), "back.db")
    h1.get(dst, back)
    with open(back, "rb") as fh:
        assert fh.read() == data
    assert os.stat(back).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(str(tmp_path))) == ["back.db", "snapshot.db"]
    assert h1.run(["ls", "-A", remote_dir], timeout=10).stdout.split() == ["etcd_snapshot.db"]
    with pytest.raises(FileNotFoundError):
        h1.put(os.path.join(str(tmp_path), "nope"), dst)
    with pytest.raises(FileNotFoundError):
        h1.get(f"{remote_dir}/nope", back)
    assert sorted(os.listdir(str(tmp_path))) == ["back.db", "snapshot.db"]


# ------------------------------------------------------------------ factory
