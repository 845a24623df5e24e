"""Encrypted backups through the one bounded reader, on a real etcd snapshot (tests/data): decrypted
with an identity into a private staging dir (never a half-decrypted file under the final name),
checked without one as far as the ciphertext allows, refused for a wrong key, tampering found."""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from typing import Any, Dict, Tuple

import pytest

from etcd_agent import age
from etcd_agent.backup import archive
from etcd_agent.backup.manifest import FileEntry, Manifest
from etcd_agent.backup.reader import open_archive, peek_archive
from etcd_agent.errors import BackupCorrupt, CiphertextCorrupt, IdentityRefused

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
SNAP = open(os.path.join(DATA, "snap-a.db"), "rb").read()  # etcd 3.5.16, members m1..m3, revision 3
KEY = b"k" * 32


def build(infos: Dict[str, archive.FileInfo], facts: Any, ident: Any) -> Manifest:
    return Manifest(files={n: FileEntry(i.size, i.sha256) for n, i in infos.items()}, revision=ident.revision,
                    missing={"etcd.service": "not found"}, verified=True)


def identity(d: Any, name: str = "key.txt") -> Tuple[str, str]:
    secret, recipient = age.generate_identity()
    path = d / name
    path.write_text(f"# public key: {recipient}\n{secret}\n")
    os.chmod(path, 0o600)
    return str(path), recipient


def encrypted_backup(d: Any, *recipients: str) -> str:
    out = d / "backups"
    out.mkdir(exist_ok=True)
    w = archive.write_archive(str(out), "etcd-2019-08-07-13-00-00.tar", chunks=iter([SNAP[:5000], SNAP[5000:]]),
                              files={"etcd.conf": b"ETCD_NAME=m1\n"}, build_manifest=build, mtime=1565182800,
                              encrypt_to=age.parse_recipients(list(recipients)), key=KEY)
    return w.path


def stages(d: Any) -> list:
    return [n for n in os.listdir(d) if n.startswith(".etcd-agent-stage")]


def test_decrypted_with_an_identity_then_checked_like_any_snapshot(tmp_path: Any) -> None:
    keyfile, recipient = identity(tmp_path)
    path = encrypted_backup(tmp_path, recipient, age.generate_identity()[1])
    stage = tmp_path / "stage"
    stage.mkdir()
    with open_archive(path, staging_dir=str(stage), key=KEY, identities=age.load_identities(keyfile)) as a:
        snap, ident = a.plaintext()
        assert a.kind == "agent" and a.signature == "valid" and a.sealed is not None and a.sealed.decrypted
        assert ident.revision == 3 and {m.name for m in ident.members} == {"m1", "m2", "m3"}
        assert snap.extracted and snap.sha256 == hashlib.sha256(SNAP).hexdigest() and snap.facts.trailer_checked
        assert os.path.basename(snap.path) == "etcd_snapshot.db" and os.stat(snap.path).st_mode & 0o777 == 0o600
        (private,) = stages(stage)
        assert os.stat(stage / private).st_mode & 0o777 == 0o700
        with snap.open() as fh:
            assert fh.read() == SNAP
        assert a.sealed.recipients[0] == recipient and len(a.sealed.recipients) == 2
        text = "\n".join(a.checked)
        assert "sha256 of the ciphertext matches the manifest" in text
        assert "every chunk and the header MAC authenticated" in text
        assert "etcd_snapshot.db (decrypted): sha256 matches the manifest's plaintext sha256" in text
        assert "etcd sha256 trailer ok" in text
    assert stages(stage) == []


def test_without_an_identity_everything_but_the_snapshot_is_checked(tmp_path: Any) -> None:
    _, recipient = identity(tmp_path)
    path = encrypted_backup(tmp_path, recipient)
    with open_archive(path, key=KEY) as a:
        assert a.snapshot is None and a.identity is None and a.signature == "valid"
        assert a.sealed is not None and not a.sealed.decrypted and a.sealed.plaintext_size == len(SNAP)
        assert a.sealed.sha256 == a.manifest.files["etcd_snapshot.db.age"].sha256  # type: ignore[union-attr]
        text = "\n".join(a.checked)
        assert "age v1 header well-formed, 1 X25519 recipient stanza(s) = the recipients the manifest lists" in text
        assert f"exactly {len(SNAP)} bytes of plaintext as the manifest says" in text
        assert "sha256 of the ciphertext matches the manifest" in text
        assert any("not decrypted (no --identity)" in n and "whose snapshot it is" in n for n in a.not_checked)
        with pytest.raises(IdentityRefused, match="pass --identity FILE"):
            a.plaintext()
    p = peek_archive(path, key=KEY)
    assert p.encrypted and p.identity is None and p.signature == "valid"


def test_an_operation_that_needs_the_snapshot_is_refused_without_the_key(tmp_path: Any) -> None:
    _, recipient = identity(tmp_path)
    path = encrypted_backup(tmp_path, recipient)
    with pytest.raises(IdentityRefused) as exc:
        open_archive(path, staging_dir=str(tmp_path), need_plaintext=True)
    msg = exc.value.message
    assert msg.startswith(path + ": its snapshot is encrypted (age to age1") and "\n" not in msg
    assert msg.endswith("pass --identity FILE with the secret key of one of its recipients; nothing touched")
    assert exc.value.exit_code == 3 and stages(tmp_path) == []


def test_a_wrong_identity_is_refused_before_anything_is_written(tmp_path: Any) -> None:
    _, recipient = identity(tmp_path)
    wrong, _ = identity(tmp_path, "wrong.txt")
    path = encrypted_backup(tmp_path, recipient)
    with pytest.raises(IdentityRefused) as exc:
        open_archive(path, staging_dir=str(tmp_path), identities=age.load_identities(wrong))
    assert "none of the 1 key in identity file" in exc.value.message and "the wrong key?" in exc.value.message
    assert exc.value.exit_code == 3 and stages(tmp_path) == []


