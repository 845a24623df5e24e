"""Archive writing with a real etcd snapshot (tests/data): header patching, stream checks,
identity read back from the written db, atomic publication."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
from typing import Any, Dict, Iterator, List, Sequence

import pytest

from etcd_agent.backup import archive
from etcd_agent.backup.manifest import FileEntry, Manifest
from etcd_agent.backup.reader import open_archive
from etcd_agent.backup.snapcheck import StreamCheck
from etcd_agent.errors import BackupCorrupt, BackupError

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
SNAP = open(os.path.join(DATA, "snap-a.db"), "rb").read()  # etcd 3.5.16, members m1..m3, revision 3


def chunked(data: bytes, sizes: List[int]) -> Iterator[bytes]:
    pos, i = 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        yield data[pos : pos + n]
        pos, i = pos + n, i + 1


def build(infos: Dict[str, archive.FileInfo], facts: Any, ident: Any) -> Manifest:
    return Manifest(files={n: FileEntry(i.size, i.sha256) for n, i in infos.items()}, revision=ident.revision,
                    missing={"etcd.service": "not found"}, verified=True)


def write(d: str, snap: bytes = SNAP, compression: str = "none",
          sizes: Sequence[int] = (7, 32, 1000, 31, 65536)) -> archive.Written:
    name = "etcd-2019-08-07-13-00-00" + archive.EXTENSIONS[compression]
    return archive.write_archive(
        d, name, chunks=chunked(snap, sizes), files={"etcd.conf": b"ETCD_NAME=m1\n"},
        build_manifest=build, mtime=1565182800,
    )


def test_stream_check_accepts_a_real_snapshot() -> None:
    c = StreamCheck()
    for ch in chunked(SNAP, [1, 33, 4095, 31]):
        c.update(ch)
    facts = c.finish()
    assert facts.page_size == 4096 and facts.high_water * 4096 + 32 == len(SNAP) and facts.trailer_checked
    bad = bytearray(SNAP)
    bad[4096 * 3 + 100] ^= 1
    c = StreamCheck()
    c.update(bytes(bad))
    with pytest.raises(BackupCorrupt, match="sha256 trailer does not match"):
        c.finish()
    c = StreamCheck()
    c.update(SNAP[:-100])
    with pytest.raises(BackupCorrupt, match="not a bbolt db plus"):
        c.finish()


def test_stream_check_refuses_a_non_db_after_its_first_pages() -> None:
    c = StreamCheck(declared=8 << 30)
    with pytest.raises(BackupCorrupt, match="not an etcd snapshot"):
        for _ in range(100):
            c.update(bytes(16384))
    assert c.size <= 65616 + 16384  # refused after ~64 KiB, not after 8 GiB


def test_plain_header_is_patched_and_readable(tmp_path: Any) -> None:
    w = write(str(tmp_path))
    assert w.revision == 3 and w.manifest.revision == 3
    assert {m.name for m in w.identity.members} == {"m1", "m2", "m3"}
    assert os.stat(w.path).st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == [os.path.basename(w.path)]  # no partial left
    with tarfile.open(w.path) as tar:
        assert tar.getnames() == ["etcd.conf", "etcd_snapshot.db", "manifest.json"]
        assert tar.extractfile("etcd_snapshot.db").read() == SNAP
        m = json.loads(tar.extractfile("manifest.json").read())
    assert m["files"]["etcd_snapshot.db"] == {"size": len(SNAP), "sha256": hashlib.sha256(SNAP).hexdigest()}
    listing = subprocess.run(["tar", "-tvf", w.path], capture_output=True, text=True, check=True)
    assert listing.stderr == ""
    with open_archive(w.path) as a:
        assert a.kind == "agent" and a.compression == "none" and not a.snapshot.extracted
        assert a.snapshot.sha256 == hashlib.sha256(SNAP).hexdigest()
        with a.snapshot.open() as fh:
            assert fh.read() == SNAP
    assert archive.read_manifest(w.path)["revision"] == 3


def test_zstd_round_trip(tmp_path: Any) -> None:
    w = write(str(tmp_path), compression="zstd")
    assert w.path.endswith(".tar.zst") and w.revision == 3 and w.manifest.revision == 3
    assert {m.name for m in w.identity.members} == {"m1", "m2", "m3"}  # read back through the frames
    assert os.listdir(tmp_path) == [os.path.basename(w.path)]  # nothing beside it
    assert os.stat(w.path).st_mode & 0o777 == 0o600
    stage = tmp_path / "stage"
    stage.mkdir()
    with open_archive(w.path, staging_dir=str(stage)) as a:
        assert a.compression == "zstd" and a.snapshot.extracted and a.identity.revision == 3
        assert a.members == ("manifest.json", "etcd.conf", "etcd_snapshot.db")  # the manifest first
        assert a.snapshot.sha256 == hashlib.sha256(SNAP).hexdigest() == w.sha256
        assert os.stat(a.snapshot.path).st_mode & 0o777 == 0o600
    assert os.listdir(stage) == []  # close() removed the copy


def test_zstd_archive_is_read_by_zstd_and_tar(tmp_path: Any) -> None:
    """The skippable frame padding the head and the independent frames are standard zstd: the
    runbook's tools read the archive as any .tar.zst (several frames: tests/integration)."""
    w = write(str(tmp_path), compression="zstd")
    with open(w.path, "rb") as fh:
        head = fh.read(archive.head_room({"etcd.conf": b"ETCD_NAME=m1\n"}))
    assert head.startswith(b"\x28\xb5\x2f\xfd") and b"\x50\x2a\x4d\x18" in head  # a frame, then a skippable one
    plain = subprocess.run(["zstd", "-dc", w.path], capture_output=True, check=True).stdout
    assert plain[257:262] == b"ustar" and len(plain) % 512 == 0
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["tar", "--zstd", "-xf", w.path, "-C", str(out)], check=True, capture_output=True)
    assert sorted(os.listdir(out)) == ["etcd.conf", "etcd_snapshot.db", "manifest.json"]
    assert (out / "etcd_snapshot.db").read_bytes() == SNAP
    m = json.loads((out / "manifest.json").read_bytes())
    assert m["files"]["etcd_snapshot.db"] == {"size": len(SNAP), "sha256": hashlib.sha256(SNAP).hexdigest()}
    listing = subprocess.run(["tar", "--zstd", "-tvf", w.path], capture_output=True, text=True, check=True)
    assert listing.stderr == ""


