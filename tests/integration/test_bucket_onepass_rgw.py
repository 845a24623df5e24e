"""An upload without the archive's digest, on a real S3 server (Ceph RGW): one read of the file,
the parts hashed as they are sent, the sha256 metadata set afterwards by a server-side copy of
the object onto itself (issue 39 item 5). An object is never taken as landed before its sha256
is set: a copy cut between the upload and the metadata leaves an object the queue copies again
and a fetch refuses. A store that refuses the self-copy, or an object above the 5 GiB a copy
takes, goes the two-pass way (hash first, then send), logged as such. A file that changes under
the upload is refused as before."""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Callable, List, Optional

import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.bucket import copier, digests, fetch, layout, queue, remote, transfer
from etcd_agent.bucket.client import Bucket
from etcd_agent.errors import BackupCorrupt, BackupError
from etcd_agent.fs import open_regular
from tests.harness.rgw import RgwBed, on_agent_clients, remote_table
from tests.integration.test_backup_remote import remote_config
from tests.integration.test_bucket_transfer import _file

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
NAME = "etcd-2026-03-01-10-00-00.tar"


def count_opens(monkeypatch: pytest.MonkeyPatch, path: str) -> List[str]:
    """Every open of ``path`` by the copy's modules (the queue's digest, the upload): a list that grows."""
    reads: List[str] = []
    for module in (digests, remote, transfer):
        real = module.open_regular

        def counted(p: str, *a: Any, real: Any = real, **kw: Any) -> Any:
            if p == path:
                reads.append(p)
            return real(p, *a, **kw)
        monkeypatch.setattr(module, "open_regular", counted)
    return reads


def on_copy(monkeypatch: pytest.MonkeyPatch, handler: Callable[..., Any]) -> List[str]:
    """``handler`` on every CopyObject of the clients made from now on (botocore's before-call:
    what it returns, if anything, is the response); the list of the copies' destination keys."""
    seen: List[str] = []
    on_agent_clients(monkeypatch, "before-parameter-build.s3.CopyObject",
                     lambda params, **_: seen.append(params["Key"]))
    on_agent_clients(monkeypatch, "before-call.s3.CopyObject", handler)
    return seen


def refuse(**_: Any) -> Any:
    """A store without server-side copies: 501 NotImplemented, no request sent."""
    from botocore.awsrequest import AWSResponse, HTTPHeaders

    return (AWSResponse("", 501, HTTPHeaders(), None),
            {"Error": {"Code": "NotImplemented", "Message": ""}, "ResponseMetadata": {"HTTPStatusCode": 501}})