def _tampered(path: str, offset_in_member: int) -> None:
    with tarfile.open(path) as tar:
        at = tar.getmember("etcd_snapshot.db.age").offset_data
    with open(path, "r+b") as fh:
        fh.seek(at + offset_in_member)
        b = fh.read(1)
        fh.seek(at + offset_in_member)
        fh.write(bytes([b[0] ^ 0x20]))


def test_a_tampered_ciphertext_is_corrupt_with_or_without_the_key(tmp_path: Any) -> None:
    keyfile, recipient = identity(tmp_path)
    path = encrypted_backup(tmp_path, recipient)
    _tampered(path, 400)  # inside the payload: the structure stays valid
    with pytest.raises(CiphertextCorrupt, match="fails authentication") as exc:
        open_archive(path, staging_dir=str(tmp_path), identities=age.load_identities(keyfile))
    assert isinstance(exc.value, BackupCorrupt) and stages(tmp_path) == []
    assert not any(n.endswith(".decrypting") for _r, _d, fs in os.walk(tmp_path) for n in fs)
    with pytest.raises(BackupCorrupt, match="sha256 mismatch"):  # no key: the signed ciphertext hash
        open_archive(path, key=KEY)


def test_a_truncated_ciphertext_is_refused_by_its_size(tmp_path: Any) -> None:
    keyfile, recipient = identity(tmp_path)
    path = encrypted_backup(tmp_path, recipient)
    ct_size = age.encrypted_size(len(SNAP), 1)
    cut = tmp_path / "cut.tar"
    with tarfile.open(path) as tar:  # a runbook-style tar of a shortened age file
        ct = tar.extractfile("etcd_snapshot.db.age").read()  # type: ignore[union-attr]
    assert len(ct) == ct_size
    with tarfile.open(cut, "w") as tar:
        ti = tarfile.TarInfo("etcd_snapshot.db.age")
        ti.size = len(ct) - 1
        tar.addfile(ti, io.BytesIO(ct[:-1]))
    # the shorter file still fits the chunking (one byte less plaintext), but that plaintext size is
    # no etcd snapshot's (512-byte blocks + 32): refused from the sizes, before a byte is decrypted
    with pytest.raises(BackupCorrupt, match="not a bbolt db plus"):
        open_archive(str(cut), staging_dir=str(tmp_path), identities=age.load_identities(keyfile))
    assert stages(tmp_path) == []
    with pytest.raises(BackupCorrupt, match="not a bbolt db plus"):
        open_archive(str(cut))


def test_manifest_and_ciphertext_must_agree(tmp_path: Any) -> None:
    _, recipient = identity(tmp_path)
    path = encrypted_backup(tmp_path, recipient, age.generate_identity()[1])
    with tarfile.open(path) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    m = json.loads(members["manifest.json"])
    m["encryption"]["recipients"] = m["encryption"]["recipients"][:1]  # one recipient less than stanzas
    forged = tmp_path / "forged.tar"
    with tarfile.open(forged, "w") as tar:
        for name, data in (("etcd_snapshot.db.age", members["etcd_snapshot.db.age"]),
                           ("manifest.json", json.dumps(m).encode())):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    with pytest.raises(BackupCorrupt, match="2 X25519 recipient stanza"):
        open_archive(str(forged))


def test_a_plain_snapshot_where_the_manifest_says_encrypted_is_corrupt(tmp_path: Any) -> None:
    _, recipient = identity(tmp_path)
    path = encrypted_backup(tmp_path, recipient)
    with tarfile.open(path) as tar:
        manifest = tar.extractfile("manifest.json").read()  # type: ignore[union-attr]
    swapped = tmp_path / "swapped.tar"
    with tarfile.open(swapped, "w") as tar:
        for name, data in (("etcd_snapshot.db", SNAP), ("manifest.json", manifest)):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    with pytest.raises(BackupCorrupt):
        open_archive(str(swapped))


def test_two_snapshots_are_refused(tmp_path: Any) -> None:
    _, recipient = identity(tmp_path)
    path = encrypted_backup(tmp_path, recipient)
    with tarfile.open(path) as tar:
        ct = tar.extractfile("etcd_snapshot.db.age").read()  # type: ignore[union-attr]
    both = tmp_path / "both.tar"
    with tarfile.open(both, "w") as tar:
        for name, data in (("etcd_snapshot.db", SNAP), ("etcd_snapshot.db.age", ct)):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    with pytest.raises(Exception, match="two snapshots"):
        open_archive(str(both))


def test_cli_refuses_an_identity_file_others_can_read(tmp_path: Any, capsys: Any) -> None:
    from etcd_agent.cli.main import main

    keyfile, recipient = identity(tmp_path)
    path = encrypted_backup(tmp_path, recipient)
    os.chmod(keyfile, 0o644)
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[cluster]\nname = "c"\n[[member]]\nname = "m1"\nhost = "127.0.0.1"\n'
                   f'[backup]\ndir = "{tmp_path}/backups"\n[daemon]\nstate_dir = "{tmp_path}/state"\n')
    for argv in (["backup", "verify", path], ["backup", "import", path], ["restore", "--from", path, "--yes"]):
        capsys.readouterr()
        assert main(["-c", str(cfg), *argv, "--identity", keyfile]) == 3
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].endswith(f"has mode 0644, but it holds a secret key that only its owner "
                                                 f"may read: run chmod 600 {keyfile}"), err
