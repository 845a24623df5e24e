"""`backup fetch` (issue 33 item 3) on a real S3 server (Ceph RGW): a daemon-made chain fetched
into an empty backup dir, then listed and verified; bytes that do not match their sha256 metadata,
no metadata, a hostile name, each refused with nothing in the backup dir; a fetch killed halfway
continued by the next run."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, List, Tuple

import pytest

from etcd_agent.bucket import client as remotebucket
from etcd_agent.bucket import fetch, layout
from etcd_agent.bucket.staging import fetch_into
from etcd_agent.config import Config
from etcd_agent.errors import BackupCorrupt
from tests.harness.rgw import RgwBed, on_agent_clients
from tests.integration.continuous import agent, full_backups, put, rpc, segment_files, wait_durable, wait_for
from tests.integration.test_backup_remote import remote_config
from tests.integration.test_bucket_queue import landed, started

pytestmark = pytest.mark.integration

NAME = "etcd-2026-03-01-10-00-00.tar"
KEY = "ab" * 32
GUARD = 60.0  # seconds the first GETs are held for the others to begin: a guard, not a timing assertion


BED_MEMBERS = 1  # the conftest's `bed` fixture: one-member daemon beds


def test_a_daemon_made_chain_is_fetched_into_an_empty_backup_dir(bed, rgw: RgwBed) -> None:  # type: ignore[no-untyped-def]
    from tests.integration.test_pitr_checkpoints import CHECKPOINTS, vouched

    d, c, bucket = started(bed, rgw, delta=CHECKPOINTS)
    r = rpc(c)
    rev = 0
    for i in range(100):  # 1.6 MB of events: past the checkpoint's growth
        rev = put(r, f"/fetch/{i:03d}", os.urandom(8192).hex().encode())
    wait_durable(c, rev)
    checkpoint = wait_for(lambda: vouched(c.cfg.backup.dir), 120, "a checkpoint the chain vouches for")[0][0]
    want = full_backups(c) + [os.path.basename(s) for s in segment_files(c)]
    wait_for(lambda: landed(rgw, bucket, want), 120, f"the {len(want)} files copied")
    d.stop()  # the cluster keeps serving (verify checks the identity against it); nothing writes there now
    directory = c.cfg.backup.dir
    newest_full = [n for n in full_backups(c) if n not in {cp for cp, _rev in vouched(directory)}][-1]
    aside = directory + ".aside"
    os.rename(directory, aside)

    dry = agent(c, "--json", "backup", "fetch", "--dry-run", "latest")
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert planned["objects"][0]["kind"] == "full" and planned["objects"][0]["file"] == newest_full
    assert not os.path.exists(directory), "a dry run wrote into the backup dir"

    res = agent(c, "backup", "fetch", "latest")
    assert res.returncode == 0, res.stdout + res.stderr
    fetched = sorted(os.listdir(directory))
    assert fetched == sorted(o["file"] for o in planned["objects"]), (fetched, planned)
    assert any(f.endswith(".seg") for f in fetched) and checkpoint in fetched, fetched
    assert [o["kind"] for o in planned["objects"]][:2] == ["full", "checkpoint"], planned
    for f in fetched:  # the same bytes as the files the daemon made
        assert _sha(os.path.join(directory, f)) == _sha(os.path.join(aside, f)), f
    assert res.stdout.splitlines()[0].startswith(f"fetched {planned['objects'][0]['file']}"), res.stdout

    listed = agent(c, "backup", "list")
    assert listed.returncode == 0 and planned["objects"][0]["file"] in listed.stdout, listed.stdout + listed.stderr
    verified = agent(c, "backup", "verify", "latest")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    again = agent(c, "backup", "fetch", "latest")  # everything already here: nothing fetched twice
    assert again.returncode == 0 and "fetched" not in again.stdout.replace("already here", ""), again.stdout
    # a name under the chain that is not ours: the whole fetch refused, in one sentence, exit 1
    rgw.client().put_object(Bucket=bucket, Key=f"p/chains/{planned['chain']}/../x", Body=b"x")
    shutil.rmtree(directory)
    hostile = agent(c, "backup", "fetch", "latest")
    assert hostile.returncode == 1, hostile.stdout + hostile.stderr
    assert "is not a backup, a checkpoint or a segment of ours" in hostile.stderr and \
        len(hostile.stderr.strip().splitlines()) == 1, hostile.stderr
    assert not os.path.exists(directory), os.listdir(directory)
    print(f"\nFIGURE fetched {len(fetched)} objects: {res.stdout.splitlines()[-1]}")


# ---------------------------------------------------------------- faults, objects put by hand


def _config(rgw: RgwBed, tmp_path: Path) -> Config:
    """test_backup_remote's config (a fresh bucket of the bed), its backup dir under tmp_path."""
    cfg = remote_config(rgw)
    return dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, dir=str(tmp_path / "backups")))


