"""`etcd-agent restore` over real SSH: three namespace hosts, each with sshd and its own agent.toml.

Each host er1..er3 (10.213.4.11-13) sees its own ``/etc/etcd-agent/agent.toml`` (``ip netns exec``
bind-mounts ``/etc/netns/<ns>/etcd-agent`` over ``/etc/etcd-agent``, and sshd started that way
hands the mount to its sessions), with ``[local] name`` set and its own backup and state dirs;
data dirs and conf files are distinct per member under this module's temp dir. etcd runs with the
process backend inside each namespace (the bed: ``tests/harness/restorebed.py``). The operator's
command runs inside er1's namespace, as it would on master 1: er1 is driven through LocalHost,
er2/er3 over SSH (known_hosts enforced).

The tests build on each other in file order (one cluster), like an operator's session.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import time
from typing import Dict, Iterator

import pytest

from etcd_agent.member.process import ProcessBackend
from etcd_agent.restore.orchestrator.plan import BUMP_REVISION
from tests.harness.releases import DEFAULT, release
from tests.harness.restorebed import (
    RestoreBed,
    counts,
    put_many,
    restore_bed,
    retry_busy,
    revisions,
    wait_healthy,
    wait_journal,
)

pytestmark = pytest.mark.multihost

PREFIX, SUBNET = "er", "10.213.4"
KEYS = 10_000


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestoreBed]:
    # etcdutl in every host's config: restores bump the revision
    with restore_bed(tmp_path_factory, PREFIX, SUBNET, etcd=release(DEFAULT).toml()) as b:
        yield b


@pytest.fixture(scope="module")
def backup(bed: RestoreBed) -> Dict:
    cfg = bed.cfg()
    t = time.monotonic()
    put_many(cfg, "/k/", KEYS)
    print(f"\n[figure] netns: {KEYS} keys put in {time.monotonic() - t:.1f}s")
    out = bed.backup()
    put_many(cfg, "/later/", 300)
    return out


def test_dry_run_changes_nothing(bed: RestoreBed, backup: Dict) -> None:
    pids, listing = bed.pids(), bed.listing()
    res = bed.agent(bed.h(1), "restore", "--from", backup["path"], "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    cfg = bed.cfg()
    for m in cfg.members:
        where = "local" if m.name == "er1" else m.ssh_host
        assert f"member {m.name} on {where}:" in out
        assert f"--name={m.name}" in out and f"--initial-advertise-peer-urls={m.peer_url}" in out
    assert "pre-check ok" in res.stderr and res.stderr.count("pre-check ok") == 3
    # every host restores with etcdutl 3.5, which bumps the revision for the apiservers' watch caches
    assert f"revision bumped by {BUMP_REVISION}" in out and out.count("--mark-compacted") == 3
    print("\n--- restore --dry-run (namespace tier) ---\n" + out)
    assert bed.pids() == pids and bed.listing() == listing


def test_disaster_restore_over_ssh(bed: RestoreBed, backup: Dict) -> None:
    cfg = bed.cfg()
    assert counts(cfg, "/k/", "/later/") == [KEYS, 300]
    # the disaster: every etcd gone, every data dir deleted
    for m in cfg.members:
        ProcessBackend(cfg, m.name).stop(timeout=10)
    for m in cfg.members:
        shutil.rmtree(cfg.data_dir(m.name))
    t = time.monotonic()
    res = bed.agent(bed.h(1), "restore", "--from", backup["path"], "--yes")
    wall = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    revs = revisions(cfg)
    assert len(set(revs.values())) == 1 and min(revs.values()) > backup["revision"] + BUMP_REVISION, revs
    for m in cfg.members:  # every member serves every key of the backup, none of the later ones
        assert counts(cfg, "/k/", "/later/", endpoint=m.client_url) == [KEYS, 0]
    assert all(bed.pids().values())
    print(f"\n[figure] netns tier: restore --yes over SSH (3 hosts, {KEYS} keys, data dirs deleted): "
          f"wall {wall:.2f}s, revision {set(revs.values())}")
    print("\n".join(line for line in res.stderr.splitlines() if "restore:" in line))


def test_unreachable_host_refused_nothing_stopped(bed: RestoreBed, backup: Dict) -> None:
    cfg = bed.cfg()
    put_many(cfg, "/after1/", 10)
    pids, listing = bed.pids(), bed.listing()
    er3 = bed.net.hosts[2]
    bed.net.set_link(er3, False)
    try:
        t = time.monotonic()
        res = bed.agent(bed.h(1), "restore", "--from", backup["path"], "--yes")
        took = time.monotonic() - t
    finally:
        bed.net.set_link(er3, True)
    assert res.returncode == 3, res.stdout + res.stderr
    err = res.stderr
    assert "er3 (10.213.4.13): pre-check FAILED: unreachable" in err and "connect timed out" in err, err
    assert "er1 (local): pre-check ok" in err and "er2 (10.213.4.12): pre-check ok" in err
    assert "nothing touched" in err
    assert bed.pids() == pids, "a pre-check failure must not stop anything"
    assert bed.listing() == listing
    assert not any(bed.journal(m.name).get("state") == "running" for m in cfg.members)
    wait_healthy(cfg, 30)
    assert counts(cfg, "/k/", "/after1/") == [KEYS, 10]
    print(f"\n[figure] netns tier: host unreachable at pre-check -> refused (exit 3) in {took:.1f}s; "
          "etcd pids and data dirs unchanged")


def test_host_lost_mid_restore_rolled_back_then_rerun(bed: RestoreBed, backup: Dict) -> None:
    cfg = bed.cfg()
    put_many(cfg, "/after2/", 10)
    er3 = bed.net.hosts[2]
    t = time.monotonic()
    proc = bed.popen_agent(bed.h(1), "restore", "--from", backup["path"], "--yes",
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # er3 dies for the network once its data dir is set aside (the orchestrator is mid-call)
        wait_journal(bed, "er3", "aside", proc)
        bed.net.set_link(er3, False)
        out, err_b = proc.communicate(timeout=180)
    finally:
        bed.net.set_link(er3, True)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = err_b.decode()
    took = time.monotonic() - t
    assert proc.returncode == 1, err
    assert "er3 (10.213.4.13): NOT rolled back" in err and "ROLLBACK INCOMPLETE" in err, err
    assert "etcd-agent restore rollback --yes" in err, err  # the next command, named
    assert "er1 (local) rolled back" in err and "er2 (10.213.4.12) rolled back" in err, err
    # er1 and er2 are back on the old data and hold quorum: the keys written after the backup serve
    wait_healthy(cfg, 30, ["er1", "er2"])
    for n in ("er1", "er2"):
        assert counts(cfg, "/k/", "/after2/", endpoint=cfg.member(n).client_url) == [KEYS, 10]
    print(f"\n[figure] netns tier: er3 lost after its data was set aside -> er1, er2 rolled back "
          f"and serving the old data; orchestrator exit 1 after {took:.1f}s")
    # er3 is back: the operator rolls back what could not be reached
    t = time.monotonic()
    # er3's session of the cut-off run may still hold its lock for up to a minute (its server
    # notices the silence): busy (exit 4) until then, and the operator runs it again, as told
    res, busy, _w = retry_busy(lambda: bed.agent(bed.h(1), "restore", "rollback", "--dry-run"))
    assert res.returncode == 0 and "would roll back" in res.stdout, res.stdout + res.stderr
    res, more, _w = retry_busy(lambda: bed.agent(bed.h(1), "restore", "rollback", "--yes"))
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(cfg, 30)
    for m in cfg.members:
        assert counts(cfg, "/k/", "/after2/", endpoint=m.client_url) == [KEYS, 10]
        assert bed.journal(m.name).get("state") == "rolled-back"
    print(f"[figure] netns tier: `restore rollback` of er3 after it came back: {time.monotonic() - t:.1f}s "
          f"({busy + more} busy retries); all 3 members serve the old data")
    # and the same restore run again completes
    t = time.monotonic()
    res = bed.agent(bed.h(1), "restore", "--from", backup["path"], "--yes")
    assert res.returncode == 0, res.stderr
    for m in cfg.members:
        assert counts(cfg, "/k/", "/later/", "/after2/", endpoint=m.client_url) == [KEYS, 0, 0]
    print(f"[figure] netns tier: re-run after the rollback: {time.monotonic() - t:.1f}s, healthy on the backup")


def test_orchestrator_killed_then_resumed(bed: RestoreBed, backup: Dict) -> None:
    cfg = bed.cfg()
    put_many(cfg, "/after3/", 10)
    proc = bed.popen_agent(bed.h(1), "restore", "--from", backup["path"], "--yes",
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        j = wait_journal(bed, "er2", "aside", proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    t = time.monotonic()
    res = bed.agent(bed.h(1), "restore", "--from", backup["path"], "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"restore {j['op']} (resuming)" in res.stderr or "already done" in res.stderr, res.stderr
    revs = revisions(cfg)
    assert len(set(revs.values())) == 1
    for m in cfg.members:
        assert counts(cfg, "/k/", "/after3/", endpoint=m.client_url) == [KEYS, 0]
        assert bed.journal(m.name).get("state") == "done"
    print(f"\n[figure] netns tier: orchestrator SIGKILLed after er2's data was set aside; re-run resumed "
          f"op {j['op']} to healthy in {time.monotonic() - t:.1f}s")
