"""The bytes of a copy to and from a real S3 server (Ceph RGW), several requests at once
(bucket/transfer.py): an upload checks the bytes it sends against the sha256 it was named by, a
large download comes as ranges written in order, so a run stopped halfway (the gateway stopped, a
range's connection ended mid-body, the disk full) leaves a part the next one continues."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import pytest

from etcd_agent.bucket import fetch, layout, remote, transfer
from etcd_agent.bucket.client import Bucket
from etcd_agent.config import Config
from etcd_agent.errors import BackupCorrupt, BackupError, OperationFailed
from etcd_agent.waiting import NotYet, poll
from tests.harness.rgw import RgwBed, on_agent_clients
from tests.integration.test_backup_fetch import small_backup_dir  # noqa: F401  # a fixture
from tests.integration.test_backup_remote import _with, remote_config

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
NAME = "etcd-2026-03-01-10-00-00.tar"
KEY = "cd" * 32
GUARD = 10.0  # seconds a range's hash waits to see its write begin: a guard, not a timing assertion


def _file(path: Path, size: int) -> str:
    body = os.urandom(size)
    path.write_bytes(body)
    return hashlib.sha256(body).hexdigest()


def _objects(cfg: Config, rgw: RgwBed) -> Tuple[List[str], List[str]]:
    """The keys in the test's bucket, and the multipart uploads left in it."""
    s3 = rgw.client()
    bucket = cfg.backup.remote.bucket
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    uploads = [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    return keys, uploads


@pytest.mark.parametrize("size", [300 * 1024, 23 * MiB], ids=["single-put", "multipart"])
def test_an_upload_named_by_a_sha256_its_bytes_do_not_hash_to_is_refused_and_leaves_nothing(
        rgw: RgwBed, tmp_path: Path, size: int) -> None:
    cfg = remote_config(rgw)  # 5 MiB parts: 23 MiB go as 5 parts, 4 at once
    path = tmp_path / NAME
    right = _file(path, size)
    wrong = hashlib.sha256(b"another archive").hexdigest()
    with pytest.raises(BackupCorrupt) as info:
        remote.upload_file(cfg, str(path), NAME, sha256=wrong)
    assert f"changed while it was copied: its bytes hash to {right}, not to the {wrong}" in info.value.message
    assert _objects(cfg, rgw) == ([], [])  # no object, no orphaned parts


def test_an_upload_named_by_its_sha256_lands_whole_with_its_metadata_and_progress(
        rgw: RgwBed, tmp_path: Path) -> None:
    cfg = remote_config(rgw)
    path = tmp_path / NAME
    size = 23 * MiB + 17
    sha = _file(path, size)
    seen: List[Tuple[int, int]] = []
    obj = remote.upload_file(cfg, str(path), NAME, sha256=sha, progress=lambda done, total: seen.append((done, total)))
    assert obj.sha256 == sha and obj.size == size and obj.etag.endswith("-5")
    assert obj.verified_by == "etag"  # RGW: Content-MD5 of every part and the multipart ETag
    assert sorted(seen) == seen and seen[-1] == (size, size) and len(seen) == 5
    got = rgw.client().get_object(Bucket=cfg.backup.remote.bucket, Key=obj.key)["Body"].read()
    assert hashlib.sha256(got).hexdigest() == sha


def test_a_part_that_ends_first_frees_its_buffer_for_the_next_part_while_an_older_one_is_still_sent(
        rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests end in any order (a slow one on a loaded gateway): the next part is read into the
    buffer of whichever request ended, not held behind the oldest, so the store keeps as many
    parts in flight as the buffers allow. Part 1 here waits, inside its request, for part 6 (which
    needs a buffer freed by another part) to begin; the parts still land in order."""
    cfg = remote_config(rgw)  # 5 MiB parts, 4 in flight, 5 buffers: part 6 needs one freed
    path = tmp_path / NAME
    size = 7 * 5 * MiB + 17  # 8 parts
    sha = _file(path, size)
    sixth = threading.Event()
    saw: List[bool] = []

    def begun(params: Any, **_: Any) -> None:
        if params["PartNumber"] == 6:
            sixth.set()
        elif params["PartNumber"] == 1 and not saw:
            saw.append(sixth.wait(GUARD))  # a guard: before, part 6 waited for part 1 to end

    on_agent_clients(monkeypatch, "before-parameter-build.s3.UploadPart", begun)
    obj = remote.upload_file(cfg, str(path), NAME, sha256=sha)
    assert saw == [True]  # part 6 began while part 1 was still being sent
    assert (obj.sha256, obj.size, obj.verified_by) == (sha, size, "etag") and obj.etag.endswith("-8"), obj
    got = rgw.client().get_object(Bucket=cfg.backup.remote.bucket, Key=obj.key)["Body"].read()
    assert hashlib.sha256(got).hexdigest() == sha


def test_a_ranged_download_stopped_halfway_leaves_a_part_the_next_run_continues(
        rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = remote_config(rgw)
    cfg = dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, dir=str(tmp_path / "backups")))
    monkeypatch.setattr(transfer, "RANGE_BYTES", MiB)  # many ranges of a small object
    # three times the ranges in flight, the last one short: most are asked after the outage
    size = 3 * transfer.RANGE_WORKERS * transfer.RANGE_BYTES + 12345
    body = os.urandom(size)
    name = layout.full_name(KEY, NAME)
    b = Bucket(cfg)
    rgw.client().put_object(Bucket=b.bucket, Key=b.key(name), Body=body,
                            Metadata={"sha256": hashlib.sha256(body).hexdigest()})
    want = fetch.Wanted(name, NAME, layout.FULL, size)
    seen: List[Tuple[int, int]] = []

    def stop_the_gateway_halfway(done: int, total: int) -> None:
        seen.append((done, total))
        if done >= 2 * transfer.RANGE_BYTES and len(seen) == 2:
            rgw.stop_gateway()  # an outage halfway: the ranges still in flight fail

    with fetch.staging_locked(cfg.backup.dir) as staging:
        with pytest.raises(BackupError):
            fetch.fetch_one(b, want, cfg.backup.dir, progress=stop_the_gateway_halfway)
        part = Path(staging, NAME + ".part").read_bytes()
        # written in order: the part is the object's first bytes, up to a range boundary at least
        assert 2 * transfer.RANGE_BYTES <= len(part) < size and body.startswith(part), len(part)
        rgw.start_gateway()
        done = fetch.fetch_one(Bucket(cfg), want, cfg.backup.dir)
    assert (done.how, done.resumed_at) == ("resumed", len(part))
    assert hashlib.sha256(Path(cfg.backup.dir, NAME).read_bytes()).digest() == hashlib.sha256(body).digest()
    assert os.listdir(cfg.backup.dir) == [NAME]  # the staging dir went with its last part


def _spans(asked: Sequence[Tuple[str, str, str]]) -> List[Tuple[int, int]]:
    """(first byte, end) of each ranged GET among the requests a CutProxy saw."""
    out = []
    for method, _path, rng in asked:
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng)
        if method == "GET" and m:
            out.append((int(m.group(1)), int(m.group(2)) + 1))
    return out


CUT_IN = 3 * MiB  # where in its range's response the connection ends: its head and 3 MiB less a few bytes


@pytest.mark.parametrize("cut", [2, 3], ids=["2nd-range", "3rd-range"])
def test_a_range_whose_connection_ends_mid_body_keeps_the_ranges_before_it_and_the_same_fetch_continues(
        cut: int, rgw: RgwBed, tmp_path: Path) -> None:
    """A download of 8 MiB ranges, 4 at once, whose ``cut``-th range's connection ends cleanly 3 MiB
    into a body its Content-Length promised whole (a gateway stopped mid-body, CI 41): a fault to
    continue, said in one sentence (a BackupError, not the "shorter than it claims" of a short
    object, which would discard the part); the part holds exactly the ranges before it, none of
    the cut one; the same call continues from it, asking for no byte it holds, and ends with the
    whole object. The proxy cuts that range's response only, whichever of the 4 at once comes first."""
    from tests.harness.cutproxy import CutProxy

    proxy = CutProxy(("127.0.0.1", rgw.port))
    try:
        cfg = _with(remote_config(rgw), endpoint=proxy.endpoint)
        cfg = dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, dir=str(tmp_path / "backups")))
        size = 5 * transfer.RANGE_BYTES + 12345  # ranged from the start and from the part alike
        assert transfer.RANGE_BYTES == 8 * MiB and transfer.RANGE_WORKERS == 4  # the download's own ranges
        b = Bucket(cfg)
        body, obj = _stored(rgw, b, size)
        start = (cut - 1) * transfer.RANGE_BYTES
        proxy.cut_after(CUT_IN, request=f"Range: bytes={start}-")
        want = fetch.Wanted(obj.name, NAME, layout.FULL, size)
        with fetch.staging_locked(cfg.backup.dir) as staging:
            with pytest.raises(BackupError) as info:
                fetch.fetch_one(b, want, cfg.backup.dir)
            assert proxy.fired.is_set()
            msg = info.value.message
            assert not isinstance(info.value, BackupCorrupt), msg
            m = re.fullmatch(rf"{re.escape(b.where(obj.name))}: the connection ended after (\d+) of the "
                             rf"{transfer.RANGE_BYTES} bytes asked from byte {start}", msg)
            assert m and CUT_IN - 4096 < int(m.group(1)) < CUT_IN, msg  # one sentence, the cut range's
            part = Path(staging, NAME + ".part").read_bytes()
            assert len(part) == start, len(part)  # the ranges before the cut one, whole, in order
            assert hashlib.sha256(part).digest() == hashlib.sha256(body[:start]).digest()
            assert not Path(cfg.backup.dir, NAME).exists()
            assert _download_threads() == []
            before = len(proxy.asked)
            done = fetch.fetch_one(Bucket(cfg), want, cfg.backup.dir)
        asked = _spans(proxy.asked[before:])
    finally:
        proxy.close()
    assert (done.how, done.resumed_at) == ("resumed", start)
    # continued: ranges from the part's end on, each byte once, fewer than the object's
    assert min(a for a, _ in asked) == start and sorted(asked) == [
        (a, min(a + transfer.RANGE_BYTES, size)) for a in range(start, size, transfer.RANGE_BYTES)], asked
    assert sum(e - a for a, e in asked) == size - start < size
    assert hashlib.sha256(Path(cfg.backup.dir, NAME).read_bytes()).digest() == hashlib.sha256(body).digest()
    assert os.listdir(cfg.backup.dir) == [NAME]  # the staging dir went with its last part


