"""The bucket's layout keyed by content, on Ceph RGW: `chains/<key>/` holds a full backup, its
segments and its checkpoints; the remote retention keeps them together and deletes them
together; copies in the legacy layout (full backups at the top, `delta-<revision>/`) are still
listed, as legacy, and pruned with their full backup."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Dict, List

import pytest

from etcd_agent.bucket import remote
from etcd_agent.config import Config
from tests.harness.rgw import RgwBed, on_agent_clients, rgw_config

pytestmark = pytest.mark.integration

K_NEW = hashlib.sha256(b"new").hexdigest()
K_ORPHAN = hashlib.sha256(b"orphan").hexdigest()
OLD = "etcd-2026-03-01-01-00-00.tar"  # legacy, revision 10
NEW = "etcd-2026-03-02-01-00-00.tar"
CP = "etcd-2026-03-02-02-00-00.tar"


def seg(start: int, end: int) -> str:
    return f"etcd-delta-{start:016d}-{end:016d}-20260302T010000.000Z.seg"


def config(rgw: RgwBed, bucket: str, backup_dir: Path) -> Config:
    return rgw_config(rgw, bucket, backup_dir=str(backup_dir), prefix="p/", keep_last=1, keep_hourly=0, keep_daily=0)


def put(cfg: Config, tmp: Path, name: str, meta: Dict[str, str]) -> None:
    path = tmp / os.path.basename(name)
    path.write_bytes(os.urandom(1000))
    remote.upload_file(cfg, str(path), name, lambda sha: {"sha256": sha, **meta})
    path.unlink()


def keys(rgw: RgwBed, bucket: str) -> List[str]:
    return sorted(o["Key"][2:] for o in rgw.client().list_objects_v2(Bucket=bucket, Prefix="p/").get("Contents", []))


def test_chains_are_kept_and_pruned_with_their_full_backup_and_legacy_copies_too(rgw: RgwBed, tmp_path: Path) -> None:
    bucket = rgw.new_bucket()
    (tmp_path / "backups").mkdir()
    cfg = config(rgw, bucket, tmp_path / "backups")
    legacy = [OLD, f"delta-{10:016d}/{seg(11, 20)}", f"delta-{99:016d}/{seg(100, 120)}"]
    chain = [f"chains/{K_NEW}/{NEW}", f"chains/{K_NEW}/{seg(31, 40)}", f"chains/{K_NEW}/{seg(41, 50)}",
             f"chains/{K_NEW}/checkpoints/{CP}"]
    orphan = [f"chains/{K_ORPHAN}/{seg(61, 70)}"]
    for n in legacy + chain + orphan:
        put(cfg, tmp_path, n, {"revision": "10"} if n == OLD else {"revision": "30"} if n.endswith(NEW) else {})
    rgw.client().put_object(Bucket=bucket, Key="p/notes.txt", Body=b"not ours")

    listed = remote.list_remote(cfg)
    assert [(o.name, o.chain) for o in listed] == [(NEW, K_NEW), (OLD, "")]
    assert listed[0].to_json()["legacy"] is False and listed[1].to_json()["legacy"] is True

    dry = remote.prune_remote(cfg, dry_run=True)
    said = {d.name: d.keep for d in dry}
    assert said == {
        NEW: True, OLD: False,
        f"remote chain chains/{K_NEW}/ (2 segment(s), 1 checkpoint(s))": True,
        f"remote chain chains/{K_ORPHAN}/ (1 segment(s), 0 checkpoint(s))": False,
        "legacy remote delta chain after revision 10 (1 segment(s))": False,
        "legacy remote delta chain after revision 99 (1 segment(s))": False,
    }, said
    assert all(d.reasons for d in dry)
    assert len(keys(rgw, bucket)) == len(legacy + chain + orphan) + 1  # a dry run deletes nothing

    remote.prune_remote(cfg, dry_run=False)
    assert keys(rgw, bucket) == sorted(chain + ["notes.txt"])


def test_backup_list_remote_lists_the_bucket_once(rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`backup list --remote` and the remote retention (a legacy copy, a keyed chain): one listing
    of the bucket each, for the copies and their chains. Each full backup still gets one HEAD: its sha256 and revision (what
    the listing shows, and where a legacy chain is found) are object metadata, which a listing
    does not return."""
    from etcd_agent.cli.backup import _list_remote

    bucket = rgw.new_bucket()
    (tmp_path / "backups").mkdir()
    cfg = config(rgw, bucket, tmp_path / "backups")
    for n in [OLD, f"delta-{10:016d}/{seg(11, 20)}", f"chains/{K_NEW}/{NEW}", f"chains/{K_NEW}/{seg(31, 40)}",
              f"chains/{K_NEW}/checkpoints/{CP}"]:
        put(cfg, tmp_path, n, {"revision": "10"} if n == OLD else {"revision": "30"} if n.endswith(NEW) else {})

    calls: List[str] = []  # every client the agent makes, its API calls counted
    on_agent_clients(monkeypatch, "before-call.s3", lambda model, **_: calls.append(model.name))
    out = _list_remote(cfg)
    assert calls.count("ListObjectsV2") == 1, calls
    assert calls.count("HeadObject") == 2 and set(calls) == {"ListObjectsV2", "HeadObject"}, calls
    reach = {d["name"]: d["chain_reach"] for d in out.data["backups"]}
    assert reach == {NEW: {"segments": 1, "checkpoints": 1, "revision": 40, "gap_after": None},
                     OLD: {"segments": 1, "checkpoints": 0, "revision": 20, "gap_after": None}}, reach

    calls.clear()  # the remote retention (after each copied full backup, and `backup prune --remote`): one listing too
    said = {d.name: d.keep for d in remote.prune_remote(cfg, dry_run=True)}
    assert calls.count("ListObjectsV2") == 1 and calls.count("HeadObject") == 2, calls
    assert said == {NEW: True, OLD: False, f"remote chain chains/{K_NEW}/ (1 segment(s), 1 checkpoint(s))": True,
                    "legacy remote delta chain after revision 10 (1 segment(s))": False}, said
