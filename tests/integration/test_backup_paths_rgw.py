"""Every path that takes a full backup gets it copied off-host when [backup.remote] is on, on a
real etcd and a real S3 server (Ceph RGW): the CLI (cron, by hand), a node session's backup step
(restore and upgrade take theirs through it), an upgrade on a host that runs no member, and the
daemon (its copy queue finds the backup pending and copies it). A caller that forgets the copier
fails before it takes anything. The daemon's checkpoints are copied by the same queue: the
daemon-made chain of test_backup_fetch is fetched back from the bucket, checkpoint included."""
from __future__ import annotations

import os
import subprocess
import time
from typing import Any, List, cast

import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.bucket import copier, layout, queue
from etcd_agent.cli import nodesteps
from etcd_agent.cluster.upgrade import Upgrade, UpgradePlan
from etcd_agent.node.client import new_owner
from etcd_agent.node.protocol import Args
from etcd_agent.node.server import NodeContext
from tests.harness.rgw import RgwBed, remote_table
from tests.integration.test_restore import AGENT

pytestmark = pytest.mark.integration


def copied(rgw: RgwBed, bucket: str) -> List[str]:
    """The file names of the full backups in the bucket."""
    out = rgw.client().list_objects_v2(Bucket=bucket, Prefix="p/").get("Contents", [])
    placed = [layout.place(o["Key"][len("p/"):]) for o in out]
    return sorted(p.file for p in placed if p is not None and p.kind == layout.FULL)


def test_a_backup_is_copied_off_host_by_every_path_that_takes_one(cluster_factory: Any, rgw: RgwBed) -> None:
    bucket = rgw.new_bucket()
    c = cluster_factory(1, extra=remote_table(rgw, bucket, prefix="p/"))
    c.start_static()
    cfg = c.cfg
    taken: List[str] = []

    with pytest.raises(ValueError, match="no off_host copier was given"):  # forgotten: loud, and nothing taken
        take_backup(cfg, member="m1")
    assert not os.path.isdir(cfg.backup.dir) or os.listdir(cfg.backup.dir) == []

    res = subprocess.run([AGENT, "-c", c.config_path, "backup", "--member", "m1"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    taken.append(os.path.basename(res.stdout.strip()))
    assert copied(rgw, bucket) == sorted(taken), "the CLI's backup"

    time.sleep(1.1)  # backup names have one-second resolution
    ctx = NodeContext(cfg, new_owner("test node backup"), None)
    ctx.take_lock()
    try:
        reply = nodesteps.backup(ctx, Args({"member": "m1"}, "backup"))
    finally:
        assert ctx.lock is not None
        ctx.lock.release()
    taken.append(os.path.basename(reply.to_json()["path"]))
    assert copied(rgw, bucket) == sorted(taken), "a node session's backup step"

    time.sleep(1.1)
    up = Upgrade(cfg, UpgradePlan("3.5.16", {}, None, []), cast(Any, None))  # no node session: this host runs none
    taken.append(os.path.basename(up._backup()))
    assert copied(rgw, bucket) == sorted(taken), "an upgrade's backup on a host without a member"

    time.sleep(1.1)
    daemon = take_backup(cfg, member="m1", origin="daemon")  # as the daemon's supervisor takes a chain's base
    caches = queue.Caches()
    assert [f.path for f in copier.pending(cfg, caches).pending] == [daemon.path], "the daemon's backup queued"
    pushed = copier.push(cfg, caches)
    assert not pushed.error and [f.path for f in pushed.copied] == [daemon.path], pushed
    taken.append(os.path.basename(daemon.path))
    assert copied(rgw, bucket) == sorted(taken), "the daemon's backup, by its copy queue"


def test_a_copy_whose_digest_the_queue_holds_reads_the_file_once(
        cluster_factory: Any, rgw: RgwBed, monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue hashed the file to compare it with an object of its size (a copy gone bad): the
    upload takes that digest and reads the file once, hashing as it sends (issue 39 item 5)."""
    from tests.integration.test_bucket_onepass_rgw import count_opens

    bucket = rgw.new_bucket()
    c = cluster_factory(1, extra=remote_table(rgw, bucket, prefix="p/", part_size_mb=5))
    c.start_static()
    for i in range(7):  # a backup of several parts: the one-pass multipart upload
        c.client().put(f"k{i}", os.urandom(1 << 20))
    daemon = take_backup(c.cfg, member="m1", origin="daemon")
    caches = queue.Caches()
    (f,) = copier.pending(c.cfg, caches).pending
    assert f.size > 5 << 20, f.size
    rgw.client().put_object(Bucket=bucket, Key="p/" + f.name, Body=os.urandom(f.size), Metadata={"sha256": "0" * 64})
    reads = count_opens(monkeypatch, daemon.path)
    pushed = copier.push(c.cfg, caches)
    assert not pushed.error and [g.path for g in pushed.copied] == [daemon.path], pushed
    assert len(reads) == 2, reads  # the queue's check of the object there, then the upload
    head = rgw.client().head_object(Bucket=bucket, Key="p/" + f.name)
    assert head["Metadata"]["sha256"] == caches.local_sha(daemon.path)


def test_a_digest_the_file_no_longer_hashes_to_fails_one_pass_and_is_forgotten(cluster_factory: Any, rgw: RgwBed) -> None:
    """A digest held for a file changed without its size or mtime telling: the upload refuses the
    bytes (nothing lands under the wrong sha256), the queue forgets it, the next pass hashes again."""
    bucket = rgw.new_bucket()
    c = cluster_factory(1, extra=remote_table(rgw, bucket, prefix="p/"))
    c.start_static()
    daemon = take_backup(c.cfg, member="m1", origin="daemon")
    caches = queue.Caches()
    st = os.stat(daemon.path)
    caches.local[(daemon.path, st.st_size, st.st_mtime_ns)] = "f" * 64
    first = copier.push(c.cfg, caches)
    assert "changed while it was copied" in first.error and not first.copied, first
    assert caches.known_sha(daemon.path) is None
    assert copied(rgw, bucket) == []
    second = copier.push(c.cfg, caches)
    assert not second.error and [g.path for g in second.copied] == [daemon.path], second