def test_backup_fetch_cut_mid_range_fails_in_one_sentence_and_the_same_command_continues(
        rgw: RgwBed, tmp_path: Path) -> None:
    """`backup fetch` of a 40 MiB backup whose 2nd range's connection ends mid-body: exit 1, one
    error line saying the same command continues, nothing in the backup dir but the staging dir,
    the part the first range; the same command again continues at byte 8 MiB (asking for none
    before it) and the backup lands whole."""
    from tests.harness.cutproxy import CutProxy
    from tests.harness.rgw import rgw_config, rgw_config_text
    from tests.integration.test_restore import AGENT

    proxy = CutProxy(("127.0.0.1", rgw.port))
    try:
        bucket, directory = rgw.new_bucket(), str(tmp_path / "backups")
        conf = tmp_path / "agent.toml"  # the agent's: through the proxy
        conf.write_text(rgw_config_text(rgw, bucket, backup_dir=directory).replace(rgw.endpoint, proxy.endpoint))
        conf.chmod(0o600)
        b = Bucket(rgw_config(rgw, bucket, backup_dir=directory))  # the test's: straight to the store
        size = 5 * transfer.RANGE_BYTES + 12345
        body, obj = _stored(rgw, b, size)
        start = transfer.RANGE_BYTES
        proxy.cut_after(CUT_IN, request=f"Range: bytes={start}-")
        res = subprocess.run([AGENT, "-c", str(conf), "backup", "fetch", "latest"], capture_output=True, text=True,
                             timeout=300)
        assert proxy.fired.is_set()
        assert res.returncode == 1, res.stdout + res.stderr
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("etcd-agent: error: ")]
        assert len(errors) == 1 and res.stderr.rstrip("\n").endswith(errors[0]), res.stderr
        assert re.fullmatch(rf"etcd-agent: error: backup fetch: 0 of 1 object\(s\) fetched, then: "
                            rf"{re.escape(b.where(obj.name))}: the connection ended after \d+ of the "
                            rf"{transfer.RANGE_BYTES} bytes asked from byte {start}; nothing moved into "
                            rf"{re.escape(directory)} - the same command continues the fetch where it stopped",
                            errors[0]), errors[0]
        assert [n for n in os.listdir(directory) if not n.startswith(".")] == [], os.listdir(directory)
        part = Path(directory, fetch.STAGING, NAME + ".part").read_bytes()
        assert hashlib.sha256(part).digest() == hashlib.sha256(body[:start]).digest(), len(part)
        before = len(proxy.asked)
        again = subprocess.run([AGENT, "-c", str(conf), "backup", "fetch", "latest"], capture_output=True,
                               text=True, timeout=300)
        asked = _spans(proxy.asked[before:])
    finally:
        proxy.close()
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"continued at byte {start}" in again.stderr, again.stderr
    out = res.stdout + res.stderr + again.stdout + again.stderr
    assert rgw.secret_key not in out and rgw.access_key not in out, "a credential in the output"
    assert min(a for a, _ in asked) == start and sum(e - a for a, e in asked) == size - start, asked
    assert hashlib.sha256(Path(directory, NAME).read_bytes()).digest() == hashlib.sha256(body).digest()
    assert os.listdir(directory) == [NAME], os.listdir(directory)
    print(f"\nrefused (exit 1): {errors[0]}")


