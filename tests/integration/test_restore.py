"""`etcd-agent restore` on loopback clusters: real etcd, real etcdctl, the agent's own node steps.

All members are local (LocalHost, process backend, three members on one host) - the rehearsal
path of the demo. Every restore goes through ``etcd-agent node ...`` subprocesses exactly as it
would over SSH. The disaster restore runs on 3.5.16 (etcdutl, revision bumped) and on 3.4.23
(etcdctl, not bumped); the fault and resume tests on 3.5.16.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from typing import List

import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.cli.main import main
from etcd_agent.errors import OperationFailed
from etcd_agent.restore.host.facts import work_dir_for
from etcd_agent.restore.orchestrator.options import Options
from etcd_agent.restore.orchestrator.orchestrate import restore
from etcd_agent.restore.orchestrator.plan import BUMP_REVISION
from etcd_agent.state.locks import Holder, OperationLock, SessionOwner, lock_path_for
from tests.harness import restorebed
from tests.harness.loopback import LoopbackCluster
from tests.harness.releases import DEFAULT, LEGACY

pytestmark = pytest.mark.integration

AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
EXTRA = f'[ssh]\nagent_path = "{AGENT}"\n'


def put_many(c: LoopbackCluster, prefix: str, n: int, workers: int = 4) -> None:
    """``n`` keys of 64 ``x``s, in multi-put transactions (``tests/harness/restorebed.py``)."""
    restorebed.put_many(c.cfg, prefix, n, workers)


def counts(c: LoopbackCluster, *prefixes: str) -> List[int]:
    with c.client() as cl:
        return [cl.count_prefix(p) for p in prefixes]


def revisions(c: LoopbackCluster) -> List[int]:
    with c.client() as cl:
        return [cl.status(m.client_url).revision for m in c.cfg.members]


def cli(c: LoopbackCluster, *args: str) -> int:
    return main(["-c", c.config_path, *args])


def make(cluster_factory, **kw) -> LoopbackCluster:  # type: ignore[no-untyped-def]
    c = cluster_factory(3, extra=EXTRA, **kw)
    c.start_static()
    return c


def restored_revision(c: LoopbackCluster, backup_revision: int) -> int:
    """The revision right after a restore: the snapshot's (bumped when etcdutl restored it), plus
    the lineage record the restore writes."""
    return backup_revision + (BUMP_REVISION if c.cfg.etcd.etcdutl else 0) + 1


@pytest.mark.parametrize("version", [DEFAULT, LEGACY])
def test_disaster_restore_then_new_cluster_then_cleanup(cluster_factory, capsys, version) -> None:  # type: ignore[no-untyped-def]
    c = make(cluster_factory, version=version)
    t = time.monotonic()
    put_many(c, "/k/", 10_000)
    put_s = time.monotonic() - t
    b = take_backup(c.cfg, member="m1")
    put_many(c, "/later/", 200)
    c.stop()
    for m in c.cfg.members:
        shutil.rmtree(c.cfg.data_dir(m.name))
    t = time.monotonic()
    rc = cli(c, "restore", "--from", b.path, "--yes")
    wall = time.monotonic() - t
    assert rc == 0, capsys.readouterr().err
    assert counts(c, "/k/", "/later/") == [10_000, 0]
    revs = revisions(c)
    assert len(set(revs)) == 1 and revs[0] == restored_revision(c, b.revision), (revs, b.revision)
    for m in c.cfg.members:  # etcd's trailer was checked as the copy landed: not hashed again by etcdutl
        with open(os.path.join(work_dir_for(c.cfg.data_dir(m.name), m.name), "journal.json")) as fh:
            argv = json.load(fh)["steps"]["restore"]["argv"]
        assert argv[-1] == "--skip-hash-check" and argv[1:3] == ["snapshot", "restore"], argv
    with capsys.disabled():
        print(f"\nFIGURE restore-loopback-3 etcd {version}: 10,000 keys (put {put_s:.1f}s), restore --yes wall time "
              f"{wall:.2f}s, backup revision {b.revision}, restored revision {revs[0]}")

    # the same backup seeds a second cluster with another config (other ports and token)
    c2 = cluster_factory(3, extra=EXTRA, version=version)  # never started: no data, no conf
    capsys.readouterr()
    assert cli(c2, "restore", "--from", b.path, "--yes") == 3, "foreign layout must be refused without --new-cluster"
    assert "--new-cluster" in capsys.readouterr().err
    t = time.monotonic()
    assert cli(c2, "restore", "--from", b.path, "--yes", "--new-cluster", "--new-token", "seeded-1") == 0
    with capsys.disabled():
        print(f"FIGURE restore-new-cluster: {time.monotonic() - t:.2f}s")
    assert counts(c2, "/k/", "/later/") == [10_000, 0]
    with open(c2.cfg.conf_file("m2")) as fh:
        conf = fh.read()
    assert "ETCD_INITIAL_CLUSTER_TOKEN=seeded-1" in conf and c2.cfg.member("m2").peer_url in conf

    # restore once more in place (data present now) -> a set-aside dir per member; cleanup keeps the newest
    assert cli(c, "restore", "--from", b.path, "--yes") == 0
    assert cli(c, "restore", "--from", b.path, "--yes") == 0
    data = os.path.dirname(c.cfg.data_dir("m1"))
    aside = sorted(e for e in os.listdir(data) if ".pre-restore-" in e)
    assert len(aside) == 6, aside
    capsys.readouterr()
    assert cli(c, "restore", "cleanup", "--dry-run") == 0
    out = capsys.readouterr().out
    assert out.count("would remove") == 3 and out.count("keep") == 3
    assert sorted(e for e in os.listdir(data) if ".pre-restore-" in e) == aside
    assert cli(c, "restore", "cleanup") == 2  # deleting asks; no terminal and no --yes: refused
    assert sorted(e for e in os.listdir(data) if ".pre-restore-" in e) == aside
    assert cli(c, "restore", "cleanup", "--yes") == 0
    left = sorted(e for e in os.listdir(data) if ".pre-restore-" in e)
    assert len(left) == 3 and set(left) <= set(aside)
    assert counts(c, "/k/") == [10_000]
    # the restore gave the cluster a new id; its own backups from before are not "foreign"
    capsys.readouterr()
    assert cli(c, "backup", "verify", b.path) == 0
    assert "lineage" in capsys.readouterr().out


def test_dry_run_busy_and_hostile_tarball_change_nothing(cluster_factory, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = make(cluster_factory)
    put_many(c, "/k/", 100)
    b = take_backup(c.cfg, member="m1")
    put_many(c, "/later/", 10)
    before = {m.name: sorted(os.listdir(c.cfg.data_dir(m.name))) for m in c.cfg.members}
    pids = [lm.backend.pid() for lm in c.members]

    capsys.readouterr()
    assert cli(c, "restore", "--from", b.path, "--dry-run") == 0
    out = capsys.readouterr().out
    for m in c.cfg.members:
        assert f"--name={m.name}" in out and f"--initial-advertise-peer-urls={m.peer_url}" in out
    assert "--initial-cluster=m1=" in out and "--initial-cluster-token=test-restore-" in out
    assert "--data-dir=" in out and f"revision bumped by {BUMP_REVISION} and marked compacted" in out
    with capsys.disabled():
        print("\nDRY-RUN OUTPUT (first member):\n" + out.split("member m2")[0])

    # another operator's restore holds the lock: busy at once, nothing touched
    with OperationLock(lock_path_for(c.cfg.backup.dir), "restore 1",
                       holder=Holder(owner=SessionOwner("restore 1", "m9", 1))):
        capsys.readouterr()
        assert cli(c, "restore", "--from", b.path, "--yes") == 4
        assert "`etcd-agent restore 1` from m9 (pid 1)" in capsys.readouterr().err

    # tar-slip: a member escaping the work dir, next to a plausible manifest
    evil = tmp_path / "etcd-2020-01-01-00-00-00.tar"
    escape = tmp_path / "escaped"
    with tarfile.open(b.path) as src, tarfile.open(evil, "w") as dst:
        for ti in src.getmembers():
            dst.addfile(ti, src.extractfile(ti))
        ti = tarfile.TarInfo("../../escaped")
        ti.size = 4
        dst.addfile(ti, io.BytesIO(b"pwnd"))
    assert cli(c, "restore", "--from", str(evil), "--yes") == 3
    link = tmp_path / "etcd-2020-01-01-00-00-01.tar"
    with tarfile.open(b.path) as src, tarfile.open(link, "w") as dst:
        for ti in src.getmembers():  # the real manifest, but the snapshot is a symlink
            if ti.name == "etcd_snapshot.db":
                ti = tarfile.TarInfo("etcd_snapshot.db")
                ti.type = tarfile.SYMTYPE
                ti.linkname = "/etc/passwd"
                dst.addfile(ti)
            else:
                dst.addfile(ti, src.extractfile(ti))
    assert cli(c, "restore", "--from", str(link), "--yes") == 3
    assert not escape.exists() and not (tmp_path.parent / "escaped").exists()

    assert [lm.backend.pid() for lm in c.members] == pids
    assert {m.name: sorted(os.listdir(c.cfg.data_dir(m.name))) for m in c.cfg.members} == before
    assert counts(c, "/k/", "/later/") == [100, 10]
    assert not any(os.path.exists(work_dir_for(c.cfg.data_dir(m.name), m.name)) for m in c.cfg.members)


def test_restore_waits_for_the_hosts_own_backup(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    """This host's backup (the daemon's chain base, cron's) holds the lock when the operator types
    restore: the restore waits for it to end (a backup takes seconds) instead of refusing."""
    c = make(cluster_factory)
    put_many(c, "/k/", 100)
    b = take_backup(c.cfg, member="m1")
    put_many(c, "/later/", 10)
    backup_lock = OperationLock(lock_path_for(c.cfg.backup.dir), "backup").acquire()
    timer = threading.Timer(2.0, backup_lock.release)
    timer.start()
    try:
        assert cli(c, "restore", "--from", b.path, "--yes") == 0
    finally:
        timer.cancel()
        backup_lock.release()
    assert counts(c, "/k/", "/later/") == [100, 0]


def test_failure_mid_restore_rolls_every_member_back(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    c = make(cluster_factory)
    put_many(c, "/k/", 100)
    b = take_backup(c.cfg, member="m1")
    put_many(c, "/later/", 10)
    # a real obstacle, no hook in the product: a directory the restore did not make sits where
    # m3's restored data goes; the restore never deletes what it did not make, so m3 fails after
    # every member was stopped and set aside
    blocker = c.cfg.data_dir("m3").rstrip("/") + ".restoring"
    os.makedirs(blocker)
    with open(os.path.join(blocker, "not-ours"), "w") as fh:
        fh.write("keep me")
    with pytest.raises(OperationFailed) as ei:
        restore(c.cfg, Options(spec=b.path))
    assert "every member was rolled back" in ei.value.message, ei.value.details
    assert any("m3" in d and "restore" in d for d in ei.value.details), ei.value.details
    assert sum("now etcd running" in d for d in ei.value.details) == 3, ei.value.details
    for lm in c.members:
        lm.wait_healthy(30)
    # old data back and serving: the keys written after the backup are there
    assert counts(c, "/k/", "/later/") == [100, 10]
    for m in c.cfg.members:
        with open(os.path.join(work_dir_for(c.cfg.data_dir(m.name), m.name), "journal.json")) as fh:
            assert json.load(fh)["state"] == "rolled-back"
    assert open(os.path.join(blocker, "not-ours")).read() == "keep me"
    shutil.rmtree(blocker)
    # a new restore afterwards is a fresh one and succeeds
    assert cli(c, "restore", "--from", b.path, "--yes") == 0
    assert counts(c, "/k/", "/later/") == [100, 0]


def test_a_fence_failing_after_the_ship_leaves_every_member_serving_untouched(cluster_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a real obstacle, no hook: the apiserver manifest's aside dir is a file, so the fence fails
    # on the member that owns it once every member holds its shipped copy
    manifest = os.path.join(str(tmp_path), "kube-apiserver.yaml")
    aside = os.path.join(str(tmp_path), "manifests-aside")
    with open(manifest, "w") as fh:
        fh.write("kind: Pod\n")
    with open(aside, "w") as fh:
        fh.write("not a dir\n")
    c = cluster_factory(3, extra=EXTRA + f'[kubernetes]\nfence = "manifest"\nmanifest = "{manifest}"\n'
                                          f'manifest_aside_dir = "{aside}"\n')
    c.start_static()
    put_many(c, "/k/", 100)
    b = take_backup(c.cfg, member="m1")
    put_many(c, "/later/", 10)
    before = {lm.member.name: (lm.backend.pid(), os.stat(c.cfg.data_dir(lm.member.name)).st_ino) for lm in c.members}
    with pytest.raises(OperationFailed) as ei:
        restore(c.cfg, Options(spec=b.path))
    assert "every member was rolled back" in ei.value.message, ei.value.details
    assert "failed at fence" in ei.value.message and any(aside in d for d in ei.value.details), ei.value.details
    assert sum("rolled back: etcd left running: its data dir was never touched" in d for d in ei.value.details) == 3, ei.value.details
    # no etcd was stopped, no data dir moved: the same processes serve the old data
    assert {lm.member.name: (lm.backend.pid(), os.stat(c.cfg.data_dir(lm.member.name)).st_ino)
            for lm in c.members} == before
    assert counts(c, "/k/", "/later/") == [100, 10]
    assert open(manifest).read() == "kind: Pod\n"
    for m in c.cfg.members:  # the shipped copies are gone, the journals say rolled back
        wd = work_dir_for(c.cfg.data_dir(m.name), m.name)
        assert sorted(os.listdir(wd)) == ["journal.json"], os.listdir(wd)
        with open(os.path.join(wd, "journal.json")) as fh:
            assert json.load(fh)["state"] == "rolled-back"


def test_killed_orchestrator_resumes(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    c = make(cluster_factory)
    put_many(c, "/k/", 100)
    b = take_backup(c.cfg, member="m1")
    put_many(c, "/later/", 10)
    journal = os.path.join(work_dir_for(c.cfg.data_dir("m2"), "m2"), "journal.json")
    proc = subprocess.Popen(
        [AGENT, "-c", c.config_path, "restore", "--from", b.path, "--yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # kill it once m2 has moved its data aside
            try:
                with open(journal) as fh:
                    if "aside" in json.load(fh).get("steps", {}):
                        break
            except (FileNotFoundError, ValueError):
                pass
            assert proc.poll() is None, "restore finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # a concurrent *other* restore is refused while the first one's journals are open
    capsys.readouterr()
    t = time.monotonic()
    assert cli(c, "restore", "--from", b.path, "--yes") == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "(resuming)" in err or "already done" in err
    with capsys.disabled():
        print(f"\nFIGURE resume after kill: {time.monotonic() - t:.2f}s")
    assert counts(c, "/k/", "/later/") == [100, 0]
    assert len(set(revisions(c))) == 1


def test_a_backup_reached_through_a_link_into_a_data_dir_is_refused(cluster_factory, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A backup that really lies inside a data dir this restore sets aside would go aside with it
    (and `restore cleanup --keep 0` would delete it): refused at the pre-check, nothing touched."""
    c = make(cluster_factory)
    put_many(c, "/k/", 20)
    b = take_backup(c.cfg, member="m1")
    inside = os.path.join(c.cfg.data_dir("m2"), "kept")
    os.mkdir(inside)
    shutil.copy2(b.path, inside)
    link = tmp_path / "elsewhere"
    link.symlink_to(inside)
    before = {m.name: sorted(os.listdir(c.cfg.data_dir(m.name))) for m in c.cfg.members}
    pids = [lm.backend.pid() for lm in c.members]
    capsys.readouterr()
    assert cli(c, "restore", "--from", str(link / os.path.basename(b.path)), "--yes") == 3
    err = capsys.readouterr().err
    assert (f"{link / os.path.basename(b.path)} lies inside {c.cfg.data_dir('m2')} once links are resolved"
            in err), err
    assert [lm.backend.pid() for lm in c.members] == pids
    assert {m.name: sorted(os.listdir(c.cfg.data_dir(m.name))) for m in c.cfg.members} == before
    assert not any(os.path.exists(work_dir_for(c.cfg.data_dir(m.name), m.name)) for m in c.cfg.members)
