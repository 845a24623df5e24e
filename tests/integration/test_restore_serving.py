"""A restore is done only when the restored data is served (issue 38, item 2).

The etcds serving a member are found by what they hold (files under its data dir, its ports),
not by the agent's pid files: an etcd whose pid file is gone is still stopped before its data dir
moves, and an etcd the agent did not start (by hand, on the member's data dir) is refused before
anything is touched. Real etcd 3.5.16 on loopback, the process backend, the CLI as operators run it.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import List

import psutil
import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.member.process import ProcessBackend
from etcd_agent.restore.host.facts import work_dir_for
from etcd_agent.waiting import poll
from tests.harness.loopback import LoopbackCluster

from .test_restore import AGENT, cli, make

pytestmark = pytest.mark.integration


def later_on_each(c: LoopbackCluster) -> List[int]:
    """How many /later/ keys each member itself serves (asked at its own endpoint)."""
    out = []
    for m in c.cfg.members:
        with EtcdClient([m.client_url], timeout=5.0) as cl:
            out.append(cl.count_prefix("/later/", endpoint=m.client_url))
    return out


def aside_dirs(c: LoopbackCluster) -> List[str]:
    data = os.path.dirname(c.cfg.data_dir("m1"))
    return sorted(e for e in os.listdir(data) if ".pre-restore-" in e or ".restoring" in e)


def serves_from(pid: int, data_dir: str) -> bool:
    """Whether process ``pid`` holds its db open under ``data_dir`` (not under a set-aside one)."""
    want = os.path.join(data_dir, "member", "snap", "db")
    return any(f.path == want for f in psutil.Process(pid).open_files())


def test_pid_files_removed_under_running_etcds(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    c = make(cluster_factory)
    take_backup(c.cfg, member="m1")
    with c.client() as cl:
        cl.put("/later/k", b"written after the backup")
    old = {m.name: ProcessBackend(c.cfg, m.name).pid() for m in c.cfg.members}
    assert all(old.values()), old
    for m in c.cfg.members:  # what a lost pid file (or a run killed before writing it) leaves
        os.unlink(os.path.join(c.cfg.etcd.run_dir, f"{m.name}.pid"))
    capsys.readouterr()

    rc = cli(c, "restore", "--from", "latest", "--yes")
    err = capsys.readouterr().err
    assert rc == 0, err
    for name, pid in old.items():  # the etcds without pid files were stopped before their data moved
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, (name, pid)
    for m in c.cfg.members:  # each member is served by the etcd the restore started, from the restored data
        pid = ProcessBackend(c.cfg, m.name).pid()
        assert pid is not None and pid != old[m.name], (m.name, pid)
        assert serves_from(pid, c.cfg.data_dir(m.name)), m.name
    assert later_on_each(c) == [0, 0, 0]


def test_an_etcd_started_by_hand_on_a_data_dir_is_refused(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    c = make(cluster_factory)
    take_backup(c.cfg, member="m1")
    m1 = c.cfg.member("m1")
    c.members[0].backend.stop(timeout=10)
    # the operator starts m1 by hand, with flags, on its data dir and ports: not the agent's etcd
    argv = [c.cfg.etcd.binary, "--name", "m1", "--data-dir", c.cfg.data_dir("m1"),
            "--listen-client-urls", m1.client_url, "--advertise-client-urls", m1.client_url,
            "--listen-peer-urls", m1.peer_url, "--initial-advertise-peer-urls", m1.peer_url]
    hand = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with EtcdClient([m1.client_url], timeout=2.0) as cl:
            poll(lambda: cl.healthy(m1.client_url)[0], timeout=30, what="the etcd started by hand")
        inodes = {m.name: os.stat(c.cfg.data_dir(m.name)).st_ino for m in c.cfg.members}
        capsys.readouterr()

        rc = cli(c, "restore", "--from", "latest", "--yes")
        err = capsys.readouterr().err
        assert rc == 3, err
        assert f"pid {hand.pid}" in err and " ".join(argv) in err, err
        with capsys.disabled():
            print("\n" + "\n".join(line for line in err.splitlines() if f"pid {hand.pid}" in line))
        assert hand.poll() is None, "an etcd the agent did not start is never signalled"
        assert {m.name: os.stat(c.cfg.data_dir(m.name)).st_ino for m in c.cfg.members} == inodes
        assert aside_dirs(c) == []
    finally:
        hand.terminate()
        hand.wait(15)


def test_a_restore_cut_off_after_its_start_resumes_onto_the_etcds_it_started(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    """The orchestrator killed once every member's start is journaled, and the pid files gone:
    what a restore killed between starting etcd and writing its pid file leaves. Re-running it
    resumes; the etcds of the cut-off run, serving the restored data without the agent's record
    of them, give way to ones it starts and records, and the restore finishes served."""
    c = make(cluster_factory)
    take_backup(c.cfg, member="m1")
    with c.client() as cl:
        cl.put("/later/k", b"written after the backup")
    journals = [os.path.join(work_dir_for(c.cfg.data_dir(m.name), m.name), "journal.json") for m in c.cfg.members]

    def started() -> bool:
        try:
            return all("start" in json.load(open(j)).get("steps", {}) for j in journals)
        except (FileNotFoundError, ValueError):
            return False

    proc = subprocess.Popen([AGENT, "-c", c.config_path, "restore", "--from", "latest", "--yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        poll(lambda: started() or proc.poll() is not None, timeout=60, what="every member's start journaled",
             interval=0.01)
        assert proc.poll() is None, "restore finished before it could be cut off"
    finally:
        proc.kill()  # SIGKILL: cut off where it stands
        proc.wait(10)
    cut_off = {m.name: ProcessBackend(c.cfg, m.name).pid() for m in c.cfg.members}
    assert all(cut_off.values()), cut_off
    for m in c.cfg.members:
        os.unlink(os.path.join(c.cfg.etcd.run_dir, f"{m.name}.pid"))
    capsys.readouterr()

    rc = cli(c, "restore", "--from", "latest", "--yes")
    err = capsys.readouterr().err
    assert rc == 0, err
    for m in c.cfg.members:
        pid = ProcessBackend(c.cfg, m.name).pid()
        assert pid is not None and pid != cut_off[m.name] and serves_from(pid, c.cfg.data_dir(m.name)), (m.name, pid)
    assert later_on_each(c) == [0, 0, 0]
    for m in c.cfg.members:  # the cut-off run's etcds are gone (reaped, or zombies of this test)
        pid = cut_off[m.name]
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, (m.name, pid)