@pytest.mark.parametrize("way", ["socket", "wrapped"])
def test_ranges_read_into_reused_buffers_land_in_order_behind_the_callers_writes_on_kept_connections(
        way: str, rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each range is read from the socket straight into a buffer (``socket``: the locked botocore
    and urllib3 have the shape transfer._direct expects; a change of theirs fails here rather than
    silently slowing every download), or through botocore's reads (``wrapped``, the fallback);
    both keep each connection for the next range and write behind what the caller wrote."""
    from botocore.awsrequest import AWSHTTPConnectionPool

    cfg = remote_config(rgw)
    monkeypatch.setattr(transfer, "RANGE_BYTES", MiB)
    size = 5 * transfer.RANGE_WORKERS * MiB + 777
    b = Bucket(cfg)
    body, obj = _stored(rgw, b, size)
    through: List[int] = []
    real_through, real_new_conn = transfer._read_through, AWSHTTPConnectionPool._new_conn
    monkeypatch.setattr(transfer, "_read_through", lambda *a: through.append(1) or real_through(*a))
    if way == "wrapped":
        monkeypatch.setattr(transfer, "_direct", lambda _body: None)
    connections: List[int] = []
    monkeypatch.setattr(AWSHTTPConnectionPool, "_new_conn",
                        lambda self: connections.append(1) or real_new_conn(self))
    with open(tmp_path / "out", "w+b") as fh:
        fh.write(b"before")  # still in the file object's buffer
        got, digest = transfer.stream_object(b, obj, fh)
        assert fh.tell() == len(b"before") + size
    assert (got, digest) == (size, hashlib.sha256(body).hexdigest())
    assert (tmp_path / "out").read_bytes() == b"before" + body
    assert len(through) == (0 if way == "socket" else -(-size // MiB)), len(through)
    assert len(connections) <= transfer.RANGE_WORKERS, len(connections)  # not one a range


@pytest.mark.parametrize("way", ["socket", "wrapped"])
def test_a_range_that_stalls_mid_body_fails_as_a_gateway_that_did_not_answer(
        way: str, rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body held halfway (the store hung mid-object): the read times out within read_timeout
    and says so in one sentence, a BackupError (the part is kept to be continued), whichever way
    the range is read."""
    from tests.harness.cutproxy import CutProxy

    monkeypatch.setattr(transfer, "RANGE_BYTES", MiB)
    if way == "wrapped":
        monkeypatch.setattr(transfer, "_direct", lambda _body: None)
    proxy = CutProxy(("127.0.0.1", rgw.port))
    try:
        cfg = _with(remote_config(rgw), endpoint=proxy.endpoint, read_timeout=1.0, max_attempts=1)
        size = 3 * transfer.RANGE_WORKERS * MiB
        b = Bucket(cfg)
        body, obj = _stored(rgw, b, size)
        proxy.hold_after(MiB // 2)  # the first range's body stops halfway
        with open(tmp_path / "out", "wb") as fh, pytest.raises(BackupError) as info:
            transfer.stream_object(b, obj, fh)
        assert proxy.fired.is_set()
    finally:
        proxy.close()
    assert not isinstance(info.value, BackupCorrupt)
    assert "did not answer within 1 s" in info.value.message, info.value.message


def _stored(rgw: RgwBed, b: Bucket, size: int) -> Tuple[bytes, "remote.RemoteObject"]:
    """``size`` random bytes stored as the full backup NAME with their sha256, and as HEAD finds them."""
    body = os.urandom(size)
    name = layout.full_name(KEY, NAME)
    rgw.client().put_object(Bucket=b.bucket, Key=b.key(name), Body=body,
                            Metadata={"sha256": hashlib.sha256(body).hexdigest()})
    return body, remote.checkable(b, name)


def _download_threads() -> List[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("download")]


class _HashBesideTheWrite:
    """A sha256 that, given a range, first waits (up to GUARD s) for the file to grow past the
    bytes hashed before it: the range's write has begun while it is being hashed. ``fail_at``:
    the range (counted from 1) whose hash raises instead."""

    def __init__(self, fd: int, fail_at: Optional[int] = None) -> None:
        self.real, self.fd, self.fail_at = hashlib.sha256(), fd, fail_at
        self.hashed = 0
        self.overlapped: List[bool] = []

    def update(self, data: Any) -> None:
        if len(self.overlapped) + 1 == self.fail_at:
            self.overlapped.append(True)
            raise RuntimeError("the hash broke")
        seen = all(self.overlapped)  # once serial, serial: the run that fails ends without a guard per range

        def grown() -> bool:
            if os.fstat(self.fd).st_size <= self.hashed:
                raise NotYet(f"the file holds {self.hashed} bytes, none of the range being hashed")
            return True

        if seen:
            try:
                poll(grown, timeout=GUARD, what="the range's write", interval=0.001)
            except OperationFailed:
                seen = False
        self.overlapped.append(seen)
        self.real.update(data)
        self.hashed += len(data)

    def hexdigest(self) -> str:
        return self.real.hexdigest()


def test_each_range_is_hashed_while_it_is_written(
        rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hash and write both let go of the GIL: on two cores a range costs the longer of the two,
    not their sum. The digest is still of the bytes in order, and no thread outlives the call."""
    monkeypatch.setattr(transfer, "RANGE_BYTES", MiB)
    size = 3 * transfer.RANGE_WORKERS * MiB + 4321
    b = Bucket(remote_config(rgw))
    body, obj = _stored(rgw, b, size)
    with open(tmp_path / "out", "w+b") as fh:
        sha = _HashBesideTheWrite(fh.fileno())
        got, digest = transfer.stream_object(b, obj, fh, sha=sha)  # type: ignore[arg-type]
    assert (got, digest) == (size, hashlib.sha256(body).hexdigest())
    assert (tmp_path / "out").read_bytes() == body
    assert sha.overlapped == [True] * -(-size // MiB), sha.overlapped
    assert _download_threads() == []


def test_a_hash_that_fails_mid_download_is_raised_and_nothing_after_it_is_written(
        rgw: RgwBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "RANGE_BYTES", MiB)
    size = 3 * transfer.RANGE_WORKERS * MiB
    b = Bucket(remote_config(rgw))
    body, obj = _stored(rgw, b, size)
    with open(tmp_path / "out", "w+b") as fh, pytest.raises(RuntimeError, match="the hash broke"):
        transfer.stream_object(b, obj, fh, sha=_HashBesideTheWrite(fh.fileno(), fail_at=3))  # type: ignore[arg-type]
    written = (tmp_path / "out").read_bytes()
    assert len(written) <= 3 * MiB and body.startswith(written), len(written)  # a prefix, none of range 4 on
    assert _download_threads() == []


def test_a_disk_that_fills_mid_range_fails_the_fetch_in_one_sentence_and_keeps_a_prefix_to_continue(
        rgw: RgwBed, tmp_path: Path, small_backup_dir: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The backup dir's filesystem (a 4 MiB tmpfs) fills while the second range is written: the
    fetch fails saying so (a BackupError, not a corrupt copy), nothing is named as the backup, the
    part holds the object's first bytes, no thread is left; with room again, the next run continues."""
    monkeypatch.setattr(transfer, "RANGE_BYTES", 512 * 1024)
    cfg = remote_config(rgw)
    cfg = dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, dir=str(small_backup_dir)))
    size = 3 * MiB
    b = Bucket(cfg)
    body, obj = _stored(rgw, b, size)
    filler = small_backup_dir / "filler"

    def fill_after_the_first_range(done: int, _total: int) -> None:
        if done == transfer.RANGE_BYTES:  # room left for a third of the next range
            filler.write_bytes(b"\0" * (shutil.disk_usage(small_backup_dir).free - transfer.RANGE_BYTES // 3))

    want = fetch.Wanted(obj.name, NAME, layout.FULL, size)
    with fetch.staging_locked(cfg.backup.dir) as staging:
        with pytest.raises(BackupError) as info:
            fetch.fetch_one(b, want, cfg.backup.dir, progress=fill_after_the_first_range)
        part = Path(staging, NAME + ".part").read_bytes()
        assert _download_threads() == []
        assert not isinstance(info.value, BackupCorrupt)
        assert info.value.message == f"cannot write {staging}/{NAME}.part: No space left on device", info.value.message
        assert not (small_backup_dir / NAME).exists()
        assert transfer.RANGE_BYTES < len(part) < 2 * transfer.RANGE_BYTES and body.startswith(part), len(part)
        filler.unlink()
        done = fetch.fetch_one(Bucket(cfg), want, cfg.backup.dir)
    assert (done.how, done.resumed_at) == ("resumed", len(part))
    assert (small_backup_dir / NAME).read_bytes() == body
