"""A restore over SSH is done only when the restored data is served (issue 38, item 2).

Three namespace hosts with real sshd (``tests/harness/restorebed.py``), etcd 3.5.16 with the
process backend, etcdutl bumping the revision. Every master's pid file is removed under its
running etcd - what a lost pid file, or a restore killed after its ``node serve`` started etcd and
before it wrote the pid file, leaves - then ``restore --from latest --yes`` on master 1: the old
etcds are found by what they hold and stopped before any data dir moves, and every member ends up
served by the etcd the restore started, from the restored data.
"""
from __future__ import annotations

import os
from typing import Iterator

import psutil
import pytest

from etcd_agent.restore.orchestrator.plan import BUMP_REVISION
from tests.harness.releases import DEFAULT, release
from tests.harness.restorebed import RestoreBed, every_member, put_many, restore_bed, revisions

pytestmark = pytest.mark.multihost

PREFIX, SUBNET = "sv", "10.213.23"


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestoreBed]:
    with restore_bed(tmp_path_factory, PREFIX, SUBNET, etcd=release(DEFAULT).toml()) as b:
        yield b


def exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_pid_files_removed_under_running_etcds_on_three_masters(bed: RestoreBed) -> None:
    cfg = bed.cfg()
    put_many(cfg, "/k/", 100)
    backup = bed.backup()
    put_many(cfg, "/later/", 10)
    old = bed.pids()
    assert all(old.values()), old
    for m in cfg.members:
        os.unlink(os.path.join(cfg.etcd.run_dir, f"{m.name}.pid"))
    assert not any(bed.pids().values())

    res = bed.agent(bed.h(1), "restore", "--from", "latest", "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    assert all(exited(pid) for pid in old.values() if pid), old
    new = bed.pids()
    for m in cfg.members:  # the etcd the restore started, from the restored data dir, serves each member
        pid = new[m.name]
        assert pid is not None and pid != old[m.name], (m.name, pid)
        db = os.path.join(cfg.data_dir(m.name), "member", "snap", "db")
        assert any(f.path == db for f in psutil.Process(pid).open_files()), m.name
    assert every_member(cfg, "/k/", "/later/") == {m.name: [100, 0] for m in cfg.members}
    revs = revisions(cfg)
    assert min(revs.values()) > backup["revision"] + BUMP_REVISION, revs
    assert "running without a pid file" in res.stderr, res.stderr
    print("\n".join(line for line in res.stderr.splitlines() if "halt ok" in line or "stop ok" in line
                    or "serving ok" in line))
