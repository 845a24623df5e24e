"""What a real S3 server does that the off-host copies must survive (Ceph RGW 16.2, issues 33
item 5 and 39): multipart ETags, listings paged at 1000 keys, path-style and virtual-hosted
addressing, flexible checksums it ignores, error bodies without a Message.

A test that shows a product defect the issues name is a strict xfail naming the issue: it turns
into a failure (XPASS) the day the defect is fixed, and the xfail goes with the fix."""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, List
from urllib.parse import urlsplit

import pytest
from botocore.exceptions import ClientError

from etcd_agent.backup.archive import parse_name
from etcd_agent.bucket import offsite, remote
from etcd_agent.bucket.client import Bucket
from etcd_agent.chain.segments import segment_name
from etcd_agent.config import Config
from etcd_agent.errors import BackupError
from tests.harness.rgw import RgwBed, remote_table
from tests.integration.test_backup_remote import MiB, _archive, _prefix, _sha, _with, remote_config

pytestmark = pytest.mark.integration


@pytest.fixture
def cfg(rgw: RgwBed) -> Config:
    return remote_config(rgw)


# ------------------------------------------------------------------ multipart and its ETag

@pytest.mark.parametrize("verify", ["etag", "download"])
def test_multipart_full_backup_etag_is_the_md5_of_its_part_md5s(
    cfg: Config, rgw: RgwBed, tmp_path: Path, verify: str
) -> None:
    """A full backup larger than the part size goes up in parts; the store's ETag is the one AWS
    computes (md5 of the parts' md5s, "-N"), which `verify = "etag"` relies on."""
    cfg = _with(cfg, verify=verify, part_size_mb=5)
    path = _archive(tmp_path, "etcd-2026-04-01-10-00-00.tar", 12 * MiB)
    size = path.stat().st_size
    part_md5s = []
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(5 * MiB), b""):
            part_md5s.append(hashlib.md5(chunk).digest())
    expected = f"{hashlib.md5(b''.join(part_md5s)).hexdigest()}-{len(part_md5s)}"
    assert len(part_md5s) == 3

    obj = remote.upload_and_verify(cfg, str(path), {})
    head = rgw.client().head_object(Bucket=cfg.backup.remote.bucket, Key=obj.key)
    assert head["ETag"].strip('"') == expected
    assert obj.etag == expected and obj.size == size and obj.sha256 == _sha(path)
    got = remote.download(cfg, obj.name, str(tmp_path / "back.tar"))
    assert _sha(Path(got)) == obj.sha256


def test_rgw_ignores_flexible_checksums_but_enforces_content_md5(rgw: RgwBed) -> None:
    """The store's behaviour the product's verification must not rely on (the premise of the
    xfail below): a wrong x-amz-checksum-sha256 is accepted and never returned; a wrong
    Content-MD5 is refused."""
    s3, bucket = rgw.client(), rgw.new_bucket()
    body = b"segment bytes"
    wrong = base64.b64encode(hashlib.sha256(b"other bytes").digest()).decode()
    s3.put_object(Bucket=bucket, Key="k", Body=body, ChecksumSHA256=wrong)
    head = s3.head_object(Bucket=bucket, Key="k", ChecksumMode="ENABLED")
    assert "ChecksumSHA256" not in head
    bad_md5 = base64.b64encode(hashlib.md5(b"other bytes").digest()).decode()
    with pytest.raises(ClientError) as info:
        s3.put_object(Bucket=bucket, Key="k2", Body=body, ContentMD5=bad_md5)
    assert info.value.response["Error"]["Code"] == "BadDigest"


def test_verify_checksum_logs_the_check_that_really_ran(
    cfg: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """verify = "checksum" on a store that ignores the checksums is refused (never logged as done);
    "auto" logs the check that really ran on RGW: Content-MD5 of every part and the ETag."""
    path = _archive(tmp_path, "etcd-2026-04-01-11-00-00.tar", 6 * MiB)
    with pytest.raises(BackupError) as info:
        remote.upload_and_verify(_with(cfg, verify="checksum"), str(path), {})
    assert "accepts a wrong x-amz-checksum-sha256" in info.value.message
    with caplog.at_level(logging.INFO, logger="etcd_agent.bucket.remote"):
        remote.upload_and_verify(_with(cfg, verify="auto"), str(path), {})
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("copied "))
    assert "verified by etag" in line and "verified by checksum" not in line, line


# ------------------------------------------------------------------ listings paged at 1000 keys

def test_listings_page_over_more_than_1000_segments_and_backups(
    cfg: Config, rgw: RgwBed
) -> None:
    """1,100 segments of one chain and 1,005 full backups under one prefix: every one is listed
    (the store returns at most 1000 keys a page; with a delimiter the chain's folder counts too)."""
    s3, bucket, prefix = rgw.client(), cfg.backup.remote.bucket, _prefix(cfg)
    base = 4242
    segs = [f"delta-{base:016d}/{segment_name(base + 10 * i + 1, base + 10 * i + 10, 1_775_000_000_000 + i)}"
            for i in range(1100)]
    backups = [f"etcd-2026-05-{1 + i // 86400 % 28:02d}-{i // 3600 % 24:02d}-{i // 60 % 60:02d}-{i % 60:02d}.tar"
               for i in range(1005)]
    assert len(set(backups)) == 1005

    def put(name: str) -> None:
        s3.put_object(Bucket=bucket, Key=prefix + name, Body=b"x", Metadata={"sha256": hashlib.sha256(b"x").hexdigest()})

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, segs + backups))

    # segments under delta-<rev>/ are the legacy layout: listed apart from chains/<key>/
    assert offsite.remote_chains(cfg) == ({}, {base: sorted(segs)})
    listed = remote.list_remote(cfg)
    assert sorted(o.name for o in listed) == sorted(backups)
    decisions = offsite.prune_remote_chains(cfg, set(), {base}, dry_run=True)
    assert [d.name for d in decisions] == [f"legacy remote delta chain after revision {base} (1100 segment(s))"]