def _put(cfg: Config, rgw: RgwBed, name: str, body: bytes, meta: Any = None) -> None:
    key = remotebucket.expand_prefix(cfg.backup.remote.prefix, cfg.cluster.name) + name
    metadata = {"sha256": hashlib.sha256(body).hexdigest()} if meta is None else meta
    rgw.client().put_object(Bucket=cfg.backup.remote.bucket, Key=key, Body=body, Metadata=metadata)


def _sha(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _landed(cfg: Config) -> List[str]:
    d = cfg.backup.dir
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def test_bytes_that_do_not_match_their_sha256_are_refused_and_nothing_kept(rgw: RgwBed, tmp_path: Path) -> None:
    cfg = _config(rgw, tmp_path)
    body = os.urandom(300 * 1024)
    _put(cfg, rgw, layout.full_name(KEY, NAME), body, {"sha256": hashlib.sha256(b"other").hexdigest()})
    _full, items = fetch.plan(cfg, "latest")
    with pytest.raises(BackupCorrupt) as refused:
        fetch_into(cfg, items)
    assert re.fullmatch(r"backup fetch: 0 of 1 object\(s\) fetched, then: \S+ failed its checksum on fetch: nothing "
                        r"of it kept; nothing moved into \S+", refused.value.message), refused.value.message  # no "continues"
    assert _landed(cfg) == [], _landed(cfg)


def test_an_object_without_sha256_metadata_is_refused(rgw: RgwBed, tmp_path: Path) -> None:
    cfg = _config(rgw, tmp_path)
    _put(cfg, rgw, layout.full_name(KEY, NAME), os.urandom(1000), {})
    _full, items = fetch.plan(cfg, NAME)
    with pytest.raises(BackupCorrupt, match="carries no sha256 metadata: it cannot be checked"):
        fetch_into(cfg, items)
    assert _landed(cfg) == []


def test_latest_passes_over_a_copy_whose_sha256_was_never_set(
        rgw: RgwBed, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An upload that landed but whose sha256 was never set (cut before its copy onto itself,
    bucket/remote.py) is no copy: ``latest`` and a date take the newest full backup that carries
    one, and say which they passed over; named, it is refused as before."""
    cfg = _config(rgw, tmp_path)
    newer = "etcd-2026-03-01-11-00-00.tar"
    _put(cfg, rgw, layout.full_name(KEY, NAME), os.urandom(1000))
    _put(cfg, rgw, layout.full_name("cd" * 32, newer), os.urandom(1000), {"revision": "9"})
    with caplog.at_level(logging.WARNING, logger="etcd_agent.bucket.fetch"):
        assert fetch.plan(cfg, "latest")[0].name == NAME
        assert fetch.plan(cfg, "2026-03-01")[0].name == NAME
    assert f"{newer} in the bucket carries no sha256 metadata" in caplog.text, caplog.text
    _full, items = fetch.plan(cfg, newer)
    with pytest.raises(BackupCorrupt, match="carries no sha256 metadata: it cannot be checked"):
        fetch_into(cfg, items)


@pytest.mark.parametrize("hostile", [f"chains/{KEY}/../x", f"chains/{KEY}/notes.txt",
                                     f"chains/{KEY}/checkpoints/etcd-delta-1-2-20260301T100000Z.seg"])
def test_a_hostile_name_under_the_chain_refuses_the_fetch(rgw: RgwBed, tmp_path: Path, hostile: str) -> None:
    cfg = _config(rgw, tmp_path)
    _put(cfg, rgw, layout.full_name(KEY, NAME), os.urandom(1000))
    _put(cfg, rgw, hostile, b"x")
    with pytest.raises(BackupCorrupt, match="is not a backup, a checkpoint or a segment of ours"):
        fetch.plan(cfg, "latest")
    assert _landed(cfg) == []


def test_a_fetch_killed_halfway_is_continued(rgw: RgwBed, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _config(rgw, tmp_path)
    body = os.urandom(7 * 1024 * 1024)
    segment = "etcd-delta-11-20-20260301T100001Z.seg"
    _put(cfg, rgw, layout.full_name(KEY, NAME), body)
    _put(cfg, rgw, layout.segment_name(KEY, segment), b"s" * 100)
    # what a run killed 3 MiB into the full backup leaves: the part and the ETag it began on
    head = rgw.client().head_object(Bucket=cfg.backup.remote.bucket,
                                    Key=remotebucket.expand_prefix(cfg.backup.remote.prefix, cfg.cluster.name)
                                    + layout.full_name(KEY, NAME))
    staging = os.path.join(cfg.backup.dir, fetch.STAGING)
    os.makedirs(staging, mode=0o700)
    os.chmod(cfg.backup.dir, 0o700)
    with open(os.path.join(staging, NAME + ".part"), "wb") as fh:
        fh.write(body[:3 * 1024 * 1024])
    with open(os.path.join(staging, NAME + ".etag"), "w") as fh:
        fh.write(head["ETag"].strip('"'))
    _full, items = fetch.plan(cfg, "2026-03-01")
    assert [w.file for w in items] == [NAME, segment]
    with caplog.at_level("INFO"):
        done = fetch_into(cfg, items)
    assert [(f.how, f.resumed_at) for f in done] == [("resumed", 3 * 1024 * 1024), ("fetched", 0)]
    assert _sha(os.path.join(cfg.backup.dir, NAME)) == hashlib.sha256(body).hexdigest()
    assert _landed(cfg) == sorted([NAME, segment]), _landed(cfg)  # the staging dir is gone once empty
    # a part begun on another version of the object starts over
    os.unlink(os.path.join(cfg.backup.dir, NAME))
    os.makedirs(staging, mode=0o700)
    with open(os.path.join(staging, NAME + ".part"), "wb") as fh:
        fh.write(b"old bytes")
    with open(os.path.join(staging, NAME + ".etag"), "w") as fh:
        fh.write("0123456789abcdef0123456789abcdef")
    done = fetch_into(cfg, items)
    assert [f.how for f in done] == ["fetched", "already here"]
    assert _sha(os.path.join(cfg.backup.dir, NAME)) == hashlib.sha256(body).hexdigest()
    # a run killed between the rename and its clean-up: the file is here, its part too
    os.makedirs(staging, mode=0o700)
    for suffix in (".part", ".etag"):
        Path(staging, NAME + suffix).write_bytes(b"left")
    done = fetch_into(cfg, items)
    assert [f.how for f in done] == ["already here", "already here"]
    assert _landed(cfg) == sorted([NAME, segment]), _landed(cfg)


def test_a_different_local_file_of_the_same_name_is_never_overwritten(rgw: RgwBed, tmp_path: Path) -> None:
    from etcd_agent.errors import RefusedError

    cfg = _config(rgw, tmp_path)
    _put(cfg, rgw, layout.full_name(KEY, NAME), os.urandom(1000))
    os.makedirs(cfg.backup.dir, mode=0o700)
    Path(cfg.backup.dir, NAME).write_bytes(b"mine")
    _full, items = fetch.plan(cfg, "latest")
    with pytest.raises(RefusedError, match="exists and differs from .*: it is not overwritten"):
        fetch_into(cfg, items)
    assert Path(cfg.backup.dir, NAME).read_bytes() == b"mine"
    shutil.rmtree(cfg.backup.dir)


# ---------------------------------------------------------------- the restore's staging and checks


def _chain(tmp: Path, n: int) -> List[Tuple[str, bytes]]:
    """``n`` segments of one chain from revision 10, two puts each, written by the product's own
    writer: (file name, bytes), in revision order."""
    from etcd_agent.chain.segments import PUT, Event, SegmentHeader, Txn
    from etcd_agent.chain.writer import SegmentWriter

    out = tmp / "made"
    out.mkdir()
    made: List[Tuple[str, bytes]] = []
    prev, rev, t = "", 10, 1_772_359_200_000  # 2026-03-01T10:00:00Z
    for seq in range(n):
        w = SegmentWriter(str(out), SegmentHeader(chain_id="c" * 32, seq=seq, base_revision=10, start_revision=rev + 1,
                                                  prev_sha256=prev, start_time_ms=t, cluster_id=1, member_id=2,
                                                  endpoint="http://127.0.0.1:2379"))
        for r in (rev + 1, rev + 2):
            w.add_txn(Txn(r, t, (Event(PUT, f"/k/{r}".encode(), b"v", r, r, 1, 0),)))
        info = w.close(t + 1000, confirmed=True)
        made.append((os.path.basename(info.path), Path(info.path).read_bytes()))
        prev, rev, t = info.sha256, rev + 2, t + 2000
    return made


def _config_file(rgw: RgwBed, tmp_path: Path) -> Tuple[Config, str]:
    """A fresh bucket of the bed, the backup dir under tmp_path: the config and its file."""
    from tests.harness.rgw import rgw_config, rgw_config_text

    bucket, directory = rgw.new_bucket(), str(tmp_path / "backups")
    path = tmp_path / "agent.toml"
    path.write_text(rgw_config_text(rgw, bucket, backup_dir=directory, part_size_mb=5))
    path.chmod(0o600)
    return rgw_config(rgw, bucket, backup_dir=directory, part_size_mb=5), str(path)


def test_two_segments_swapped_in_the_bucket_are_refused_naming_the_segment(rgw: RgwBed, tmp_path: Path) -> None:
    """Each segment under the other's name with its own (right) sha256: the sha256 passes, the
    name lies about the revisions inside; nothing enters the backup dir under a lying name."""
    from tests.integration.test_restore import AGENT

    cfg, conf = _config_file(rgw, tmp_path)
    (a, a_bytes), (b, b_bytes), (c, c_bytes) = _chain(tmp_path, 3)
    _put(cfg, rgw, layout.full_name(KEY, NAME), os.urandom(1000))
    _put(cfg, rgw, layout.segment_name(KEY, a), a_bytes)
    _put(cfg, rgw, layout.segment_name(KEY, b), c_bytes)
    _put(cfg, rgw, layout.segment_name(KEY, c), b_bytes)
    res = subprocess.run([AGENT, "-c", conf, "backup", "fetch", "latest"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"{layout.segment_name(KEY, b)} in the bucket holds revisions" in res.stderr, res.stderr
    assert "renamed, or swapped with another segment" in res.stderr, res.stderr
    assert [n for n in _landed(cfg) if not n.startswith(".")] == [], _landed(cfg)
    assert not os.path.exists(os.path.join(cfg.backup.dir, fetch.STAGING)), "refused bytes kept to be continued"
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("etcd-agent: error: ")]
    assert len(errors) == 1 and res.stderr.rstrip("\n").endswith(errors[0]), res.stderr  # after the progress lines
    print(f"\nrefused (exit 3): {errors[0]}")


def test_objects_are_fetched_at_once(rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first GETs of a fetch are held until as many as the fetch runs at once have begun (a
    guard of GUARD s, not a timing assertion: one at a time, the first waits it out alone)."""
    from etcd_agent.bucket.staging import FETCH_WORKERS
    from etcd_agent.cli.main import main

    cfg, conf = _config_file(rgw, tmp_path)
    _put(cfg, rgw, layout.full_name(KEY, NAME), os.urandom(1000))
    for file, body in _chain(tmp_path, 2 * FETCH_WORKERS):
        _put(cfg, rgw, layout.segment_name(KEY, file), body)
    gate = threading.Condition()
    waiting, most = [0], [0]
    opened = threading.Event()

    def held(**_kwargs: Any) -> None:
        with gate:
            if opened.is_set():
                return
            waiting[0] += 1
            most[0] = max(most[0], waiting[0])
            gate.notify_all()
            gate.wait_for(lambda: waiting[0] >= FETCH_WORKERS, timeout=GUARD)
            opened.set()

    on_agent_clients(monkeypatch, "before-call.s3.GetObject", held)
    assert main(["-c", conf, "backup", "fetch", "latest"]) == 0
    assert most[0] == FETCH_WORKERS, f"{most[0]} GET(s) at once"
    assert len(_landed(cfg)) == 1 + 2 * FETCH_WORKERS, _landed(cfg)


def test_the_newest_checkpoints_the_retention_keeps_are_fetched(rgw: RgwBed, tmp_path: Path) -> None:
    """The bucket keeps every checkpoint of a chain until the chain goes; the backup dir keeps the
    newest ``checkpoint_keep`` (2): the older ones are listed as left in the bucket, not fetched."""
    from tests.integration.test_restore import AGENT

    cfg, conf = _config_file(rgw, tmp_path)
    _put(cfg, rgw, layout.full_name(KEY, NAME), os.urandom(1000))
    cps = [f"etcd-2026-03-01-1{i}-00-00.tar" for i in range(1, 4)]
    for cp in cps:
        _put(cfg, rgw, layout.checkpoint_name(KEY, cp), os.urandom(500))
    dry = subprocess.run([AGENT, "-c", conf, "backup", "fetch", "--dry-run", "latest"], capture_output=True,
                         text=True, timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "not fetched: 1 object(s)" in dry.stdout and "newest 2 checkpoint(s)" in dry.stdout, dry.stdout
    res = subprocess.run([AGENT, "-c", conf, "backup", "fetch", "latest"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _landed(cfg) == sorted([NAME] + cps[1:]), _landed(cfg)


@pytest.fixture
def small_backup_dir(tmp_path: Path) -> Any:
    """The backup dir on a 4 MiB tmpfs of its own: a filesystem a fetch can really fill."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "backups"
    mnt.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)], check=True, timeout=30)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=30)


def test_a_plan_that_does_not_fit_is_refused_before_anything_is_fetched(rgw: RgwBed, tmp_path: Path,
                                                                        small_backup_dir: Path) -> None:
    """Three objects of 1.5 MiB for a 4 MiB filesystem: each fits alone, so each one's own check
    passes while the others are still empty; staged at once they would fill the filesystem (the
    backup dir often shares it with etcd's data dir). The whole plan is weighed first: refused
    (exit 3), nothing staged, the filesystem as empty as before."""
    from tests.integration.test_restore import AGENT

    cfg, conf = _config_file(rgw, tmp_path)
    assert cfg.backup.dir == str(small_backup_dir)
    free = shutil.disk_usage(cfg.backup.dir).free
    _put(cfg, rgw, layout.full_name(KEY, NAME), os.urandom(1536 * 1024))
    for cp in ("etcd-2026-03-01-11-00-00.tar", "etcd-2026-03-01-12-00-00.tar"):
        _put(cfg, rgw, layout.checkpoint_name(KEY, cp), os.urandom(1536 * 1024))
    res = subprocess.run([AGENT, "-c", conf, "backup", "fetch", "latest"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "not enough space in" in res.stderr and "nothing fetched" in res.stderr, res.stderr
    assert [n for n in _landed(cfg) if not n.startswith(".")] == [], _landed(cfg)
    staging = os.path.join(cfg.backup.dir, fetch.STAGING)
    assert not os.path.isdir(staging) or not os.listdir(staging), os.listdir(staging)
    assert shutil.disk_usage(cfg.backup.dir).free >= free - 64 * 1024  # the lock files at most
    print(f"\nrefused (exit 3): {res.stderr.strip().splitlines()[-1]}")


def test_the_restore_s_dry_run_says_the_plan_does_not_fit(rgw: RgwBed, tmp_path: Path, small_backup_dir: Path) -> None:
    """`restore --from-bucket --dry-run` weighs the same plan against the same filesystem and says
    so (exit 3), before anyone runs the restore that would be refused."""
    from tests.integration.test_restore import AGENT

    cfg, conf = _config_file(rgw, tmp_path)
    _put(cfg, rgw, layout.full_name(KEY, NAME), os.urandom(5 * 1024 * 1024))
    res = subprocess.run([AGENT, "-c", conf, "restore", "--from-bucket", "latest", "--dry-run"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 3, res.stdout + res.stderr
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("room for the fetch in ")), "")
    assert f"{cfg.backup.dir}: FAILED: not enough space in {cfg.backup.dir}" in line, res.stdout
    assert "nothing fetched" in res.stdout, res.stdout
    assert [n for n in _landed(cfg) if not n.startswith(".")] == [], _landed(cfg)
    print(f"\n{line}")
