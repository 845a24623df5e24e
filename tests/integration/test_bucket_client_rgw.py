"""The S3 client against a real S3 server (Ceph RGW 16, ``rgw`` fixture): bounded waits on a hung
gateway, checks that say what they proved, and reads from the bucket bounded in size (issue 39
items 2-3, issue 35 item 3)."""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, List

import pytest

from etcd_agent.bucket import client as remotebucket
from etcd_agent.bucket import remote
from etcd_agent.config import Config
from etcd_agent.errors import BackupCorrupt, BackupError
from tests.harness.rgw import TomlValue, rgw_config, rgw_config_text
from tests.integration.test_backup_remote import _archive

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
# a guard, not a timing assertion: a call that hangs past it fails the test instead of the run
GUARD = 120.0


def _config(rgw: Any, bucket: str, **keys: TomlValue) -> str:
    return rgw_config_text(rgw, bucket, prefix="p/", part_size_mb=5, **keys)


def _cfg(rgw: Any, bucket: str, **keys: TomlValue) -> Config:
    return rgw_config(rgw, bucket, prefix="p/", part_size_mb=5, **keys)


def _keys(rgw: Any, bucket: str) -> List[str]:
    return sorted(o["Key"] for o in rgw.client().list_objects_v2(Bucket=bucket).get("Contents", []))


def _in_thread(fn: Any) -> Any:
    """Run ``fn`` with a guard: the test fails (instead of hanging the run) if it never returns."""
    out: List[Any] = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(GUARD)
    assert out, f"still waiting after {GUARD} s"
    return out[0]


# ------------------------------------------------------------------ item 2: bounded waits


def test_a_hung_gateway_fails_a_listing_in_one_sentence(rgw: Any) -> None:
    cfg = _cfg(rgw, rgw.new_bucket(), connect_timeout=1, read_timeout=1, max_attempts=2)
    rgw.pause()
    try:
        kind, exc = _in_thread(lambda: remote.list_remote(cfg))
    finally:
        rgw.resume()
    assert kind == "raised" and isinstance(exc, BackupError), exc
    assert "did not answer within 1 s, 2 attempt(s)" in exc.message, exc.message
    assert "\n" not in exc.message and rgw.endpoint in exc.message


def test_the_deadline_ends_the_retries_of_one_object(rgw: Any, tmp_path: Path) -> None:
    """Ten attempts of 1 s each are allowed, the object's deadline (2 s plus 1 s a MiB) ends them
    first; the multipart upload that hung is not waited on again to be aborted."""
    bucket = rgw.new_bucket()
    cfg = _cfg(rgw, bucket, read_timeout=1, max_attempts=10, deadline=2, verify="etag")
    path = _archive(tmp_path, "etcd-2026-03-01-10-00-00.tar", 1024)
    rgw.pause()
    try:
        kind, exc = _in_thread(lambda: remote.upload_and_verify(cfg, str(path), {}))
    finally:
        rgw.resume()
    assert kind == "raised" and isinstance(exc, BackupError), exc
    assert "gave up after the object's deadline ([backup.remote] deadline = 2 s" in exc.message, exc.message


def test_a_hung_gateway_fails_the_cli_in_one_sentence(rgw: Any, tmp_path: Path) -> None:
    conf = tmp_path / "agent.toml"
    conf.write_text(_config(rgw, rgw.new_bucket(), connect_timeout=1, read_timeout=1, max_attempts=2))
    conf.chmod(0o600)
    rgw.pause()
    try:
        res = subprocess.run([sys.executable, "-m", "etcd_agent.cli.main", "-c", str(conf), "backup", "list",
                              "--remote"], capture_output=True, text=True, timeout=GUARD)
    finally:
        rgw.resume()
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "did not answer within 1 s" in lines[0], res.stderr
    assert "Traceback" not in res.stderr


# ------------------------------------------------------------------ item 3: checks that say what they proved


