"""The bounded reader on real snapshots (tests/data) in tarballs made by GNU tar as an operator
would, and on hostile ones: every refusal one sentence, nothing written before it, bombs cheap."""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zlib
from typing import Any, Dict, List

import pytest

from etcd_agent.backup import manifest as M
from etcd_agent.backup.reader import open_archive, peek_archive
from etcd_agent.backup.tarstream import sniff
from etcd_agent.errors import BackupCorrupt, RefusedError
from tests.harness.bombs import gzip_bomb, sparse_bomb

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
SNAP_PATH = os.path.join(DATA, "snap-a.db")
SNAP = open(SNAP_PATH, "rb").read()
REPO = os.path.dirname(os.path.dirname(DATA))


def operator_dir(d: Any, *, unit: bool = True) -> str:
    """The three files as the runbook leaves them before `tar`."""
    work = d / "op"
    work.mkdir()
    (work / "etcd.conf").write_text("ETCD_NAME=m1\nETCD_DATA_DIR=/var/lib/etcd/default.etcd\n")
    if unit:
        (work / "etcd.service").write_text("[Service]\nExecStart=/usr/bin/etcd\n")
    (work / "etcd_snapshot.db").write_bytes(SNAP)
    return str(work)


def tar(cwd: str, out: str, *args: str) -> str:
    subprocess.run(["tar", *args, out, *(a for a in ())], cwd=cwd, check=True)
    return out


@pytest.mark.parametrize(
    "flags,members,compression",
    [
        (["czf"], ["etcd.conf", "etcd.service", "etcd_snapshot.db"], "gzip"),  # gzip inside a .tar name
        (["cf"], ["etcd.conf", "etcd.service", "etcd_snapshot.db"], "none"),
        (["czf"], ["."], "gzip"),  # ./ entry and ./-prefixed names
        (["cf"], ["./etcd.conf", "./etcd_snapshot.db"], "none"),  # only snapshot + conf
        (["--zstd", "-cf"], ["etcd.conf", "etcd_snapshot.db"], "zstd"),
    ],
)
def test_runbook_shapes(tmp_path: Any, flags: List[str], members: List[str], compression: str) -> None:
    work = operator_dir(tmp_path, unit="etcd.service" in members or members == ["."])
    out = str(tmp_path / "etcd-2019-08-07.tar")
    subprocess.run(["tar", *flags, out, *members], cwd=work, check=True)
    with open_archive(out, staging_dir=str(tmp_path)) as a:
        assert a.kind == "runbook" and a.compression == compression and a.manifest is None
        assert a.signature == "unsigned"
        assert a.conf is not None and a.conf.startswith(b"ETCD_NAME=m1")
        assert {m.name for m in a.identity.members} == {"m1", "m2", "m3"} and a.identity.revision == 3
        assert a.snapshot.facts.trailer_checked and a.snapshot.extracted == (compression != "none")
        assert any("no recorded sha256" in n for n in a.not_checked)
        with a.snapshot.open() as fh:
            assert fh.read() == SNAP
    assert [n for n in os.listdir(tmp_path) if n.startswith(".etcd-agent-stage")] == []
    p = peek_archive(out)
    assert p.kind == "runbook" and p.compression == compression


def test_sniff_goes_by_content(tmp_path: Any) -> None:
    assert sniff(b"\x1f\x8b\x08") == "gzip" and sniff(b"\x28\xb5\x2f\xfd") == "zstd"
    path = tmp_path / "etcd-2019-08-07.tar.gz"  # a plain tar in a .gz name
    work = operator_dir(tmp_path)
    subprocess.run(["tar", "cf", str(path), "etcd.conf", "etcd_snapshot.db"], cwd=work, check=True)
    with open_archive(str(path)) as a:
        assert a.compression == "none"