def test_an_upload_without_a_digest_reads_the_file_once_and_lands_with_its_sha256(
        rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = remote_config(rgw)  # 5 MiB parts: 23 MiB go as 5 parts
    path = tmp_path / NAME
    size = 23 * MiB + 17
    sha = _file(path, size)
    reads = count_opens(monkeypatch, str(path))
    copies = on_copy(monkeypatch, lambda **_: None)
    obj = remote.upload_file(cfg, str(path), NAME, lambda s: {"sha256": s, "revision": "7"})
    assert len(reads) == 1, reads  # no hashing pass before the upload
    assert (obj.sha256, obj.size, obj.verified_by) == (sha, size, "etag") and obj.etag.endswith("-5"), obj
    assert copies == [obj.key]  # the metadata set by one copy onto itself
    s3 = rgw.client()
    head = s3.head_object(Bucket=cfg.backup.remote.bucket, Key=obj.key)
    assert head["Metadata"] == {"sha256": sha, "revision": "7"}  # the other fields kept
    got = s3.get_object(Bucket=cfg.backup.remote.bucket, Key=obj.key)["Body"].read()
    assert hashlib.sha256(got).hexdigest() == sha


def test_an_upload_cut_before_its_sha256_is_set_is_copied_again_and_never_fetched(
        cluster_factory: Any, rgw: RgwBed, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The store goes down right after the upload completed, before the copy that sets the
    sha256: the copy fails, the object there carries no sha256, so the queue still finds the
    backup pending, a fetch refuses the object, and the next pass copies it; then nothing is
    pending any more (the object's ETag is the same, its metadata is not)."""
    bucket = rgw.new_bucket()
    c = cluster_factory(1, extra=remote_table(rgw, bucket, prefix="p/", part_size_mb=5, max_attempts=1))
    c.start_static()
    for i in range(7):  # a backup of several parts
        c.client().put(f"k{i}", os.urandom(1 << 20))
    daemon = take_backup(c.cfg, member="m1", origin="daemon")
    caches = queue.Caches()
    copies = on_copy(monkeypatch, lambda **_: None if copies[1:] else rgw.stop_gateway())  # the first copy only
    reads = count_opens(monkeypatch, daemon.path)
    first = copier.push(c.cfg, caches)
    assert not first.copied and "cannot set the sha256 metadata" in first.error, first
    assert len(reads) == 1, reads  # a fresh backup the bucket lacks: read once by its copy
    rgw.start_gateway()
    (f,) = first.plan.pending
    assert f.path == daemon.path and copies == ["p/" + f.name], copies
    head = rgw.client().head_object(Bucket=bucket, Key="p/" + f.name)
    assert "sha256" not in head["Metadata"] and head["ContentLength"] == f.size
    assert head["Metadata"]["revision"] == str(f.manifest["revision"])  # what it is, said

    assert [g.path for g in copier.pending(c.cfg, caches).pending] == [daemon.path], "the queue takes it as lacking"
    with fetch.staging_locked(str(tmp_path / "fetched")), pytest.raises(BackupCorrupt,
                                                                       match="carries no sha256 metadata"):
        fetch.fetch_one(Bucket(c.cfg), fetch.Wanted(f.name, f.file, layout.FULL, f.size), str(tmp_path / "fetched"))

    second = copier.push(c.cfg, caches)
    assert not second.error and [g.path for g in second.copied] == [daemon.path], second
    head = rgw.client().head_object(Bucket=bucket, Key="p/" + f.name)
    assert head["Metadata"]["sha256"] == queue.file_sha256(daemon.path)
    assert copier.pending(c.cfg, caches).pending == (), "landed: not copied again and again"


@pytest.mark.parametrize("why", ["refused", "above-copy-limit"])
def test_without_a_self_copy_the_upload_hashes_first_and_says_so(
        rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        why: str) -> None:
    """A store that refuses the copy (501 here): the object is sent again with the digest its
    first pass computed, and the refusal is remembered for the endpoint, so the next upload hashes
    first (two passes). An object larger than a copy takes (the limit lowered here) goes two
    passes at once. The log says which and why."""
    cfg = remote_config(rgw)
    path = tmp_path / NAME
    sha = _file(path, 23 * MiB)
    if why == "refused":
        copies = on_copy(monkeypatch, refuse)
    else:
        monkeypatch.setattr(remote, "MAX_SELF_COPY", 20 * MiB)
        copies = on_copy(monkeypatch, lambda **_: None)
    reads = count_opens(monkeypatch, str(path))
    with caplog.at_level(logging.INFO, logger="etcd_agent.bucket.remote"):
        for name in ("a/" + NAME, "b/" + NAME):
            obj = remote.upload_file(cfg, str(path), name)
            assert (obj.sha256, obj.verified_by) == (sha, "etag"), obj
    said = [r.getMessage() for r in caplog.records if "two passes" in r.getMessage()]
    if why == "refused":
        assert len(copies) == 1, copies  # tried once for the endpoint
        assert len(reads) == 2 + 2, reads  # the first: one pass, refused, sent again; the next: hashed, sent
        assert "HTTP 501 NotImplemented" in said[0] and len(said) == 2, said
    else:
        assert copies == [] and len(reads) == 4, (copies, reads)
        assert len(said) == 2 and "larger than the 20971520 bytes" in said[0], said


class _ChangingFile:
    """The upload's file object; after its first part is read, the file changes under it
    through another descriptor (``change``), its mtime put back as it was."""

    def __init__(self, fh: Any, path: str, change: str) -> None:
        self.fh, self.path, self.change = fh, path, change
        self.done = False

    def readinto(self, buf: Any) -> Optional[int]:
        n: Optional[int] = self.fh.readinto(buf)
        if not self.done:
            self.done = True
            st = os.stat(self.path)
            with open(self.path, "r+b") as other:
                if self.change == "truncated":
                    other.truncate(7 * MiB)
                else:
                    other.seek(17 * MiB)
                    other.write(b"\x00" * 16)
            os.utime(self.path, ns=(st.st_atime_ns, st.st_mtime_ns))
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fh, name)

    def __enter__(self) -> "_ChangingFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fh.close()


@pytest.mark.parametrize("change", ["overwritten", "truncated"])
def test_a_file_changing_under_the_upload_is_never_copied(
        rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    cfg = remote_config(rgw)
    path = tmp_path / NAME
    _file(path, 23 * MiB)
    monkeypatch.setattr(transfer, "open_regular", lambda p, *a, **kw: _ChangingFile(open_regular(p, *a, **kw), p, change))
    with pytest.raises(BackupCorrupt) as info:
        remote.upload_file(cfg, str(path), NAME)
    assert ("shrank while it was copied (part 2 of 5" if change == "truncated"
            else "changed while it was copied") in info.value.message, info.value.message
    s3 = rgw.client()
    bucket = cfg.backup.remote.bucket
    assert not s3.list_objects_v2(Bucket=bucket).get("Contents")
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")  # aborted: no orphaned parts
    with pytest.raises(BackupError):
        remote.head_sha256(cfg, NAME)
