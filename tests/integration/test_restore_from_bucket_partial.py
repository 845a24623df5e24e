"""A point-in-time restore from the bucket fetches only what it replays (issue 33 item 8): with the
manifest key, the full backup, the checkpoint it starts from and the segments from the one holding
that checkpoint's lease census on - never the chain's earlier segments, which a replay from the
checkpoint does not read; without the key, the whole chain, and the plan says why. A forged
segment inside the run used is refused; a damaged one before it is not fetched, and the plan names
what is not. The partial chain then in the backup dir is listed as such and serves a later local
restore inside it; one before it is refused naming the missing segments. Real daemon, real etcd,
real S3 (Ceph RGW)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Dict, List, Tuple

import pytest

from etcd_agent.chain.segments import parse_name
from etcd_agent.cli.main import main
from etcd_agent.errors import OperationFailed
from etcd_agent.etcd.rpc import EtcdRpc
from tests.harness.rgw import RgwBed
from tests.integration.continuous import dump, full_backups, rpc, segment_files, wait_durable, wait_for
from tests.integration.test_bucket_queue import landed, names, started
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_pitr_checkpoints import CHECKPOINTS, same_state, user_keys, vouched, workload
from tests.integration.test_pitr_disaster import live_at
from tests.integration.test_restore_from_bucket import _disaster

pytestmark = pytest.mark.integration

BED_MEMBERS = 1


def _span(name: str) -> Tuple[int, int]:
    rng = parse_name(name.rsplit("/", 1)[-1])
    assert rng is not None, name
    return rng


def _lost(bed: Any, rgw: RgwBed, tmp_path: Any) -> Tuple[Any, str, str, int, int, Dict[str, Any]]:
    """A chain of several segments, a checkpoint vouched for after them and a tail after it, all
    copied; then the master's data dir, backup dir and key gone. (cluster, bucket, key copy, the
    checkpoint's revision, the last revision, the live key space at it)."""
    _d, c, bucket = started(bed, rgw, delta=CHECKPOINTS)
    r = rpc(c)
    lease = r.lease_grant(900)[0]
    rev = 0
    for i in range(4):  # segments close every second: several before any checkpoint
        rev = workload(r, f"p{i}", 25, lease)
        time.sleep(1.3)
    wait_durable(c, rev)
    directory = c.cfg.backup.dir
    # a checkpoint taken while the writes ran is before ``rev``: the next one is due once the chain
    # grew by checkpoints.MIN_GROWTH (1 MiB) more, so more writes bring it - a phase at a time,
    # looking for it a few seconds after each (due at the next tick, then vouched for once a segment
    # closes) rather than a minute for one that is not due yet
    for i in range(4, 40):
        try:
            wait_for(lambda: [x for x in vouched(directory) if x[1] >= rev], 4,
                     f"a checkpoint after revision {rev} that the chain vouches for")
            break
        except OperationFailed:
            wait_durable(c, workload(r, f"p{i}", 25, lease))
    _vouched_after(directory, rev)
    cp_rev = max(x[1] for x in vouched(directory))
    last = workload(r, "tail", 20, lease)
    wait_durable(c, last)
    live = user_keys(live_at(c.cfg.members[0].client_url, last))
    want = full_backups(c) + [os.path.basename(s) for s in segment_files(c)]
    wait_for(lambda: landed(rgw, bucket, want), 120, f"the {len(want)} files copied")
    key = _disaster(_d, c, str(tmp_path / "offsite"))
    return c, bucket, key, cp_rev, last, live


def _vouched_after(directory: str, rev: int) -> None:
    wait_for(lambda: [x for x in vouched(directory) if x[1] >= rev], 60,
             f"a checkpoint after revision {rev} that the chain vouches for")


def _segments(rgw: RgwBed, bucket: str) -> List[str]:
    return sorted((n for n in names(rgw, bucket) if n.rsplit("/", 1)[-1].startswith("etcd-delta-")), key=_span)