def _tar(path: str, members: List[tarfile.TarInfo], fmt: int = tarfile.GNU_FORMAT, data: bytes = b"x") -> None:
    with tarfile.open(path, "w", format=fmt) as t:
        for ti in members:
            t.addfile(ti, io.BytesIO(data * ti.size) if ti.isreg() else None)


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
        ([_special("etcd_snapshot.db", tarfile.FIFOTYPE)], "member 'etcd_snapshot.db' is a device or fifo"),
        ([_special("etcd.conf", tarfile.DIRTYPE)], "is a directory"),
        ([_reg("etcd.conf"), _reg("etcd.conf")], "duplicate member 'etcd.conf'"),
        ([_reg("./etcd.conf"), _reg("etcd.conf")], "duplicate member 'etcd.conf'"),
        ([_reg("evil.sh")], "unexpected member 'evil.sh'"),
        ([_reg("sub/etcd.conf")], "unexpected member 'sub/etcd.conf'"),
        ([_reg("etcd.conf", 2 << 20)], "member etcd.conf is 2097152 bytes, larger than any real one"),
    ],
)
def test_hostile_members_refused(tmp_path: Any, members: List[tarfile.TarInfo], expected: str) -> None:
    path = str(tmp_path / "etcd-2019-08-07-13-00-00.tar")
    _tar(path, members)
    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(RefusedError) as ei:
        open_archive(path, staging_dir=str(stage))
    msg = ei.value.message
    assert expected in msg and "nothing was extracted" in msg and "\n" not in msg, msg
    assert os.listdir(stage) == []


def test_pax_and_longname_headers_bounded(tmp_path: Any) -> None:
    path = str(tmp_path / "pax.tar")
    _tar(path, [_reg("etcd.conf" + "/" * 0), _reg("x" * 5000)], fmt=tarfile.PAX_FORMAT)
    with pytest.raises(RefusedError, match="a pax header of .* bytes"):
        open_archive(path)
    path = str(tmp_path / "gnu.tar")
    _tar(path, [_reg("y" * 5000)], fmt=tarfile.GNU_FORMAT)
    with pytest.raises(RefusedError, match="GNU long-name header"):
        open_archive(path)


