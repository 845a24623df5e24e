"""The catalog on a backup dir of real archives (tests/data snapshot) and hostile files, with a
fake wall clock; the manifest type; the key file; the check cache."""
from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timedelta, timezone
from typing import Any, Dict

import pytest

from etcd_agent.backup import archive, catalog, checks, keys
from etcd_agent.backup.manifest import ClusterClaim, FileEntry, Manifest, ManifestMember
from etcd_agent.errors import BackupCorrupt, RefusedError, UsageError

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
SNAP = open(os.path.join(DATA, "snap-a.db"), "rb").read()
T0 = datetime(2019, 8, 7, 13, 0, 0, tzinfo=timezone.utc)


class FakeClock:
    """Moves only when told; sleeping on it is a test bug (fails closed)."""

    def __init__(self, t: datetime) -> None:
        self.t = t

    def now(self) -> datetime:
        return self.t

    def sleep(self, seconds: float) -> None:
        raise AssertionError("slept on the fake clock")


def _build(infos: Dict[str, archive.FileInfo], facts: Any, ident: Any) -> Manifest:
    return Manifest(files={n: FileEntry(i.size, i.sha256) for n, i in infos.items()}, revision=ident.revision)


def backup_at(d: str, when: datetime, *, record: bool = True) -> str:
    w = archive.write_archive(d, archive.archive_name(when), chunks=iter([SNAP]), files={}, build_manifest=_build,
                              mtime=int(when.timestamp()))
    if record:
        c = checks.check_of(w.path, ok=True, how="written", clock=FakeClock(when))
        assert c is not None
        checks.record(d, os.path.basename(w.path), c)
    return w.path


def test_hostile_files_quarantined_and_latest_falls_back(tmp_path: Any) -> None:
    d = str(tmp_path)
    clock = FakeClock(T0 + timedelta(hours=4))
    good = [backup_at(d, T0 + timedelta(hours=h)) for h in range(3)]
    shutil.copy(good[0], os.path.join(d, "etcd-2087-01-01-00-00-00.tar"))  # future by name
    with open(os.path.join(d, "etcd-2019-08-07-16-00-00.tar"), "wb") as fh:  # newest by name, corrupt
        fh.write(b"\0" * 512 + b"garbage")
    os.symlink("/etc/passwd", os.path.join(d, "etcd-2019-08-07-14-30-00.tar"))
    entries = catalog.list_backups(d, clock=clock)
    by = {e.name: e for e in entries}
    assert by["etcd-2087-01-01-00-00-00.tar"].problem.startswith("dated in the future by its name")  # type: ignore[union-attr]
    assert "not a tar archive" in (by["etcd-2019-08-07-16-00-00.tar"].problem or "")
    assert "symlink" in (by["etcd-2019-08-07-14-30-00.tar"].problem or "")
    best, notes = catalog.latest(entries)
    assert best is not None and best.path == good[2] and best.verified
    assert any("etcd-2019-08-07-16-00-00.tar is newer but quarantined" in n for n in notes)
    assert catalog.resolve(d, "latest", clock=clock).path == good[2]
    assert catalog.resolve(d, "2019-08-07-13", clock=clock).path == good[0]
    with pytest.raises(RefusedError, match="not usable"):
        catalog.resolve(d, "etcd-2019-08-07-16-00-00.tar", clock=clock)


def test_a_changed_file_is_no_longer_verified(tmp_path: Any) -> None:
    d = str(tmp_path)
    path = backup_at(d, T0)
    clock = FakeClock(T0 + timedelta(minutes=1))
    assert catalog.list_backups(d, clock=clock)[0].verified
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(2000)
        fh.write(b"\1")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the mtime put back
    e = catalog.list_backups(d, clock=clock)[0]
    assert not e.verified and e.check and e.check.startswith("unchecked")


def test_any_file_name_resolves(tmp_path: Any) -> None:
    d = str(tmp_path)
    path = backup_at(d, T0, record=False)
    for name in ("etcd-2019-08-07.tar", "etcd-2019-08-07-13-00-05.tar.gz", "drill.tar"):
        shutil.copy2(path, os.path.join(d, name))  # the mtime kept: not "modified in the future"
        assert catalog.resolve(d, name, clock=FakeClock(T0)).name == name
    with pytest.raises(UsageError, match="not a path, a file in"):
        catalog.resolve(d, "nonsense", clock=FakeClock(T0))
    assert catalog.name_time("etcd-2019-08-07.tar") == datetime(2019, 8, 7, tzinfo=timezone.utc)


def test_manifest_round_trip_and_canonical_signature() -> None:
    m = Manifest(files={"etcd_snapshot.db": FileEntry(20512, "a" * 64)}, name="n", cluster=ClusterClaim(id="abc"),
                 members=(ManifestMember("1f", "m1", ("http://x:2380",)),), revision=3,
                 rendered={"etcd.service": "no unit file"})
    key = os.urandom(32)
    s = m.signed(key)
    back = Manifest.from_json(s.to_bytes())
    assert back == s and back.signature_state(key) == "valid"
    raw = json.loads(s.to_bytes())
    raw["revision"] = 4
    assert Manifest.from_json(json.dumps(raw).encode()).signature_state(key) == "invalid"
    old = {"format": "etcd-agent-backup", "format_version": 1, "files": {"etcd_snapshot.db": {"size": 1, "sha256": "b" * 64}}}
    assert Manifest.from_json(json.dumps(old).encode()).signature_state(key) == "unsigned"
    for bad, want in ((dict(old, format_version=9), "not supported"), (dict(old, files={}), "lists no"),
                      (dict(old, verified="yes"), "Manifest.verified must be a boolean")):
        with pytest.raises(BackupCorrupt, match=want):
            Manifest.from_json(json.dumps(bad).encode())