def test_open_tar_reads_every_frame_of_a_zstd_archive(tmp_path: Any) -> None:
    """open_tar (the systemd tier's reader) goes on past the head's frame and the skippable one."""
    w = write(str(tmp_path), compression="zstd")
    with archive.open_tar(w.path, seekable=False) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    assert list(got) == ["manifest.json", "etcd.conf", "etcd_snapshot.db"] and got["etcd_snapshot.db"] == SNAP


def test_gzip_archive_in_one_go_spool_removed(tmp_path: Any) -> None:
    """gzip: the manifest first, read by our reader and by `tar zxf` (the runbook's tool); the
    spooled snapshot beside it is gone, whether the write succeeds or fails."""
    w = write(str(tmp_path), compression="gzip")
    assert w.path.endswith(".tar.gz") and sorted(os.listdir(tmp_path)) == [os.path.basename(w.path)]
    assert os.stat(w.path).st_mode & 0o777 == 0o600
    stage = tmp_path / "stage"
    stage.mkdir()
    with open_archive(w.path, staging_dir=str(stage)) as a:
        assert a.compression == "gzip" and a.members[0] == "manifest.json"
        assert a.snapshot.sha256 == hashlib.sha256(SNAP).hexdigest() == w.sha256
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["tar", "zxf", w.path, "-C", str(out)], check=True, capture_output=True)
    assert (out / "etcd_snapshot.db").read_bytes() == SNAP

    def broken() -> Iterator[bytes]:
        yield SNAP[:5000]
        raise RuntimeError("etcd went away")

    d = tmp_path / "failing"
    d.mkdir()
    with pytest.raises(RuntimeError):
        archive.write_archive(str(d), "etcd-2019-08-07-13-00-00.tar.gz", chunks=broken(), files={},
                              build_manifest=build, mtime=0)
    assert os.listdir(d) == []


