"""A partial chain in the backup dir costs the bucket nothing (issue 33 item 8's aftermath).

After a point-in-time `restore --from-bucket ... --key-file K` the backup dir holds the full backup,
the checkpoint and only the segments from the checkpoint's lease census on; the earlier segments are
in the bucket alone. The masters' daemons then run again with `[backup.remote]` on: `backup push`,
the daemon's copy queue and supervisor, `backup prune --remote` and the local retention all see
that partial chain. None may delete, overwrite or re-copy an object of the bucket's chain, add one
to it, or make `backup list --remote` see it otherwise; the local retention prunes the partial chain
only with its own full backup; and `backup fetch` of that backup brings the earlier segments back
(resumable), after which the chain here is whole. Real daemon, real etcd, real S3 (Ceph RGW)."""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import pytest

from etcd_agent.bucket import fetch, layout
from etcd_agent.chain import chains
from etcd_agent.chain.check import BaseBackup
from etcd_agent.cli.main import main
from tests.harness.rgw import RgwBed
from tests.integration.continuous import full_backups, wait_for
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_restore_from_bucket_partial import _lost, _span

pytestmark = pytest.mark.integration

BED_MEMBERS = 1

Objects = Dict[str, Tuple[int, str, str]]  # name -> (size, ETag, last modified)


def _objects(rgw: RgwBed, bucket: str) -> Objects:
    s3 = rgw.client()
    out: Objects = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="p/"):
        for o in page.get("Contents", []):
            out[o["Key"][2:]] = (int(o["Size"]), str(o["ETag"]), o["LastModified"].isoformat())
    return out


def _run(capsys: Any, *argv: str) -> Tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _untouched(before: Objects, after: Objects, key: str) -> List[str]:
    """What changed of the chain ``key``'s objects: gone, rewritten (size, ETag or time) or added."""
    mine = layout.chain_dir(key)
    changed = [f"{n}: {before[n]} -> {after.get(n)}" for n in sorted(before) if after.get(n) != before[n]]
    return changed + [f"{n}: added" for n in sorted(after) if n.startswith(mine) and n not in before]


def _reach(capsys: Any, conf: str, full: str, key: str) -> Dict[str, Any]:
    rc, out, err = _run(capsys, "-c", conf, "--json", "backup", "list", "--remote")
    assert rc == 0, err
    doc = next(b for b in json.loads(out)["backups"] if b["name"] == full and b.get("chain") == key)
    return dict(doc["chain_reach"])