def test_key_file_is_read_warned_never_raised(tmp_path: Any) -> None:
    p = str(tmp_path / "manifest.key")
    assert keys.read_key_file(p).key is None
    with open(p, "w") as fh:
        fh.write("zz\n")
    st = keys.read_key_file(p)
    assert st.key is None and any("ignored" in w for w in st.warnings)
    k = os.urandom(32)
    with open(p, "w") as fh:
        fh.write(k.hex() + "\n")
    os.chmod(p, 0o644)
    st = keys.read_key_file(p)
    assert st.key == k and "0600" in st.warnings[0] and k.hex() not in " ".join(st.warnings)


def test_check_cache_survives_garbage(tmp_path: Any) -> None:
    d = str(tmp_path)
    with open(os.path.join(d, checks.CACHE), "w") as fh:
        fh.write("[" * 100000)
    assert checks.load(d) == {}
    path = backup_at(d, T0)
    assert checks.lookup(checks.load(d), os.path.basename(path), os.stat(path)) is not None




def test_only_a_signed_manifest_makes_a_backup_a_checkpoint(tmp_path: Any) -> None:
    """A checkpoint takes no retention slot and is never a chain's base: a claim that only a
    manifest signed with this cluster's key can make. Unsigned, signed with another key, naming a
    malformed chain id, or not the daemon's: an operator's backup like any other."""
    d = str(tmp_path)
    key, other = b"k" * 32, b"o" * 32
    cases = {  # name: (snapshot claims, signing key, expected checkpoint_of)
        "unsigned": ({"taken_by": "daemon", "checkpoint": {"chain_id": "ab" * 16}}, None, None),
        "other-key": ({"taken_by": "daemon", "checkpoint": {"chain_id": "ab" * 16}}, other, None),
        "bad-id": ({"taken_by": "daemon", "checkpoint": {"chain_id": "../" + "a" * 29}}, key, None),
        "not-a-dict": ({"taken_by": "daemon", "checkpoint": ["ab" * 16]}, key, None),
        "operator": ({"taken_by": "operator", "checkpoint": {"chain_id": "ab" * 16}}, key, None),
        "signed": ({"taken_by": "daemon", "checkpoint": {"chain_id": "ab" * 16}}, key, "ab" * 16),
    }
    names = {}
    for i, (case, (snap, signer, _want)) in enumerate(cases.items()):
        def build(infos: Dict[str, archive.FileInfo], facts: Any, ident: Any, snap: Any = snap) -> Manifest:
            return Manifest(files={n: FileEntry(i.size, i.sha256) for n, i in infos.items()}, revision=ident.revision,
                            snapshot=snap)

        when = T0 + timedelta(minutes=i)
        w = archive.write_archive(d, archive.archive_name(when), chunks=iter([SNAP]), files={}, build_manifest=build,
                                  mtime=int(when.timestamp()), key=signer)
        names[os.path.basename(w.path)] = case
    got = {names[e.name]: e for e in catalog.list_backups(d, clock=FakeClock(T0 + timedelta(hours=1)), key=key)}
    for case, (_snap, _signer, want) in cases.items():
        e = got[case]
        assert e.complete and e.checkpoint_of == want, (case, e.checkpoint_of, e.signature)
        assert e.origin == ("daemon" if case in ("signed", "bad-id", "not-a-dict") else "operator"), (case, e.origin)


def test_a_checkpoint_its_chain_vouches_for_is_one_without_the_manifest_key(tmp_path):
    """A master restored from the bucket has no manifest key until its daemon's first full backup
    fetches it: the fetched checkpoint's manifest is unsigned there. Its chain says what it is (its
    file name and snapshot sha256), so it is neither copied as a full backup of a chain of its own
    nor the base of a new watch; a file of that name whose snapshot is not known to be it is neither."""
    from etcd_agent.backup.catalog import Entry, chain_checkpoints
    from etcd_agent.chain import chains
    from etcd_agent.chain.segments import Checkpoint, SegmentHeader, Txn
    from etcd_agent.chain.writer import SegmentWriter
    from tests.unit.test_chain_segments import put

    cp_name, full_name = "etcd-2026-12-05-10-00-00.tar", "etcd-2026-12-05-09-00-00.tar"
    w = SegmentWriter(str(tmp_path), SegmentHeader("ab" * 16, 0, 100, 101, "", 1_700_000_000_000))
    for rev in range(101, 106):
        w.add_txn(Txn(rev, 1_700_000_000_000 + rev, (put(rev, b"k"),)))
    w.close(1_700_000_000_200, confirmed=True, checkpoints=[Checkpoint(cp_name, "c" * 64, 104, 102)])
    found = chains.scan(str(tmp_path))

    def entry(name, sha, checkpoint_of=None):
        return Entry(name, str(tmp_path / name), datetime(2026, 12, 5, tzinfo=timezone.utc), 1, 100, True, "none",
                     snapshot_sha256=sha, checkpoint_of=checkpoint_of)

    full = entry(full_name, "f" * 64)
    got = chain_checkpoints([full, entry(cp_name, "c" * 64)], found)
    assert [(e.name, e.checkpoint_of) for e in got] == [(full_name, None), (cp_name, "ab" * 16)]
    for sha in (None, "d" * 64):  # not known to be what the chain vouches for: left out
        assert [e.name for e in chain_checkpoints([full, entry(cp_name, sha)], found)] == [full_name]
    signed = entry(cp_name, None, checkpoint_of="ab" * 16)  # a signed manifest said so: as it was
    assert chain_checkpoints([signed], found) == [signed]