def _run(capsys: Any, *argv: str) -> Tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_restore_from_the_bucket_fetches_only_the_segments_its_replay_reads(bed, rgw: RgwBed, tmp_path,  # type: ignore[no-untyped-def]
                                                                               capsys) -> None:
    c, bucket, key, cp_rev, last, live = _lost(bed, rgw, tmp_path)
    conf = c.config_path
    segs = _segments(rgw, bucket)
    to = ("--to-revision", str(last))

    # (a) with the key: the run from the checkpoint's lease census on, the ones before named as not fetched
    rc, out, err = _run(capsys, "-c", conf, "--json", "restore", "--from-bucket", "latest", *to, "--key-file", key,
                        "--dry-run")
    assert rc == 0, err
    plan = json.loads(out)["bucket"]
    run = sorted((o["name"] for o in plan["objects"] if o["kind"] == "segment"), key=_span)
    left = [s for s in segs if s not in run and _span(s)[0] <= last]
    assert run and left, (run, segs)
    assert max(_span(s)[1] for s in left) < _span(run[0])[0] <= cp_rev, (left, run, cp_rev)
    line = next(n for n in plan["not_fetched"] if "lease census" in n)
    assert f"{len(left)} segment(s), revisions {_span(left[0])[0]}..{_span(left[-1])[1]}" in line, line
    full_obj = "p/" + next(o["name"] for o in plan["objects"] if o["kind"] == "full")
    figure = f"FIGURE partial fetch: {len(run)} of {len(run) + len(left)} segment(s) fetched; not fetched: {line}"

    # (c) without the key: the whole chain, and the plan says why
    rc, out, err = _run(capsys, "-c", conf, "--json", "restore", "--from-bucket", "latest", *to, "--dry-run")
    assert rc == 0, err
    plan = json.loads(out)["bucket"]
    fetched = [o["name"] for o in plan["objects"] if o["kind"] == "segment"]
    assert sorted(fetched, key=_span) == [s for s in segs if _span(s)[0] <= last], (fetched, segs)
    assert any("their signatures cannot be checked" in n for n in plan["notes"]), plan

    # (b) a forged segment inside the run is refused, nothing outside the staging dir written
    from tests.integration.test_restore_from_bucket_faults import _write

    s3 = rgw.client()
    inside = run[-1]
    body = s3.get_object(Bucket=bucket, Key="p/" + inside)["Body"].read()
    meta = s3.head_object(Bucket=bucket, Key="p/" + inside)["Metadata"]
    from etcd_agent.chain import sign as segsign
    from etcd_agent.chain.reader import read_segment

    orig = tmp_path / inside.rsplit("/", 1)[-1]
    orig.write_bytes(body)
    seg = read_segment(str(orig))
    h, f = seg.info.header, seg.info.footer
    t = seg.txns[-1]
    changed = [*seg.txns[:-1], dataclasses.replace(t, events=(dataclasses.replace(t.events[0], value=b"forged"),
                                                                *t.events[1:]))]
    real_sign = segsign.sign
    segsign.sign = lambda footer, k, before: footer.with_signature(f.signature)  # type: ignore[assignment]
    try:
        forged = _write(str(tmp_path), h, changed, f, b"k" * 32)
    finally:
        segsign.sign = real_sign  # type: ignore[assignment]
    s3.put_object(Bucket=bucket, Key="p/" + inside, Body=forged, Metadata={**meta, "sha256": hashlib.sha256(forged).hexdigest()})
    # and one before the run damaged: it is never fetched
    before = left[0]
    s3.put_object(Bucket=bucket, Key="p/" + before, Body=b"not a segment at all",
                  Metadata={"sha256": hashlib.sha256(b"not a segment at all").hexdigest()})
    rc, out, err = _run(capsys, "-c", conf, "restore", "--from-bucket", "latest", *to, "--key-file", key, "--yes")
    assert rc == 3, out + err
    assert "its footer does not match its signature" in err, err
    assert not [n for n in os.listdir(c.cfg.backup.dir) if n.startswith("etcd-")], os.listdir(c.cfg.backup.dir)
    s3.put_object(Bucket=bucket, Key="p/" + inside, Body=body, Metadata=meta)

    # (e) the run fine, the full backup's bytes damaged under its sha256 metadata: a replay from the
    # checkpoint reads nothing of its snapshot, but the chain is bound to it by that snapshot's
    # sha256 and the restore leaves it in the backup dir - refused before any master is touched
    full_key = full_obj
    full_body = s3.get_object(Bucket=bucket, Key=full_key)["Body"].read()
    full_meta = s3.head_object(Bucket=bucket, Key=full_key)["Metadata"]
    mid = len(full_body) // 2
    s3.put_object(Bucket=bucket, Key=full_key, Metadata=full_meta,
                  Body=full_body[:mid] + bytes([full_body[mid] ^ 0xFF]) + full_body[mid + 1:])
    rc, out, err = _run(capsys, "-c", conf, "restore", "--from-bucket", "latest", *to, "--key-file", key, "--yes")
    assert rc == 1, out + err
    errors = [x for x in err.splitlines() if x.startswith("etcd-agent: error:")]
    assert len(errors) == 1 and "failed its checksum on fetch: nothing of it kept" in errors[0], err
    assert ".;" not in errors[0] and "nothing restored" in errors[0], errors
    assert not os.path.exists(c.cfg.data_dir(c.cfg.members[0].name)), "the member was touched"
    assert not [n for n in os.listdir(c.cfg.backup.dir) if not n.startswith(".")], os.listdir(c.cfg.backup.dir)
    # (f) the same damage with the object's sha256 metadata made to match (the metadata vouches for
    # nothing but the bytes it came with): the snapshot no longer hashes to the sha256 its signed
    # manifest names - which is what the chain's first signed segment names - so it is refused too
    import io
    import tarfile

    from etcd_agent.backup.manifest import SNAPSHOT

    with tarfile.open(fileobj=io.BytesIO(full_body)) as tar:
        snap = tar.getmember(SNAPSHOT)
    at = snap.offset_data + snap.size - 1  # etcd's sha256 trailer: the db's pages still read as before
    bad = full_body[:at] + bytes([full_body[at] ^ 0xFF]) + full_body[at + 1:]
    s3.put_object(Bucket=bucket, Key=full_key, Body=bad, Metadata={**full_meta, "sha256": hashlib.sha256(bad).hexdigest()})
    rc, out, err = _run(capsys, "-c", conf, "restore", "--from-bucket", "latest", *to, "--key-file", key, "--yes")
    assert rc == 1, out + err
    errors = [x for x in err.splitlines() if x.startswith("etcd-agent: error:")]
    assert len(errors) == 1 and f"{SNAPSHOT}: sha256 trailer does not match the data" in errors[0], err
    assert not os.path.exists(c.cfg.data_dir(c.cfg.members[0].name)), "the member was touched"
    assert not [n for n in os.listdir(c.cfg.backup.dir) if not n.startswith(".")], os.listdir(c.cfg.backup.dir)
    s3.put_object(Bucket=bucket, Key=full_key, Body=full_body, Metadata=full_meta)

    # (a) the restore fetches the run only (the damaged segment before it never read) and restores the state
    rc, out, err = _run(capsys, "-c", conf, "--json", "restore", "--from-bucket", "latest", *to, "--key-file", key,
                        "--yes")
    assert rc == 0, err
    done = json.loads(out)
    got = sorted((o["name"] for o in done["bucket"]["objects"] if o["kind"] == "segment"), key=_span)
    assert got == run, (got, run)
    # each object's fetch leg, from the fetch's start (what says which object held the others up)
    legs = {o["file"]: (o["began"], o["seconds"]) for o in done["bucket"]["objects"]}
    assert all(0 <= b and 0 <= s and b + s <= done["bucket"]["seconds"] for b, s in legs.values()), legs
    assert {o["kind"] for o in done["bucket"]["objects"]} == {"full", "checkpoint", "segment"}, legs
    wait_healthy(c.cfg, 1, 60)
    diff = same_state(live, user_keys(dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0))))
    assert not diff, diff[:10]  # keys, values and which keys share a lease (a restore grants new lease ids)

    # (d) the partial chain in the backup dir: listed as such; a local restore inside it works with
    # the key, one before it is refused naming the missing segments
    rc, out, err = _run(capsys, "-c", conf, "backup", "list")
    assert rc == 0, err
    assert "earlier segments not here" in out, out
    full = next(n for n in full_backups(c) if n == done["bucket"]["backup"])
    rc, out, err = _run(capsys, "-c", conf, "restore", "--from", full, "--to-revision", str(_span(left[0])[0]),
                        "--key-file", key, "--dry-run")
    assert rc == 3, out + err
    assert f"its segments for revisions {_span(left[0])[0]}..{_span(run[0])[0] - 1} are not here" in err, err
    rc, out, err = _run(capsys, "-c", conf, "restore", "--from", full, *to, "--key-file", key, "--dry-run")
    assert rc == 0, out + err  # inside it: from the checkpoint, the run verified and signed
    assert f"reached revision {last}" in out, out
    print(f"\n{figure}")  # at the end: capsys takes stdout as each command's output
