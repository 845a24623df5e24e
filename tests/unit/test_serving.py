"""``member.serving``: the processes serving a member, found by what they hold, on real processes.

Stand-ins for etcd: ``sh`` run through a link named ``etcd`` (what the process list shows as its
command), holding a file open under a data dir, or a Python process listening on a port.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, Iterator, List

import pytest

from etcd_agent.errors import OperationFailed
from etcd_agent.member.serving import Spots, _address_matches, clear, etcd_name, find, served_by


@pytest.fixture
def procs() -> Iterator[List["subprocess.Popen[bytes]"]]:
    started: List["subprocess.Popen[bytes]"] = []
    yield started
    for p in started:
        p.kill()
        p.wait(10)


def stand_in(tmp: str, procs: List["subprocess.Popen[bytes]"], argv_tail: List[str], env: Dict[str, str]) -> "subprocess.Popen[bytes]":
    """An "etcd" holding ``<data dir>/member/snap/db`` open (sh through a link named etcd,
    reading its stdin: it runs until killed or its stdin closes)."""
    link = os.path.join(tmp, "etcd")
    if not os.path.lexists(link):
        os.symlink("/bin/sh", link)
    db = os.path.join(tmp, "data", "member", "snap", "db")
    fd = os.open(db, os.O_RDONLY)
    try:
        p = subprocess.Popen([link, *argv_tail], stdin=subprocess.PIPE, env=env, pass_fds=(fd,))
    finally:
        os.close(fd)
    procs.append(p)
    return p


def spots(tmp: str, port: int = 1) -> Spots:
    return Spots(member="m1", data_dir=os.path.join(tmp, "data"), ports=(("127.0.0.1", port),), binary="/usr/bin/etcd")


@pytest.fixture
def tmp(tmp_path: object) -> str:
    d = str(tmp_path)
    os.makedirs(os.path.join(d, "data", "member", "snap"))
    open(os.path.join(d, "data", "member", "snap", "db"), "wb").close()
    return d


def test_the_agents_own_etcd_without_a_pid_file_is_found_and_stopped(tmp: str, procs: List) -> None:  # type: ignore[type-arg]
    s = spots(tmp)
    p = stand_in(tmp, procs, [], {"ETCD_NAME": "m1", "ETCD_DATA_DIR": s.data_dir})
    found = find(s, "process")
    assert [(x.pid, x.ours, x.holds_data) for x in found] == [(p.pid, True, True)], found
    assert f"has {s.data_dir}/member/snap/db open" in found[0].how
    assert served_by(s, "process", p.pid).pid == p.pid
    assert [x.pid for x in clear(s, "process")] == [p.pid]
    assert p.wait(10) is not None and find(s, "process") == []


def test_an_etcd_started_by_hand_is_named_and_never_signalled(tmp: str, procs: List) -> None:  # type: ignore[type-arg]
    s = spots(tmp)
    # the same member's name and data dir, but flags on its command line: not how the agent runs it
    p = stand_in(tmp, procs, ["-c", "read x", "--data-dir", s.data_dir], {"ETCD_NAME": "m1"})
    found = find(s, "process")
    assert [(x.pid, x.ours) for x in found] == [(p.pid, False)], found
    with pytest.raises(OperationFailed) as ei:
        clear(s, "process")
    assert f"pid {p.pid} ({os.path.join(tmp, 'etcd')} -c read x --data-dir {s.data_dir})" in ei.value.message
    assert p.poll() is None
    with pytest.raises(OperationFailed):  # nor is it the restored etcd, whatever the backend runs
        served_by(s, "process", 1)


def test_anything_listening_on_the_members_port_is_found(tmp: str, procs: List) -> None:  # type: ignore[type-arg]
    code = ("import socket,sys\ns=socket.socket()\ns.bind(('127.0.0.1',0))\ns.listen()\n"
            "print(s.getsockname()[1],flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    procs.append(p)
    assert p.stdout is not None
    port = int(p.stdout.readline())
    found = find(spots(tmp, port), "process")
    assert [(x.pid, x.ours, x.how) for x in found] == [(p.pid, False, (f"listens on 127.0.0.1:{port}",))]
    assert find(spots(tmp, port), "systemd", main_pid=p.pid)[0].ours  # the unit's MainPID is its own


@pytest.mark.parametrize("listening,host,match", [
    ("0.0.0.0", "10.0.0.1", True), ("::", "10.0.0.1", True), ("10.0.0.1", "10.0.0.1", True),
    ("10.0.0.2", "10.0.0.1", False), ("127.0.0.1", "localhost", True), ("10.0.0.2", "localhost", False),
    ("10.0.0.2", "master-1.example", True),
])
def test_which_listening_addresses_take_a_members_connections(listening: str, host: str, match: bool) -> None:
    assert _address_matches(listening, host) is match


def test_which_programs_are_etcd() -> None:
    assert [n for n in ("etcd", "etcd-3.5.16", "etcd_v3", "etcd-agent", "etcdctl", "etcdutl", "python3") if etcd_name(n)] \
        == ["etcd", "etcd-3.5.16", "etcd_v3"]
