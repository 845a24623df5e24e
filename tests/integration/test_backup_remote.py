"""Off-host copies against a real S3 server: Ceph's RADOS Gateway on loopback (tests/harness/rgw.py)."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import stat
import tarfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from etcd_agent.bucket import client as remotebucket
from etcd_agent.bucket import remote, transfer
from etcd_agent.config import Config
from etcd_agent.errors import BackupCorrupt, BackupError, ConfigError
from tests.harness.rgw import RgwBed, remote_table, rgw_config

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


def remote_config(rgw: RgwBed) -> Config:
    """A config whose [backup.remote] is a fresh bucket of the bed (path style, 5 MiB parts)."""
    return rgw_config(rgw, rgw.new_bucket(), part_size_mb=5)


@pytest.fixture
def cfg(rgw: RgwBed) -> Config:
    return remote_config(rgw)


def _with(cfg: Config, **remote_fields: Any) -> Config:
    r = dataclasses.replace(cfg.backup.remote, **remote_fields)
    return dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, remote=r))


def _archive(directory: Path, name: str, size: int) -> Path:
    """A real tar holding ``size`` random bytes (the archive format itself is not under test)."""
    payload = directory / "etcd_snapshot.db"
    with open(payload, "wb") as fh:
        left = size
        while left > 0:
            fh.write(os.urandom(min(MiB, left)))
            left -= MiB
    path = directory / name
    with tarfile.open(path, "w") as tar:
        tar.add(str(payload), arcname="etcd_snapshot.db")
    payload.unlink()
    os.chmod(path, 0o600)
    return path


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(MiB), b""):
            h.update(chunk)
    return h.hexdigest()


def _tamper(cfg: Config, rgw: RgwBed, name: str, *, with_checksum: bool) -> None:
    """Overwrite the object with different bytes of the same size, keeping our sha256 metadata."""
    r = cfg.backup.remote
    raw = rgw.client()
    key = f"{_prefix(cfg)}{name}"
    head = raw.head_object(Bucket=r.bucket, Key=key)
    body = raw.get_object(Bucket=r.bucket, Key=key)["Body"].read()
    bad = bytes([body[0] ^ 0xFF]) + body[1:]
    extra: Dict[str, Any] = {"ChecksumAlgorithm": "SHA256"} if with_checksum else {}
    raw.put_object(Bucket=r.bucket, Key=key, Body=bad, Metadata=head["Metadata"], **extra)


def _prefix(cfg: Config) -> str:
    """The key prefix of this host's copies (the default one has a folder per master)."""
    return remotebucket.expand_prefix(cfg.backup.remote.prefix, cfg.cluster.name)


def _keys(cfg: Config, rgw: RgwBed) -> List[str]:
    resp = rgw.client().list_objects_v2(Bucket=cfg.backup.remote.bucket)
    return sorted(o["Key"] for o in resp.get("Contents", []))


@pytest.mark.parametrize("mode", ["auto", "etag", "download"])
@pytest.mark.parametrize("size", [300 * 1024, 11 * MiB], ids=["single-put", "multipart"])
def test_upload_list_verify_download(cfg: Config, rgw: RgwBed, tmp_path: Path, mode: str, size: int) -> None:
    cfg = _with(cfg, verify=mode)
    path = _archive(tmp_path, "etcd-2026-03-01-10-00-00.tar", size)
    obj = remote.upload_and_verify(cfg, str(path), {"revision": 42, "member": "m1", "cluster": {"name": "prod1", "id": "a1b2"}, "files": {"x": 1}})
    assert obj.name == path.name and obj.key == f"{_prefix(cfg)}{path.name}"
    assert obj.size == path.stat().st_size and obj.sha256 == _sha(path)
    assert obj.metadata["revision"] == "42" and obj.metadata["member"] == "m1"
    assert obj.metadata["cluster-id"] == "a1b2" and "files" not in obj.metadata
    if size > 5 * MiB:
        assert obj.etag.endswith("-3")  # really went up as 3 parts

    listed = remote.list_remote(cfg)
    assert [(o.name, o.size, o.sha256) for o in listed] == [(obj.name, obj.size, obj.sha256)]
    assert remote.verify_remote(cfg, obj.name).sha256 == obj.sha256

    dest = tmp_path / "restore"
    dest.mkdir()
    got = remote.download(cfg, obj.name, str(dest))
    assert got == str(dest / obj.name)
    assert _sha(Path(got)) == obj.sha256
    assert stat.S_IMODE(os.stat(got).st_mode) == 0o600
    assert os.listdir(dest) == [obj.name]


