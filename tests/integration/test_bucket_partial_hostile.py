"""What a bucket can hold against a point-in-time restore that fetches only part of a chain: the
footers read by ranged reads only decide what is fetched, never what is trusted. A segment object
whose footer names the checkpoint with a later lease census, forged without the key, must not
make the restore replay less than the chain holds: the fetched run is checked as usual (refused,
or the rest fetched and the state equal to the live one). A segment deleted between the plan and
the fetch: one sentence, nothing written outside the staging dir, the member untouched. One bed
(real daemon, etcd 3.5.16, Ceph RGW) for both, each putting back what it changed."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import pytest

from etcd_agent.bucket import partial
from etcd_agent.chain.reader import read_segment
from etcd_agent.etcd.rpc import EtcdRpc
from tests.harness.rgw import RgwBed
from tests.integration.continuous import dump
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_pitr_checkpoints import same_state, user_keys
from tests.integration.test_restore_from_bucket_faults import _write
from tests.integration.test_restore_from_bucket_partial import _lost, _run, _segments, _span

pytestmark = pytest.mark.integration

BED_MEMBERS = 1


def _outside_staging(directory: str) -> List[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("etcd-agent: error: ")]
    assert len(errors) == 1, err
    return errors[0]


def test_what_the_bucket_lies_about_decides_no_more_than_what_is_fetched(bed, rgw: RgwBed, tmp_path,  # type: ignore[no-untyped-def]
                                                                          capsys, monkeypatch) -> None:
    c, bucket, key, _cp_rev, last, live = _lost(bed, rgw, tmp_path)
    conf, directory = c.config_path, c.cfg.backup.dir
    to = ("--to-revision", str(last))
    s3 = rgw.client()
    rc, out, err = _run(capsys, "-c", conf, "--json", "restore", "--from-bucket", "latest", *to, "--key-file", key,
                        "--dry-run")
    assert rc == 0, err
    plan = json.loads(out)["bucket"]
    run = sorted((o["name"] for o in plan["objects"] if o["kind"] == "segment"), key=_span)
    segs = _segments(rgw, bucket)
    assert run and len(run) < len([s for s in segs if _span(s)[0] <= last]), (run, segs)
    figures: List[str] = []

    # (1) a segment of the run deleted after the plan, before the fetch
    gone = run[-1]
    body = s3.get_object(Bucket=bucket, Key="p/" + gone)["Body"].read()
    meta = s3.head_object(Bucket=bucket, Key="p/" + gone)["Metadata"]
    real_cut = partial.cut

    def cut_then_delete(*a: Any, **kw: Any) -> Any:
        got = real_cut(*a, **kw)
        s3.delete_object(Bucket=bucket, Key="p/" + gone)
        return got

    monkeypatch.setattr(partial, "cut", cut_then_delete)
    try:
        rc, out, err = _run(capsys, "-c", conf, "restore", "--from-bucket", "latest", *to, "--key-file", key, "--yes")
    finally:
        monkeypatch.setattr(partial, "cut", real_cut)
        s3.put_object(Bucket=bucket, Key="p/" + gone, Body=body, Metadata=meta)
    said = _one_error(err)
    assert rc != 0 and gone.rsplit("/", 1)[-1] in said, (rc, err)
    assert not _outside_staging(directory), _outside_staging(directory)
    assert not os.path.exists(c.cfg.data_dir(c.cfg.members[0].name)), "the member was touched"
    figures.append(f"a segment deleted after the plan: rc {rc}: {said[:400]}")

    # the segment whose footer names the checkpoint (in the run), and that checkpoint's object
    for holder in run:
        (tmp_path / "holder.seg").write_bytes(s3.get_object(Bucket=bucket, Key="p/" + holder)["Body"].read())
        seg = read_segment(str(tmp_path / "holder.seg"))
        cps = seg.info.footer.checkpoints
        if cps:
            break
    assert cps, run
    cp_obj = next(o["name"] for o in plan["objects"] if o["kind"] == "checkpoint")
    assert cp_obj.rsplit("/", 1)[-1] == cps[0].name, (cp_obj, cps)
    runbook = _runbook_from(s3, bucket, next(o["name"] for o in plan["objects"] if o["kind"] == "full"), tmp_path)
    rb_sha = _snapshot_sha(runbook)

    # (2) its footer forged without the key: a census past the checkpoint (not a footer at all to
    # the ranged read: the whole chain is fetched); (3) naming the runbook tarball's snapshot,
    # uploaded under the checkpoint's object: the fetched run's first segment is then forged
    cases = [("a footer forged without the key, its census past the checkpoint",
              tuple(dataclasses.replace(cp, leases_from=cp.revision + 1) for cp in cps), False),
             ("a footer forged without the key naming a runbook tarball uploaded as the checkpoint",
              tuple(dataclasses.replace(cp, sha256=rb_sha) for cp in cps), True)]
    for label, lie, swap in cases:
        forged = _write(str(tmp_path), seg.info.header, seg.txns,
                        dataclasses.replace(seg.info.footer, checkpoints=lie), os.urandom(32))
        with _replaced(s3, bucket, holder, forged), _replaced(s3, bucket, cp_obj, runbook if swap else None):
            rc, out, err = _run(capsys, "-c", conf, "--json", "restore", "--from-bucket", "latest", *to, "--key-file",
                                key, "--dry-run")
            assert rc == 0, err
            fetched = [o["name"] for o in json.loads(out)["bucket"]["objects"] if o["kind"] == "segment"]
            rc, out, err = _run(capsys, "-c", conf, "restore", "--from-bucket", "latest", *to, "--key-file", key,
                                "--yes")
        said = _one_error(err)
        assert rc == 3 and holder.rsplit("/", 1)[-1] in said, (rc, err)
        assert not _outside_staging(directory), _outside_staging(directory)
        figures.append(f"{label}: the plan fetches {len(fetched)} segment(s) (the run is {len(run)}); rc {rc}: "
                       f"{said[:400]}")

    # (4) the runbook tarball under the checkpoint's object, the chain as it was: never the start
    with _replaced(s3, bucket, cp_obj, runbook):
        rc, out, err = _run(capsys, "-c", conf, "--json", "restore", "--from-bucket", "latest", *to, "--key-file", key,
                            "--yes")
    if rc == 0:  # completed without it: the state is the live one
        wait_healthy(c.cfg, 1, 60)
        diff = same_state(live, user_keys(dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0))))
        assert not diff, diff[:10]
        doc = json.loads(out)
        got = sorted(o["name"].rsplit("/", 1)[-1] for o in doc["bucket"]["objects"] if o["kind"] == "segment")
        outcome = (f"completed from {doc['bucket']['backup']} through {len(got)} segment(s) (the run was {len(run)}), "
                   "the state equal to the live one")
    else:
        outcome = _one_error(err)[:400]
        assert rc == 3 and not _outside_staging(directory), (err, _outside_staging(directory))
    figures.append(f"a runbook tarball uploaded as the checkpoint: rc {rc}: {outcome}")

    # whatever the backup dir now holds under the checkpoint's name, `backup push` copies nothing
    # over the chain's objects in the bucket, and adds none to it
    here = os.path.join(directory, cp_obj.rsplit("/", 1)[-1])
    held = "absent" if not os.path.exists(here) else (
        "the runbook tarball" if open(here, "rb").read() == runbook else "another file")
    assert held != "the runbook tarball", held  # not let in: the chain did not start from it
    before = _etags(s3, bucket)
    rc, out, err = _run(capsys, "-c", conf, "backup", "push")
    after = _etags(s3, bucket)
    chain_dir = cp_obj.rsplit("/", 1)[0] + "/"
    changed = sorted(n for n in set(before) | set(after) if n.startswith(chain_dir) and before.get(n) != after.get(n))
    assert not changed, (changed, out, err)
    assert "Traceback" not in err, err
    figures.append(f"then in the backup dir under the checkpoint's name: {held}; `backup push`: rc {rc}, "
                   f"{len([n for n in after if n not in before])} object(s) added outside the chain, none in it")
    print("\nFIGURE " + "\n  ".join(figures))


def _etags(s3: Any, bucket: str) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="p/"):
        for o in page.get("Contents", []):
            out[o["Key"][2:]] = str(o["ETag"])
    return out


@contextmanager
def _replaced(s3: Any, bucket: str, name: str, body: Optional[bytes]) -> Iterator[None]:
    """Object ``name`` holding ``body`` (its sha256 metadata to match) for the block; None: as it is."""
    if body is None:
        yield
        return
    orig = s3.get_object(Bucket=bucket, Key="p/" + name)["Body"].read()
    meta = s3.head_object(Bucket=bucket, Key="p/" + name)["Metadata"]
    s3.put_object(Bucket=bucket, Key="p/" + name, Body=body, Metadata={**meta, "sha256": hashlib.sha256(body).hexdigest()})
    try:
        yield
    finally:
        s3.put_object(Bucket=bucket, Key="p/" + name, Body=orig, Metadata=meta)


def _runbook_from(s3: Any, bucket: str, full: str, tmp_path: Any) -> bytes:
    """The manual runbook's tarball (etcd.conf, etcd.service, etcd_snapshot.db; no manifest, gzip)
    of the full backup's snapshot."""
    work = tmp_path / "runbook"
    work.mkdir()
    (work / "full.tar").write_bytes(s3.get_object(Bucket=bucket, Key="p/" + full)["Body"].read())
    with tarfile.open(str(work / "full.tar")) as tar:
        snap = tar.extractfile("etcd_snapshot.db")
        assert snap is not None
        (work / "etcd_snapshot.db").write_bytes(snap.read())
    (work / "etcd.conf").write_text("ETCD_NAME=m1\nETCD_DATA_DIR=/var/lib/etcd\n")
    (work / "etcd.service").write_text("[Service]\nExecStart=/usr/bin/etcd\n")
    out = work / "runbook.tar"
    with tarfile.open(str(out), "w:gz") as tar:
        for n in ("etcd.conf", "etcd.service", "etcd_snapshot.db"):
            tar.add(str(work / n), arcname=n)
    return out.read_bytes()


def _snapshot_sha(tarball: bytes) -> str:
    with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
        snap = tar.extractfile("etcd_snapshot.db")
        assert snap is not None
        return hashlib.sha256(snap.read()).hexdigest()