def test_failed_stream_leaves_nothing(tmp_path: Any) -> None:
    def broken() -> Iterator[bytes]:
        yield SNAP[:5000]
        raise RuntimeError("etcd went away")

    with pytest.raises(RuntimeError):
        archive.write_archive(str(tmp_path), "etcd-2019-08-07-13-00-00.tar", chunks=broken(),
                              files={}, build_manifest=build, mtime=0)
    assert os.listdir(tmp_path) == []
    with pytest.raises(BackupCorrupt, match="sha256 trailer"):
        archive.write_archive(str(tmp_path), "etcd-2019-08-07-13-00-00.tar", chunks=iter([SNAP[:-1] + b"x"]),
                              files={}, build_manifest=build, mtime=0)
    assert os.listdir(tmp_path) == []


def test_never_overwrites_an_existing_backup(tmp_path: Any) -> None:
    w = write(str(tmp_path))
    before = open(w.path, "rb").read()
    with pytest.raises(BackupError):
        write(str(tmp_path))
    assert open(w.path, "rb").read() == before
    assert os.listdir(tmp_path) == [os.path.basename(w.path)]


def test_names() -> None:
    from datetime import datetime

    assert archive.archive_name(datetime(2019, 8, 7, 13, 5, 9), "zstd") == "etcd-2019-08-07-13-05-09.tar.zst"
    assert archive.parse_name("etcd-2019-08-07-13-05-09.tar.gz") == (datetime(2019, 8, 7, 13, 5, 9), "gzip")
    for bad in (".etcd-2019-08-07-13-05-09.tar.partial", "etcd-2019-13-07-13-05-09.tar", "etcd-latest.tar"):
        assert archive.parse_name(bad) is None


# ---------------------------------------------------------------- encrypted (encrypt_to)


def _key(tmp_path: Any) -> Any:
    from etcd_agent import age

    secret, recipient = age.generate_identity()
    path = tmp_path / "key.txt"
    path.write_text(secret + "\n")
    os.chmod(path, 0o600)
    return str(path), age.parse_recipient(recipient)


def test_encrypted_member_is_written_in_one_pass_and_signed(tmp_path: Any) -> None:
    from etcd_agent import age

    keyfile, recipient = _key(tmp_path)
    other = age.parse_recipient(age.generate_identity()[1])
    d = tmp_path / "out"
    d.mkdir()
    w = archive.write_archive(str(d), "etcd-2019-08-07-13-00-00.tar", chunks=chunked(SNAP, [7, 32, 1000, 65536]),
                              files={"etcd.conf": b"ETCD_NAME=m1\n"}, build_manifest=build, mtime=1565182800,
                              encrypt_to=(recipient, other), key=b"k" * 32)
    # the revision lookup read its pages back through the encryptor
    assert w.revision == 3 and {m.name for m in w.identity.members} == {"m1", "m2", "m3"}
    assert w.sha256 == hashlib.sha256(SNAP).hexdigest()
    with tarfile.open(w.path) as tar:
        assert tar.getnames() == ["etcd.conf", "etcd_snapshot.db.age", "manifest.json"]
        ct = tar.extractfile("etcd_snapshot.db.age").read()
        m = json.loads(tar.extractfile("manifest.json").read())
    assert SNAP[4096:4200] not in open(w.path, "rb").read()  # no plaintext page in the archive
    assert len(ct) == age.encrypted_size(len(SNAP), 2)
    assert m["format_version"] == 3 and "etcd_snapshot.db" not in m["files"]
    assert m["files"]["etcd_snapshot.db.age"] == {"size": len(ct), "sha256": hashlib.sha256(ct).hexdigest()}
    assert m["encryption"] == {"format": "age", "recipients": [str(recipient), str(other)],
                               "plaintext_size": len(SNAP), "plaintext_sha256": hashlib.sha256(SNAP).hexdigest()}
    assert "AGE-SECRET-KEY" not in json.dumps(m).upper()
    man = Manifest.from_json(json.dumps(m).encode())
    assert man.encryption == w.manifest.encryption and man.snapshot_member == "etcd_snapshot.db.age"
    assert man.signature_state(b"k" * 32) == "valid"  # signed after the encryption was added
    dec = age.Decryptor(age.load_identities(keyfile))
    assert b"".join(dec.update(ct)) + dec.finish() == SNAP