# ------------------------------------------------------------------ addressing styles and errors

def _host_endpoint(rgw: RgwBed) -> str:
    """The bed's endpoint by host name (botocore uses path style for any IP endpoint, whatever
    the setting: only a name shows what a style does)."""
    assert rgw.addr == "127.0.0.1"
    return f"http://localhost:{rgw.port}"


@pytest.mark.parametrize("endpoint", ["ip", "name"])
def test_path_style_addressing_works_with_an_ip_or_a_host_name(
    cfg: Config, rgw: RgwBed, tmp_path: Path, endpoint: str
) -> None:
    cfg = _with(cfg, addressing_style="path", endpoint=rgw.endpoint if endpoint == "ip" else _host_endpoint(rgw))
    path = _archive(tmp_path, "etcd-2026-04-02-10-00-00.tar", 64 * 1024)
    sent: List[str] = []
    b = Bucket(cfg)
    b.client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
    obj = remote.upload_and_verify(cfg, str(path), {})
    assert [o.name for o in remote.list_remote(cfg)] == [obj.name]
    # the bucket is in the path, never in the host name
    probe = b.client.list_objects_v2(Bucket=b.bucket)
    url = urlsplit(sent[-1])
    assert probe["Contents"] and url.netloc == urlsplit(cfg.backup.remote.endpoint).netloc
    assert url.path.split("/")[1] == b.bucket


def test_virtual_style_with_an_ip_endpoint_falls_back_to_path_style(
    cfg: Config, tmp_path: Path
) -> None:
    """botocore cannot put a bucket in front of an IP: it silently uses path style, so the copy works."""
    cfg = _with(cfg, addressing_style="virtual")
    obj = remote.upload_and_verify(cfg, str(_archive(tmp_path, "etcd-2026-04-02-11-00-00.tar", 64 * 1024)), {})
    assert [o.name for o in remote.list_remote(cfg)] == [obj.name]


def test_virtual_style_on_a_host_name_that_fails_suggests_path_style(
    cfg: Config, rgw: RgwBed
) -> None:
    cfg = _with(cfg, addressing_style="virtual", endpoint=_host_endpoint(rgw), connect_timeout=2.0, read_timeout=5.0)
    with pytest.raises(BackupError) as info:
        remote.list_remote(cfg)
    assert 'addressing_style = "path"' in info.value.message, info.value.message


def test_an_error_without_a_message_names_the_status_and_the_code(cfg: Config) -> None:
    with pytest.raises(BackupError) as info:
        remote.list_remote(_with(cfg, bucket="no-such-bucket-" + os.urandom(4).hex()))
    message = info.value.message
    assert "NoSuchBucket" in message
    assert "None" not in message and "404" in message, message


def test_a_real_full_backup_larger_than_the_part_size_lands_with_the_multipart_etag(
    cluster_factory: Any, rgw: RgwBed
) -> None:
    """`etcd-agent backup` of an etcd whose snapshot is larger than two parts: the object in the
    bucket is the local archive byte for byte (sha256 metadata, size) and its ETag is the one
    the parts make (md5 of the part md5s, "-N")."""
    bucket = rgw.new_bucket()
    extra = remote_table(rgw, bucket, part_size_mb=5, verify="etag")
    c = cluster_factory(1, extra=extra)
    c.start_static()
    client = c.client(timeout=30)
    try:
        for i in range(120):  # ~12 MiB of values: the snapshot and its archive span three parts
            client.put(f"/big/{i:04d}", os.urandom(100 * 1024))
    finally:
        client.close()
    res = subprocess.run([sys.executable, "-m", "etcd_agent.cli.main", "-c", c.config_path, "backup", "--member", "m1"],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    local = [p for p in Path(c.cfg.backup.dir).iterdir() if parse_name(p.name)]
    assert len(local) == 1, local
    archive = local[0]
    size = archive.stat().st_size
    assert size > 10 * MiB
    md5s = []
    with open(archive, "rb") as fh:
        for chunk in iter(lambda: fh.read(5 * MiB), b""):
            md5s.append(hashlib.md5(chunk).digest())
    # the copy lands under its chain: chains/<sha256 of the snapshot>/<name>
    (key,) = [o["Key"] for o in rgw.client().list_objects_v2(Bucket=bucket).get("Contents", [])
              if o["Key"].endswith("/" + archive.name) and "/chains/" in "/" + o["Key"]]
    head = rgw.client().head_object(Bucket=bucket, Key=key)
    assert head["ContentLength"] == size
    assert head["Metadata"]["sha256"] == _sha(archive)
    assert head["ETag"].strip('"') == f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"
    print(f"\nFIGURE multipart: {size} bytes in {len(md5s)} parts, ETag {head['ETag']}")
