"""Archive writing and reading with a synthetic (but valid) bbolt snapshot: header patching,
stream checks, hostile members, atomic publication."""
from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import subprocess
import tarfile
from typing import Any, Dict, Iterator, List, Optional

import pytest

from etcd_agent.backup import archive
from etcd_agent.backup.snapcheck import StreamCheck, _fnv64a
from etcd_agent.backup.verify import verify
from etcd_agent.errors import BackupCorrupt

PS = 4096
REVISION = 42


def _page(pgid: int, flags: int, count: int, body: bytes) -> bytes:
    return (struct.pack("<QHHI", pgid, flags, count, 0) + body).ljust(PS, b"\0")


def bolt_snapshot(extra_pages: int = 0) -> bytes:
    """A minimal bbolt db (meta x2, freelist, root leaf with an inline "key" bucket holding one
    revision key) plus etcd's sha256 trailer."""
    hwm = 4 + extra_pages
    meta = struct.pack("<IIIIQQQQQ", 0xED0CDAED, 2, PS, 0, 3, 0, 2, hwm, 5)
    meta += struct.pack("<Q", _fnv64a(meta))
    rev_key = REVISION.to_bytes(8, "big") + b"_" + (0).to_bytes(8, "big")
    inline = struct.pack("<QHHI", 0, 0x02, 1, 0) + struct.pack("<IIII", 0, 16, len(rev_key), 1) + rev_key + b"v"
    bucket_value = struct.pack("<QQ", 0, 0) + inline
    root = struct.pack("<IIII", 1, 16, 3, len(bucket_value)) + b"key" + bucket_value
    db = _page(0, 0x04, 0, meta) + _page(1, 0x04, 0, meta) + _page(2, 0x10, 0, b"") + _page(3, 0x02, 1, root)
    db += os.urandom(PS * extra_pages)
    return db + hashlib.sha256(db).digest()


def chunked(data: bytes, sizes: List[int]) -> Iterator[bytes]:
    pos, i = 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        yield data[pos : pos + n]
        pos, i = pos + n, i + 1


def build(infos: Dict[str, archive.FileInfo], facts: Any, revision: Optional[int], status: Any) -> Dict[str, Any]:
    return {
        "format": archive.FORMAT,
        "format_version": archive.FORMAT_VERSION,
        "cluster": {"id": "abc123", "name": "t"},
        "revision": revision,
        "files": {n: {"size": i.size, "sha256": i.sha256} for n, i in infos.items()},
        "missing": {"etcd.service": "not found"},
        "verified": True,
    }


def write(d: str, snap: bytes, compression: str = "none", sizes: List[int] = [7, 32, 1000, 31, 65536]) -> archive.Written:
    name = "etcd-2019-08-07-13-00-00" + archive.EXTENSIONS[compression]
    return archive.write_archive(
        d, name, chunks=chunked(snap, sizes), files={"etcd.conf": b"ETCD_NAME=m1\n"},
        build_manifest=build, mtime=1565182800,
    )


def test_stream_check_accepts_snapshot_and_finds_revision(tmp_path: Any) -> None:
    snap = bolt_snapshot(extra_pages=3)
    c = StreamCheck()
    for ch in chunked(snap, [1, 33, 4095, 31]):
        c.update(ch)
    facts = c.finish()
    assert facts.page_size == PS and facts.high_water == 7 and facts.size == len(snap)
    bad = bytearray(snap)
    bad[PS * 5] ^= 1
    c = StreamCheck()
    c.update(bytes(bad))
    with pytest.raises(BackupCorrupt, match="sha256 trailer does not match"):
        c.finish()
    c = StreamCheck()
    c.update(snap[:-100])
    with pytest.raises(BackupCorrupt, match="not a bbolt db plus"):
        c.finish()


@pytest.mark.parametrize("extra", [0, 1, 300])
def test_plain_header_is_patched_and_readable(tmp_path: Any, extra: int) -> None:
    snap = bolt_snapshot(extra_pages=extra)
    w = write(str(tmp_path), snap)
    assert w.revision == REVISION and w.manifest["revision"] == REVISION
    assert os.stat(w.path).st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == [os.path.basename(w.path)]  # no partial left
    with tarfile.open(w.path) as tar:
        assert tar.getnames() == ["etcd.conf", "etcd_snapshot.db", "manifest.json"]
        assert tar.extractfile("etcd_snapshot.db").read() == snap
        m = json.loads(tar.extractfile("manifest.json").read())
    assert m["files"]["etcd_snapshot.db"] == {"size": len(snap), "sha256": hashlib.sha256(snap).hexdigest()}
    listing = subprocess.run(["tar", "-tvf", w.path], capture_output=True, text=True, check=True)
    assert listing.stderr == ""
    assert f" {len(snap)} " in [l for l in listing.stdout.splitlines() if "etcd_snapshot.db" in l][0]
    rep = verify(w.path)
    assert rep.ok, rep.problems
    assert archive.read_manifest(w.path)["revision"] == REVISION


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_compressed_round_trip(tmp_path: Any, compression: str) -> None:
    snap = bolt_snapshot(extra_pages=5)
    w = write(str(tmp_path), snap, compression)
    assert w.path.endswith(archive.EXTENSIONS[compression])
    assert os.listdir(tmp_path) == [os.path.basename(w.path)]  # spool removed
    assert archive.read_manifest(w.path)["revision"] == REVISION
    rep = verify(w.path)
    assert rep.ok, rep.problems