def test_encrypted_and_compressed_is_refused_by_the_writer(tmp_path: Any) -> None:
    _, recipient = _key(tmp_path)
    with pytest.raises(Exception, match="plain tar only"):
        archive.write_archive(str(tmp_path), "etcd-2019-08-07-13-00-00.tar.zst", chunks=iter([SNAP]), files={},
                              build_manifest=build, mtime=0, encrypt_to=(recipient,))


def test_encrypted_stream_checks_still_run_on_the_plaintext(tmp_path: Any) -> None:
    _, recipient = _key(tmp_path)
    d = tmp_path / "out"
    d.mkdir()
    with pytest.raises(BackupCorrupt, match="sha256 trailer"):
        archive.write_archive(str(d), "etcd-2019-08-07-13-00-00.tar", chunks=iter([SNAP[:-1] + b"x"]), files={},
                              build_manifest=build, mtime=0, encrypt_to=(recipient,))
    assert os.listdir(d) == []


@pytest.mark.parametrize("bad", [
    {"format": "gpg"}, {"recipients": []}, {"recipients": ["age1short"]}, {"plaintext_sha256": "x"},
    {"extra": 1},
])
def test_manifest_encryption_is_parsed_strictly(bad: Dict[str, Any]) -> None:
    good = {"format": "age", "recipients": ["age1" + "q" * 58], "plaintext_size": 5, "plaintext_sha256": "0" * 64}
    doc = {"format": "etcd-agent-backup", "format_version": 3, "encryption": {**good, **bad},
           "files": {"etcd_snapshot.db.age": {"size": 300, "sha256": "1" * 64}}}
    with pytest.raises(BackupCorrupt):
        Manifest.from_json(json.dumps(doc).encode())
    doc["encryption"] = good
    assert Manifest.from_json(json.dumps(doc).encode()).encryption is not None
    for wrong in ({"etcd_snapshot.db": {"size": 5, "sha256": "1" * 64}},  # encryption says .age
                  {"etcd_snapshot.db.age": {"size": 5, "sha256": "1" * 64},
                   "etcd_snapshot.db": {"size": 5, "sha256": "1" * 64}}):  # both
        with pytest.raises(BackupCorrupt, match="lists no"):
            Manifest.from_json(json.dumps({**doc, "files": wrong}).encode())
    with pytest.raises(BackupCorrupt, match="format 2 manifest"):
        Manifest.from_json(json.dumps({**doc, "format_version": 2}).encode())


def test_space_needed_is_one_archive_not_two() -> None:
    """Nothing is spooled any more: a compressed backup needs room for at most one db's worth
    (zstd's bound on incompressible data and the manifest's head), not a db plus its archive."""
    from etcd_agent.backup.service import required_space

    db = 1200 * 10**6
    plain, zstd = required_space(db, "none", 0.0), required_space(db, "zstd", 0.0)
    assert db < plain < zstd < 1.01 * db
    assert zstd >= archive.compress_bound(db) + archive.head_room({})  # whatever zstd makes of it fits
    assert required_space(db, "zstd", 0.1) == int(zstd * 1.1)


def test_stream_check_hashes_in_one_pass_whatever_the_chunking() -> None:
    import hashlib
    import random

    data = SNAP
    rnd = random.Random(7)
    for _ in range(5):
        c = StreamCheck()
        pos = 0
        while pos < len(data):
            n = rnd.choice([1, 5, 31, 32, 33, 4096, 20_000])
            c.update(memoryview(data)[pos:pos + n] if n % 2 else data[pos:pos + n])
            pos += n
            assert c.sha256 == hashlib.sha256(data[:pos]).hexdigest()
        assert c.finish().sha256 == hashlib.sha256(data).hexdigest()