@pytest.mark.parametrize("mode", ["auto", "etag", "download"])
@pytest.mark.parametrize("with_checksum", [False, True], ids=["plain", "own-checksum"])
def test_copy_corrupted_before_verification_is_deleted(
    cfg: Config, rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, with_checksum: bool
) -> None:
    cfg = _with(cfg, verify=mode)
    path = _archive(tmp_path, "etcd-2026-03-01-11-00-00.tar", 11 * MiB)
    real_put = remote._put_file

    def put_then_tamper(*args: Any, **kwargs: Any) -> Any:
        sent = real_put(*args, **kwargs)  # the real upload, then a real overwrite on the server
        _tamper(cfg, rgw, path.name, with_checksum=with_checksum)
        return sent

    monkeypatch.setattr(remote, "_put_file", put_then_tamper)
    with pytest.raises(BackupCorrupt) as info:
        remote.upload_and_verify(cfg, str(path), {})
    assert "was deleted" in info.value.message
    assert info.value.details  # says what differed
    assert _keys(cfg, rgw) == []


def test_copy_corrupted_later_fails_verify_and_download(cfg: Config, rgw: RgwBed, tmp_path: Path) -> None:
    path = _archive(tmp_path, "etcd-2026-03-01-12-00-00.tar", 200 * 1024)
    remote.upload_and_verify(cfg, str(path), {})
    _tamper(cfg, rgw, path.name, with_checksum=False)
    with pytest.raises(BackupCorrupt) as info:
        remote.verify_remote(cfg, path.name)
    assert any("sha256" in d for d in info.value.details)
    dest = tmp_path / "restore"
    dest.mkdir()
    with pytest.raises(BackupCorrupt):
        remote.download(cfg, path.name, str(dest))
    assert os.listdir(dest) == []  # no partial or bad file left behind
    # verify only reports: the operator decides what to do with the bad copy
    assert len(_keys(cfg, rgw)) == 1


def test_prune_remote_with_reasons(
    cfg: Config, rgw: RgwBed, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _with(cfg, keep_last=2, keep_hourly=0, keep_daily=3)
    names = [
        "etcd-2026-03-01-01-00-00.tar",
        "etcd-2026-03-01-13-00-00.tar",
        "etcd-2026-03-02-02-00-00.tar",
        "etcd-2026-03-03-03-00-00.tar",
        "etcd-2026-03-03-15-00-00.tar",
        "etcd-2026-03-04-04-00-00.tar",
        "etcd-2026-03-04-16-00-00.tar",
    ]
    for n in names:
        remote.upload_and_verify(cfg, str(_archive(tmp_path, n, 1024)), {})
    # an object that is not a backup, under the same prefix: never touched
    rgw.client().put_object(Bucket=cfg.backup.remote.bucket, Key=f"{_prefix(cfg)}README.txt", Body=b"hi")
    assert [o.name for o in remote.list_remote(cfg)] == sorted(names, reverse=True)

    with caplog.at_level(logging.INFO, logger="etcd_agent.bucket.remote"):
        dry = remote.prune_remote(cfg, dry_run=True)
    kept = {d.name for d in dry if d.keep}
    assert kept == {
        "etcd-2026-03-04-16-00-00.tar",  # last 2 + newest of 03-04
        "etcd-2026-03-04-04-00-00.tar",  # last 2
        "etcd-2026-03-03-15-00-00.tar",  # newest of 03-03
        "etcd-2026-03-02-02-00-00.tar",  # newest of 03-02
    }
    assert all(d.reasons for d in dry)
    assert "would delete" in caplog.text and "etcd-2026-03-01-01-00-00.tar" in caplog.text
    assert len(_keys(cfg, rgw)) == len(names) + 1  # dry run deleted nothing

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="etcd_agent.bucket.remote"):
        real = remote.prune_remote(cfg, dry_run=False)
    assert [(d.name, d.keep) for d in real] == [(d.name, d.keep) for d in dry]
    assert {o.name for o in remote.list_remote(cfg)} == kept
    assert f"{_prefix(cfg)}README.txt" in _keys(cfg, rgw)
    deleted = [r for r in caplog.records if r.getMessage().startswith("deleted ")]
    assert len(deleted) == 3 and all(": " in r.getMessage() for r in deleted)