def test_rgw_is_probed_and_copies_are_verified_by_what_it_enforces(
    rgw: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RGW 16 accepts a wrong x-amz-checksum-sha256 and refuses a wrong Content-MD5: auto verifies
    by Content-MD5 and the ETag, and says so; never "verified by checksum"."""
    bucket = rgw.new_bucket()
    cfg = _cfg(rgw, bucket)
    assert cfg.backup.remote.verify == "auto"  # the default
    b = remotebucket.Bucket(cfg)
    found = remotebucket.probe(b)
    assert found == remotebucket.Integrity(sha256_enforced=False, sha256_returned=False, md5_enforced=True)
    assert remotebucket.probe(b) is found  # once per endpoint and bucket
    assert _keys(rgw, bucket) == []  # the probe objects are gone

    caplog.set_level(logging.INFO, logger="etcd_agent")
    for name, size in (("etcd-2026-03-01-10-00-00.tar", 100 * 1024), ("etcd-2026-03-01-11-00-00.tar", 11 * MiB)):
        path = _archive(tmp_path, name, size)
        obj = remote.upload_and_verify(cfg, str(path), {})
        assert obj.verified_by == "etag" and obj.to_json()["verified_by"] == "etag"
        # and back, If-Match the ETag HEAD saw, sha256 checked
        assert remote.verify_remote(cfg, name).sha256 == obj.sha256
        got = remote.download(cfg, name, str(tmp_path / f"back-{name}"))
        assert Path(got).read_bytes() == path.read_bytes()
    assert "verified by etag (Content-MD5 of every part" in caplog.text
    assert "verified by checksum" not in caplog.text


def test_verify_checksum_on_a_store_that_ignores_checksums_is_refused(rgw: Any, tmp_path: Path) -> None:
    bucket = rgw.new_bucket()
    cfg = _cfg(rgw, bucket, verify="checksum")
    path = _archive(tmp_path, "etcd-2026-03-01-12-00-00.tar", 100 * 1024)
    with pytest.raises(BackupError) as info:
        remote.upload_and_verify(cfg, str(path), {})
    assert "accepts a wrong x-amz-checksum-sha256" in info.value.message
    assert 'set verify = "auto"' in info.value.message
    assert _keys(rgw, bucket) == []  # nothing claimed, nothing copied


def test_download_verify_reads_back_only_when_asked(rgw: Any, tmp_path: Path) -> None:
    bucket = rgw.new_bucket()
    cfg = _cfg(rgw, bucket, verify="download")
    obj = remote.upload_and_verify(cfg, str(_archive(tmp_path, "etcd-2026-03-01-13-00-00.tar", 64 * 1024)), {})
    assert obj.verified_by == "read-back"


# item 4's errors (status and code, the addressing hint): test_bucket_realstore.py


# ------------------------------------------------------------------ issue 35 item 3: reads bounded in size


def _put_copy(rgw: Any, cfg: Config, name: str, body: bytes, sha: str) -> None:
    rgw.client().put_object(Bucket=cfg.backup.remote.bucket, Key=f"p/{name}", Body=body, Metadata={"sha256": sha})


def _download_refused(cfg: Config, name: str, tmp_path: Path) -> str:
    """The download's refusal; nothing (not a partial file) is left in its destination."""
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(BackupCorrupt) as info:
        remote.download(cfg, name, str(dest))
    assert os.listdir(dest) == []
    return info.value.message


def test_a_copy_claiming_too_much_is_refused_before_a_byte_is_written(
    rgw: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(rgw, rgw.new_bucket())
    name = "etcd-2026-03-01-14-00-00.tar"
    _put_copy(rgw, cfg, name, b"x" * 4096, "0" * 64)
    monkeypatch.setattr(remote, "MAX_OBJECT_BYTES", 1024)  # the real bound is 64 GiB
    assert "claims 4096 bytes, more than any backup" in _download_refused(cfg, name, tmp_path)
    with pytest.raises(BackupCorrupt):
        remote.verify_remote(cfg, name)


def test_a_body_longer_than_its_claim_is_cut_off(rgw: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The object grows between HEAD and GET (another writer): not a byte past the claim is written."""
    cfg = _cfg(rgw, rgw.new_bucket())
    name = "etcd-2026-03-01-15-00-00.tar"
    _put_copy(rgw, cfg, name, b"a" * 1000, "0" * 64)
    real_head = remote._head

    def head_then_grow(b: Any, n: str) -> Any:
        obj = real_head(b, n)
        _put_copy(rgw, cfg, name, b"b" * (3 * MiB), "0" * 64)
        return dataclasses.replace(obj, etag="")  # no If-Match: the GET sees the grown object

    monkeypatch.setattr(remote, "_head", head_then_grow)
    assert "sent more than the 1000 bytes it claims" in _download_refused(cfg, name, tmp_path)


def test_a_listing_is_bounded(rgw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(rgw, rgw.new_bucket())
    for i in range(4):
        _put_copy(rgw, cfg, f"etcd-2026-03-01-16-00-0{i}.tar", b"x", "0" * 64)
    monkeypatch.setattr(remote, "MAX_LISTED", 3)
    with pytest.raises(BackupError) as info:
        remote.list_remote(cfg)
    assert "more than 3 objects under it" in info.value.message