def _wchar_of_open(path: str, stage: str) -> Dict[str, Any]:
    """Bytes this process passes to write(2) while open_archive runs, from /proc/self/io, in a
    fresh interpreter (nothing else writes there meanwhile)."""
    code = (
        "import json, sys\n"
        "def wchar():\n"
        "    for line in open('/proc/self/io'):\n"
        "        if line.startswith('wchar:'):\n"
        "            return int(line.split()[1])\n"
        "from etcd_agent.backup.reader import open_archive\n"
        "before = wchar(); err = None\n"
        "try:\n"
        "    open_archive(sys.argv[1], staging_dir=sys.argv[2]).close()\n"
        "except Exception as exc:\n"
        "    err = getattr(exc, 'message', str(exc))\n"
        "after = wchar()\n"
        "print(json.dumps({'written': after - before, 'error': err}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, path, stage], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    res: Dict[str, Any] = json.loads(out.stdout)
    return res


def test_gnu_sparse_bomb_writes_nothing(tmp_path: Any) -> None:
    for fmt in ("gnu", "posix"):
        out = sparse_bomb(str(tmp_path / f"src-{fmt}"), fmt)
        size = os.path.getsize(out)
        stage = tmp_path / f"stage-{fmt}"
        stage.mkdir()
        res = _wchar_of_open(out, str(stage))
        print(f"FIGURE sparse bomb ({fmt}): {size} byte tarball declaring 8 GiB -> {res['written']} bytes written; "
              f"refused: {res['error']}")
        assert size < 100_000
        assert res["error"] and "sparse" in res["error"]
        assert res["written"] <= 1 << 20
        assert os.listdir(stage) == []


def test_gzip_bomb_refused_after_its_first_pages(tmp_path: Any) -> None:
    out = str(tmp_path / "etcd-2019-08-07.tar")
    stage = tmp_path / "stage"
    stage.mkdir()
    # 8 GiB, or what fits in the staging dir's free space: a bomb larger than that is refused by
    # the space check before a byte is read, and this test is about the content check
    chunk = 16 << 20
    declared = min(8 << 30, shutil.disk_usage(stage).free // 2 // chunk * chunk)
    assert declared >= 64 << 20, "less than 128 MiB free under the temp root"
    gzip_bomb(out, declared + 32)  # a size etcd could have written: pages + trailer
    size = os.path.getsize(out)
    res = _wchar_of_open(out, str(stage))
    print(f"FIGURE gzip bomb: {size / 2**20:.1f} MiB gzip declaring {declared / 2**30:.2f} GiB -> "
          f"{res['written']} bytes written; refused: {res['error']}")
    assert size < declared // 500  # what makes it a bomb: it declares over 500 times its size
    assert res["error"] and "not an etcd snapshot" in res["error"]
    assert res["written"] <= 1 << 20
    assert os.listdir(stage) == []


def test_data_past_the_end_refused(tmp_path: Any) -> None:
    work = operator_dir(tmp_path)
    plain = str(tmp_path / "p.tar")
    subprocess.run(["tar", "cf", plain, "etcd.conf", "etcd_snapshot.db"], cwd=work, check=True)
    data = open(plain, "rb").read()
    out = str(tmp_path / "trail.tar")
    with open(out, "wb") as fh:
        fh.write(zlib.compress(b"") and gzip.compress(data + bytes(4 << 20)))
    with pytest.raises(RefusedError, match="after the end of the tar archive"):
        open_archive(out, staging_dir=str(tmp_path))
    with open(out, "wb") as fh:
        fh.write(gzip.compress(data + b"surprise"))
    with pytest.raises(RefusedError, match="data after the end"):
        open_archive(out, staging_dir=str(tmp_path))


def test_truncated_and_not_a_tar(tmp_path: Any) -> None:
    work = operator_dir(tmp_path)
    plain = str(tmp_path / "p.tar")
    subprocess.run(["tar", "cf", plain, "etcd.conf", "etcd_snapshot.db"], cwd=work, check=True)
    os.truncate(plain, 512 * 3 + 10000)
    with pytest.raises(BackupCorrupt, match="truncated: member 'etcd_snapshot.db' declares 20512 bytes"):
        open_archive(plain)
    junk = tmp_path / "notes.txt"
    junk.write_text("hello\n")
    with pytest.raises(BackupCorrupt, match="not a tar archive"):
        open_archive(str(junk))
    gz = tmp_path / "cut.tar.gz"
    subprocess.run(["tar", "czf", str(gz), "etcd.conf", "etcd_snapshot.db"], cwd=work, check=True)
    os.truncate(gz, os.path.getsize(gz) // 2)
    with pytest.raises(BackupCorrupt, match="truncated|ends early"):
        open_archive(str(gz), staging_dir=str(tmp_path))


def _agent_tar(path: str, manifest: bytes, snap: bytes = SNAP, compression: str = "gzip") -> None:
    mode = "w:gz" if compression == "gzip" else "w"
    with tarfile.open(path, mode, format=tarfile.GNU_FORMAT) as t:
        for name, data in (("manifest.json", manifest), ("etcd_snapshot.db", snap)):
            t.addfile(_reg(name, len(data)), io.BytesIO(data))


def _manifest(**over: Any) -> Dict[str, Any]:
    import hashlib

    m: Dict[str, Any] = {"format": M.FORMAT, "format_version": 2, "revision": 3,
                         "files": {"etcd_snapshot.db": {"size": len(SNAP), "sha256": hashlib.sha256(SNAP).hexdigest()}}}
    m.update(over)
    return m


def test_manifest_limits_never_crash(tmp_path: Any) -> None:
    deep = b'{"format": "etcd-agent-backup", "x": ' + b"[" * 117_000 + b"]" * 117_000 + b"}"
    assert 230_000 < len(deep) < 240_000
    cases = [
        (deep, "nested deeper than 8"),
        (json.dumps(_manifest(cluster="x")).encode(), "Manifest.cluster: ClusterClaim must be a JSON object, not a string"),
        (json.dumps(_manifest(members="nope")).encode(), "Manifest.members must be a list, not a string"),
        (json.dumps(_manifest(evil=1)).encode(), "Manifest has unknown field(s) evil"),
        (b"{nope", "bad JSON"),
        (b" " * (300 * 1024), "larger than any real one"),
    ]
    for i, (body, want) in enumerate(cases):
        path = str(tmp_path / f"m{i}.tar.gz")
        _agent_tar(path, body)
        with pytest.raises((BackupCorrupt, RefusedError)) as ei:
            open_archive(path, staging_dir=str(tmp_path))
        assert want in ei.value.message and "\n" not in ei.value.message, ei.value.message


def test_sizes_checked_against_the_manifest_before_writing(tmp_path: Any) -> None:
    m = _manifest()
    m["files"]["etcd_snapshot.db"]["size"] = 4096 + 32
    path = str(tmp_path / "big.tar.gz")
    _agent_tar(path, json.dumps(m).encode())
    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(RefusedError, match="declares 20512 bytes, the manifest says 4128"):
        open_archive(path, staging_dir=str(stage))
    assert os.listdir(stage) == []


def test_signature_states(tmp_path: Any) -> None:
    key, other = os.urandom(32), os.urandom(32)
    man = M.Manifest.from_json(json.dumps(_manifest(cluster={"id": "abc"})).encode())
    signed = man.signed(key)
    path = str(tmp_path / "s.tar")
    _agent_tar(path, signed.to_bytes(), compression="none")
    with open_archive(path, key=key) as a:
        assert a.signature == "valid" and a.kind == "agent"
    with open_archive(path, key=other) as a:
        assert a.signature == "unknown-key"
    with open_archive(path) as a:
        assert a.signature == "unknown-key"
    forged = json.loads(signed.to_bytes())
    forged["cluster"]["id"] = "def"  # a claim changed after signing
    _agent_tar(path, json.dumps(forged).encode(), compression="none")
    with open_archive(path, key=key) as a:
        assert a.signature == "invalid"
    _agent_tar(path, man.to_bytes(), compression="none")
    with open_archive(path, key=key) as a:
        assert a.signature == "unsigned"
    assert M.key_id(key) not in json.dumps(signed.to_json()).replace(signed.signature.key_id, "")  # type: ignore[union-attr]


def test_two_changed_bytes_in_the_snapshot(tmp_path: Any) -> None:
    bad = bytearray(SNAP)
    bad[4096 * 2 + 7] ^= 0xFF
    bad[4096 * 3 + 9] ^= 0xFF
    path = str(tmp_path / "b.tar")
    _agent_tar(path, json.dumps(_manifest()).encode(), snap=bytes(bad), compression="none")
    with pytest.raises(BackupCorrupt, match="sha256 trailer does not match"):
        open_archive(path)
    # listing does not hash: the change is not seen there, so listing never calls it verified
    assert peek_archive(path).kind == "agent"


def test_plain_tar_sizes_checked_against_its_last_member_manifest_before_staging(tmp_path: Any) -> None:
    m = _manifest()
    m["files"]["etcd_snapshot.db"]["size"] = 4096 + 32
    path = str(tmp_path / "p.tar")
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as t:  # our writer's order: manifest last
        for name, data in (("etcd_snapshot.db", SNAP), ("manifest.json", json.dumps(m).encode())):
            t.addfile(_reg(name, len(data)), io.BytesIO(data))
    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(RefusedError, match="declares 20512 bytes, the manifest says 4128"):
        open_archive(path, staging_dir=str(stage), extract=True)
    assert os.listdir(stage) == []
    with pytest.raises(BackupCorrupt, match="20512 bytes, the manifest says 4128"):
        open_archive(path)  # in place: nothing is written, the comparison comes after the walk


def test_a_fifo_never_blocks_the_reader(tmp_path: Any) -> None:
    fifo = str(tmp_path / "etcd-2019-08-07.tar")
    os.mkfifo(fifo)
    with pytest.raises(RefusedError, match="not a regular file"):
        open_archive(fifo)
    with pytest.raises(RefusedError, match="not a regular file"):
        peek_archive(fifo)
    from etcd_agent.backup.catalog import list_backups

    (e,) = list_backups(str(tmp_path))
    assert e.problem == "not a regular file"