def test_failed_stream_leaves_nothing(tmp_path: Any) -> None:
    snap = bolt_snapshot(extra_pages=2)

    def broken() -> Iterator[bytes]:
        yield snap[:5000]
        raise RuntimeError("etcd went away")

    with pytest.raises(RuntimeError):
        archive.write_archive(str(tmp_path), "etcd-2019-08-07-13-00-00.tar", chunks=broken(),
                              files={}, build_manifest=build, mtime=0)
    assert os.listdir(tmp_path) == []
    with pytest.raises(BackupCorrupt, match="sha256 trailer"):
        archive.write_archive(str(tmp_path), "etcd-2019-08-07-13-00-00.tar", chunks=iter([snap[:-1] + b"x"]),
                              files={}, build_manifest=build, mtime=0)
    assert os.listdir(tmp_path) == []


def test_never_overwrites_an_existing_backup(tmp_path: Any) -> None:
    snap = bolt_snapshot()
    w = write(str(tmp_path), snap)
    before = open(w.path, "rb").read()
    with pytest.raises(Exception):
        write(str(tmp_path), bolt_snapshot(extra_pages=1))
    assert open(w.path, "rb").read() == before
    assert os.listdir(tmp_path) == [os.path.basename(w.path)]


def _hostile(path: str, members: List[tarfile.TarInfo]) -> None:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for ti in members:
            tar.addfile(ti, io.BytesIO(b"x" * ti.size) if ti.isreg() else None)


def _reg(name: str, size: int = 1) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    return ti


def _special(name: str, type_: bytes, link: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = type_
    ti.linkname = link
    return ti


@pytest.mark.parametrize(
    "members,expected",
    [
        ([_reg("../etcd.conf")], "member '../etcd.conf' contains '..'"),
        ([_reg("/etc/etcd.conf")], "member '/etc/etcd.conf' has an absolute path"),
        ([_special("etcd.conf", tarfile.SYMTYPE, "/etc/shadow")], "member 'etcd.conf' is a link (to '/etc/shadow')"),
        ([_special("etcd.conf", tarfile.LNKTYPE, "manifest.json")], "member 'etcd.conf' is a link"),
        ([_special("etcd_snapshot.db", tarfile.CHRTYPE)], "member 'etcd_snapshot.db' is a device or fifo"),
        ([_special("etcd.conf", tarfile.DIRTYPE)], "member 'etcd.conf' is not a regular file"),
        ([_reg("etcd.conf"), _reg("etcd.conf")], "duplicate member 'etcd.conf'"),
        ([_reg("evil.sh")], "unexpected member 'evil.sh'"),
    ],
)
def test_hostile_members_refused(tmp_path: Any, members: List[tarfile.TarInfo], expected: str) -> None:
    path = str(tmp_path / "etcd-2019-08-07-13-00-00.tar")
    _hostile(path, members)
    work = tmp_path / "work"
    work.mkdir()
    rep = verify(path, tmp_parent=str(work))
    assert not rep.ok
    assert rep.problems[0] == f"refused: {expected}; nothing extracted from it" or rep.problems[0].startswith(
        f"refused: {expected}"
    ), rep.problems
    assert os.listdir(work) == []  # temp dir removed, nothing extracted
    assert not (tmp_path / "etcd.conf").exists()


def test_manifest_missing_or_garbage(tmp_path: Any) -> None:
    path = str(tmp_path / "etcd-2019-08-07-13-00-00.tar")
    _hostile(path, [_reg("etcd.conf", 3)])
    with pytest.raises(BackupCorrupt, match="no manifest.json"):
        archive.read_manifest(path)
    assert "no manifest.json: incomplete archive or not an etcd-agent backup" in verify(path).problems
    with tarfile.open(path, "w") as tar:
        ti = _reg("manifest.json", 5)
        tar.addfile(ti, io.BytesIO(b"{nope"))
    with pytest.raises(BackupCorrupt, match="not valid JSON"):
        archive.read_manifest(path)


def test_names() -> None:
    from datetime import datetime

    assert archive.archive_name(datetime(2019, 8, 7, 13, 5, 9), "zstd") == "etcd-2019-08-07-13-05-09.tar.zst"
    assert archive.parse_name("etcd-2019-08-07-13-05-09.tar.gz") == (datetime(2019, 8, 7, 13, 5, 9), "gzip")
    for bad in (".etcd-2019-08-07-13-05-09.tar.partial", "etcd-2019-13-07-13-05-09.tar", "etcd-latest.tar"):
        assert archive.parse_name(bad) is None