def test_credentials_never_logged_nor_shown(
    cfg: Config, rgw: RgwBed, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert rgw.access_key not in repr(cfg) and rgw.secret_key not in repr(cfg)
    assert rgw.access_key not in repr(cfg.backup.remote) and rgw.secret_key not in repr(cfg.backup.remote)
    path = _archive(tmp_path, "etcd-2026-03-05-00-00-00.tar", 6 * MiB)
    caplog.set_level(logging.DEBUG)  # root at DEBUG: botocore would log request headers
    obj = remote.upload_and_verify(cfg, str(path), {})
    remote.list_remote(cfg)
    remote.prune_remote(cfg, dry_run=True)
    remote.download(cfg, obj.name, str(tmp_path / "copy.tar"))
    with pytest.raises(BackupError) as info:
        remote.list_remote(_with(cfg, bucket="no-such-bucket-here"))
    assert "NoSuchBucket" in info.value.message
    text = caplog.text + info.value.message + repr(info.value.details)
    assert caplog.records and obj.name in caplog.text
    assert rgw.access_key not in text and rgw.secret_key not in text


def test_credentials_file(cfg: Config, rgw: RgwBed, tmp_path: Path) -> None:
    creds = tmp_path / "s3.ini"
    creds.write_text(f"[backup]\naws_access_key_id = {rgw.access_key}\naws_secret_access_key = {rgw.secret_key}\n")
    os.chmod(creds, 0o644)
    fcfg = _with(cfg, access_key=None, secret_key=None, credentials_file=str(creds), credentials_profile="backup")
    with pytest.raises(ConfigError) as info:
        remote.list_remote(fcfg)
    assert "0644" in info.value.message and rgw.secret_key not in info.value.message
    os.chmod(creds, 0o600)

    # the keys from the file are the ones that sign the requests
    b = remotebucket.Bucket(fcfg)
    seen: List[str] = []
    b.client.meta.events.register("before-send.s3", lambda request, **_: seen.append(request.headers["Authorization"].decode()))
    b.client.list_objects_v2(Bucket=fcfg.backup.remote.bucket)
    assert seen and f"Credential={rgw.access_key}/" in seen[0]

    creds.write_text("[other]\naws_access_key_id = x\n")
    with pytest.raises(ConfigError, match=r"no \[backup\] profile"):
        remote.list_remote(fcfg)


def test_big_upload_memory_stays_flat(cfg: Config, rgw: RgwBed, tmp_path: Path) -> None:
    import psutil

    proc = psutil.Process()
    # warm up every code path (imports, client, multipart) before taking the baseline
    remote.upload_and_verify(cfg, str(_archive(tmp_path, "etcd-2026-03-06-00-00-00.tar", 11 * MiB)), {})
    big = _archive(tmp_path, "etcd-2026-03-06-01-00-00.tar", 80 * MiB)
    baseline = proc.memory_info().rss
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        obj = remote.upload_and_verify(cfg, str(big), {})
    finally:
        done.set()
        sampler.join(timeout=5)
    growth = peak - baseline
    parts = -(-big.stat().st_size // (5 * MiB))  # 80 MiB plus tar headers: 17 parts
    print(f"80 MiB upload in {parts} parts: RSS growth {growth / MiB:.1f} MiB")
    assert obj.etag.endswith(f"-{parts}")
    # the whole file would be 80 MiB; parts of 5 MiB, WORKERS sent at once while the next is
    # read, keep the growth to a few parts
    assert growth < (transfer.WORKERS + 2) * 5 * MiB, f"RSS grew by {growth / MiB:.1f} MiB"


def test_backup_command_uploads_prunes_and_records_metrics(cluster_factory: Any, rgw: RgwBed, tmp_path: Path) -> None:
    """End to end on a real etcd: `etcd-agent backup` writes, uploads, verifies, prunes the
    remote copies and records the remote success in the textfile metrics."""
    import subprocess
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    bucket = rgw.new_bucket()
    prom = tmp_path / "etcd_agent_backup.prom"
    extra = f'metrics_file = "{prom}"\n' + remote_table(rgw, bucket, keep_last=1, keep_daily=0)
    c = cluster_factory(1, extra=extra)
    c.start_static()
    base = [sys.executable, "-m", "etcd_agent.cli.main", "-c", c.config_path]
    for _ in range(2):
        res = subprocess.run(base + ["backup", "--member", "m1"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert rgw.secret_key not in res.stderr and rgw.access_key not in res.stderr
        time.sleep(1.1)  # backup names have one-second resolution
    res = subprocess.run(base + ["--json", "backup", "list", "--remote"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    import json

    listed = json.loads(res.stdout)["backups"]
    assert len(listed) == 1, "remote retention keep_last=1 was not applied after the upload"
    assert listed[0]["sha256"]
    values = {s.name: s.value for f in text_string_to_metric_families(prom.read_text()) for s in f.samples}
    assert values["etcd_agent_backup_remote_last_success_timestamp_seconds"] > time.time() - 300
    assert values["etcd_agent_backup_last_success_timestamp_seconds"] > time.time() - 300