def test_a_partial_chain_here_never_costs_the_bucket_its_chain(bed, rgw: RgwBed, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    beds: List[Any] = []

    def keep_bed(**kw: Any) -> Any:
        beds.append(bed(**kw))
        return beds[-1]

    c, bucket, key, cp_rev, last, _live = _lost(keep_bed, rgw, tmp_path)
    d, conf, directory = beds[0], c.config_path, c.cfg.backup.dir
    rc, out, err = _run(capsys, "-c", conf, "--json", "restore", "--from-bucket", "latest", "--to-revision", str(last),
                        "--key-file", key, "--yes")
    assert rc == 0, err
    full = json.loads(out)["bucket"]["backup"]
    wait_healthy(c.cfg, 1, 60)
    ours = [ch for ch in chains.scan(directory).chains if ch.begins_at]
    assert len(ours) == 1, chains.scan(directory)
    chain_key = ours[0].base_sha256
    before = _objects(rgw, bucket)
    mine = sorted(n for n in before if n.startswith(layout.chain_dir(chain_key)))
    left = [n for n in mine if layout.place(n) is not None and layout.place(n).kind == layout.SEGMENT  # type: ignore[union-attr]
            and not os.path.exists(os.path.join(directory, n.rsplit("/", 1)[-1]))]
    assert left, (mine, os.listdir(directory))  # a partial chain here: its earlier segments in the bucket only
    reach = _reach(capsys, conf, full, chain_key)
    assert reach["gap_after"] is None and reach["revision"] is not None and reach["revision"] >= last, reach

    # (1) one push, one remote prune: the bucket's chain in place, byte for byte
    fulls = _fulls_listed(capsys, conf)
    rc, out, err = _run(capsys, "-c", conf, "--json", "backup", "push")
    assert rc == 0, out + err
    assert json.loads(out)["copied"] == [], out  # everything here is the bucket's already (the checkpoint too)
    rc, out, err = _run(capsys, "-c", conf, "backup", "prune", "--remote")
    assert rc == 0, out + err
    assert _objects(rgw, bucket) == before
    assert _fulls_listed(capsys, conf) == fulls
    # the daemon again: its supervisor, its copy queue (and the prunes it runs) over the partial chain
    d.start(c.members[0].member.name)
    new_base = wait_for(lambda: _watching_past(directory, last), 180,
                        "the daemon's watch on a full backup of the restored cluster")
    wait_for(lambda: [n for n in full_backups(c) if full_revision(c, n) == new_base
                      and any(o.endswith("/" + n) for o in _objects(rgw, bucket))], 180,
             "the restored cluster's own full backup copied")
    d.stop()
    started_at = re.findall(r"new delta chain \w+ from revision (\d+)", d.log(c.members[0].member.name))
    assert str(cp_rev + 1) not in started_at, started_at  # the checkpoint here is no base for a new chain
    for argv in (("backup", "push"), ("backup", "prune", "--remote")):  # whatever the daemon left pending
        rc, out, err = _run(capsys, "-c", conf, *argv)
        assert rc == 0, out + err
    after = _objects(rgw, bucket)
    assert not _untouched(before, after, chain_key), (new_base, _untouched(before, after, chain_key))
    assert _reach(capsys, conf, full, chain_key) == reach

    # (2) the local retention keeps the partial chain with its full backup, and prunes it only with it
    rc, out, err = _run(capsys, "-c", conf, "backup", "prune")
    assert rc == 0, out + err
    scan = chains.scan(directory)
    partial = next(ch for ch in scan.chains if ch.begins_at)
    assert all(os.path.exists(p) for p in partial.paths)
    assert full in full_backups(c)
    rev = int(full_revision(c, full))
    base = BaseBackup(chain_key)
    other = BaseBackup("0" * 64)
    kept = chains.plan_prune(scan, [chains.FullRef(full, rev, True, base=base)])
    assert [x.keep for x in kept if x.paths == partial.paths] == [True], kept
    gone = chains.plan_prune(scan, [chains.FullRef(full, rev, False, reason="test", base=base),
                                    chains.FullRef("etcd-2000-01-01-00-00-00.tar", rev, True, base=other)])
    assert [x.keep for x in gone if x.paths == partial.paths] == [False], gone  # another backup keeps it not

    # (3) `backup fetch` of that backup brings the earlier segments in (a part left by a killed run
    # continued), and the chain here is whole again
    first = left[0].rsplit("/", 1)[-1]
    s3 = rgw.client()
    body = s3.get_object(Bucket=bucket, Key="p/" + left[0])["Body"].read()
    staging = os.path.join(directory, fetch.STAGING)
    os.makedirs(staging, mode=0o700, exist_ok=True)
    with open(os.path.join(staging, first + ".part"), "wb") as fh:
        fh.write(body[:len(body) // 2])
    with open(os.path.join(staging, first + ".etag"), "w") as tf:
        tf.write(before[left[0]][1].strip('"'))
    rc, out, err = _run(capsys, "-c", conf, "--json", "backup", "fetch", full)
    assert rc == 0, out + err
    got = {o["file"]: (o["how"], o["resumed_at"]) for o in json.loads(out)["objects"]}
    assert got[first] == ("resumed", len(body) // 2), got
    assert all(got[n.rsplit("/", 1)[-1]][0] == "fetched" for n in left[1:]), got
    whole = next(ch for ch in chains.scan(directory).chains if ch.base_sha256 == chain_key)
    assert not whole.begins_at and whole.first is not None and whole.stop is None, whole
    assert _span(os.path.basename(whole.paths[0]))[0] == rev + 1, whole.paths[:2]
    rc, out, err = _run(capsys, "-c", conf, "backup", "list")
    assert rc == 0, err
    assert "earlier segments not here" not in out, out
    assert "ORPHANED" not in out, out
    assert not _untouched(before, _objects(rgw, bucket), chain_key)


def _watching_past(directory: str, revision: int) -> Optional[int]:
    """The base of the chain the daemon writes, once it is past ``revision`` (a backup of the restored cluster)."""
    base = chains.active_base(directory)
    return base if base is not None and base > revision else None


def _fulls_listed(capsys: Any, conf: str) -> List[Tuple[str, str]]:
    """The full backups `backup list --remote` shows: (name, chain key)."""
    rc, out, err = _run(capsys, "-c", conf, "--json", "backup", "list", "--remote")
    assert rc == 0, err
    return sorted((b["name"], b.get("chain") or "") for b in json.loads(out)["backups"])


def full_revision(c: Any, name: str) -> int:
    from etcd_agent.backup import catalog

    e = next(e for e in catalog.list_backups(c.cfg.backup.dir, utc=c.cfg.backup.utc, cfg=c.cfg) if e.name == name)
    assert e.revision is not None, e
    return e.revision
