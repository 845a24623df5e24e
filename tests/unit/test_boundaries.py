"""Restores as boundaries of a backup dir's history (pure rules, and the record on disk)."""
from __future__ import annotations

import json
import os
import stat
from typing import Any

import pytest

from etcd_agent.backup import boundaries as B

T = 1_800_000_000.0


def at(name: str, t: float, sha: str = "") -> B.BackupAt:
    return B.BackupAt(name, t, sha or None)


BACKUPS = [at("h1", T - 7200), at("h2", T - 3600), at("src", T - 1800, "ab" * 32), at("last", T - 60),
           at("after", T + 60)]


def test_a_restore_holds_its_source_and_the_last_backup_before_it_while_its_data_is_aside() -> None:
    b = B.Boundary(op="r1", time=T, from_backup="src", from_sha256="ab" * 32, set_aside=("/d/m1.etcd.pre-restore-x",))
    held = B.by_name(B.holds([b], BACKUPS, exists=lambda p: True))
    assert list(held) == ["src", "last"]
    assert "the backup restore r1" in held["src"][0] and "came from" in held["src"][0]
    assert "the last backup before restore r1" in held["last"][0] and "/d/m1.etcd.pre-restore-x" in held["last"][0]
    # once `restore cleanup` removed the set-aside dirs, only the source is held
    assert list(B.by_name(B.holds([b], BACKUPS, exists=lambda p: False))) == ["src"]


def test_a_renamed_source_is_found_by_its_snapshot_hash_and_a_detected_one_holds_the_last_before() -> None:
    b = B.Boundary(op="r1", time=T, from_backup="gone.tar", from_sha256="ab" * 32)
    assert list(B.by_name(B.holds([b], BACKUPS, exists=lambda p: False))) == ["src"]
    d = B.Boundary(op="detected-1", time=T, kind="detected", reason="another cluster id")
    held = B.by_name(B.holds([d], BACKUPS, exists=lambda p: False))
    assert list(held) == ["last"] and "by hand" in held["last"][0]


def test_before_names_the_first_boundary_after_a_backup() -> None:
    b1, b2 = B.Boundary(op="r1", time=T), B.Boundary(op="r2", time=T + 3600)
    assert B.before([b2, b1], T - 10) == b1
    assert B.before([b1, b2], T + 10) == b2
    assert B.before([b1, b2], T + 7200) is None


def test_record_once_per_op_merging_set_aside_dirs(tmp_path: Any) -> None:
    d = str(tmp_path)
    assert B.read(d) == []
    assert B.record(d, B.Boundary(op="r1", time=T, set_aside=("/a",)))
    assert B.record(d, B.Boundary(op="r1", time=T, set_aside=("/b",)))  # the op's second member on this host
    assert not B.record(d, B.Boundary(op="r1", time=T, set_aside=("/a",)))
    assert B.record(d, B.Boundary(op="r0", time=T - 10))
    got = B.read(d)
    assert [x.op for x in got] == ["r0", "r1"] and got[1].set_aside == ("/a", "/b")
    path = os.path.join(d, B.FILE)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_hostile_record_is_ignored_not_trusted(tmp_path: Any) -> None:
    d = str(tmp_path)
    with open(os.path.join(d, B.FILE), "w") as fh:
        json.dump({"restores": [{"op": "ok", "time": T}, {"op": 5, "time": "x"}, "junk"]}, fh)
    assert [x.op for x in B.read(d)] == ["ok"]
    with open(os.path.join(d, B.FILE), "w") as fh:
        fh.write("[" * 100_000)
    assert B.read(d) == []


HOSTILE_RECORDS = {
    "garbage": b"\x00\xffnot json",
    "empty": b"",
    "time 1e300": b'{"restores": [{"op": "r1", "time": 1e300}]}',
    "time 1e400": b'{"restores": [{"op": "r1", "time": 1e400}]}',
    "time of 400 digits": b'{"restores": [{"op": "r1", "time": ' + b"9" * 400 + b"}]}",
    "time NaN": b'{"restores": [{"op": "r1", "time": NaN}]}',
    "time negative": b'{"restores": [{"op": "r1", "time": -5}]}',
    "nested bomb": b'{"restores": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "not an object": b"[1, 2]",
    "restores not a list": b'{"restores": 5}',
    "an entry not an object": b'{"restores": [{"op": "r1", "time": 1800000000}, "junk"]}',
}


def test_the_record_reader_reads_any_content_without_a_traceback(tmp_path: Any) -> None:
    d = str(tmp_path)
    for what, raw in HOSTILE_RECORDS.items():
        with open(os.path.join(d, B.FILE), "wb") as fh:
            fh.write(raw)
        for b in B.read(d):  # the listing's view: what could be read, each describable
            b.describe()
            assert 946684800 <= b.time <= 7258118400, what
        rec = B.load(d)
        assert rec.problem is not None and B.FILE in rec.problem, what
        assert "\n" not in rec.problem and "Traceback" not in rec.problem, what


def test_a_fifo_device_or_dir_as_the_record_is_unreadable_at_once(tmp_path: Any) -> None:
    from tests.unit.test_fs import deadline

    path = os.path.join(str(tmp_path), B.FILE)
    os.mkfifo(path)
    with deadline(5):
        assert B.read(str(tmp_path)) == []
        assert "is a FIFO, not a regular file" in (B.load(str(tmp_path)).problem or "")
    os.unlink(path)
    os.mkdir(path)
    assert "is a directory, not a regular file" in (B.load(str(tmp_path)).problem or "")
    os.rmdir(path)
    os.symlink("/dev/zero", path)
    assert B.load(str(tmp_path)).problem is not None


def test_record_refuses_to_overwrite_an_unreadable_record(tmp_path: Any) -> None:
    d = str(tmp_path)
    with open(os.path.join(d, B.FILE), "wb") as fh:
        fh.write(b'{"restores": [{"op": "r1", "time": 1e300}]}')
    with pytest.raises(B.RecordUnreadable) as ei:
        B.record(d, B.Boundary(op="r2", time=T))
    assert ei.value.message.startswith("restore r2 at ") and "prune deletes nothing" in ei.value.message
    assert open(os.path.join(d, B.FILE), "rb").read() == b'{"restores": [{"op": "r1", "time": 1e300}]}'


def _record_many(d: str, who: str, n: int) -> None:
    for i in range(n):  # as the daemon records a restore by hand, and as a restore's member does
        B.record(d, B.Boundary(op=f"detected-{who}-{i}", time=T + i, kind="detected", reason="another cluster id")
                 if int(who[1:]) % 2 else B.Boundary(op=f"{who}-{i}", time=T + i, from_backup="etcd-x.tar"))


def test_concurrent_records_lose_no_entry(tmp_path: Any) -> None:
    """The daemon's `detected` record and a restore's, written at once by separate processes:
    each read-modify-write is under the backup dir's lock, so none is lost."""
    import multiprocessing

    d = str(tmp_path)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_record_many, args=(d, f"p{k}", 8)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(b.op for b in B.read(d)) == sorted(("detected-" if k % 2 else "") + f"p{k}-{i}"
                                                     for k in range(4) for i in range(8))


def test_a_point_in_time_restore_records_its_full_backup_and_target_not_the_replay(tmp_path: Any) -> None:
    """The replay (``<full>.to-N.db`` under .pitr) is thrown away; what the restore came from,
    and what retention must keep, is the full backup (and with it its chain)."""
    from etcd_agent.config import parse_text
    from etcd_agent.restore.host import journal as J
    from etcd_agent.restore.host.node import NodeRestore

    cfg, errors = parse_text(f'[cluster]\nname = "k"\n[etcd]\ndata_dir = "{tmp_path}/m1.etcd"\n'
                             f'[backup]\ndir = "{tmp_path}/backups"\n[[member]]\nname = "m1"\nhost = "127.0.0.1"\n')
    assert cfg is not None and not errors, errors
    full = "etcd-2026-12-01-10-00-00.tar"
    j = J.Journal(op="op1", member="m1", backup=f"{tmp_path}/backups/.pitr/{full}.to-42.db", token="t",
                  initial_cluster="", sha256="cd" * 32, size=1, bump=None, fence_owner=False, new_cluster=False,
                  was_running=True, created=T)
    NodeRestore(cfg, "m1", "op1")._record_boundary(j, None)
    [b] = B.read(cfg.backup.dir)
    assert (b.from_backup, b.to_revision, b.from_sha256) == (full, 42, None)
    assert b.describe().endswith(f"(from {full} + its delta chain to revision 42)")
    held = B.by_name(B.holds([b], [at(full, T - 600), at("other", T - 300)], exists=lambda p: False))
    assert list(held) == [full]


def test_the_members_of_one_host_look_up_the_chain_of_a_point_in_time_restore_once(tmp_path: Any,
                                                                                  monkeypatch: Any) -> None:
    """Each member's finish records the restore's boundary with the chain of its full backup: the
    chain is looked up (the full backup's entry read, every segment's header and footer scanned)
    once per restore on a host, not once per member."""
    from etcd_agent.backup import catalog
    from etcd_agent.config import parse_text
    from etcd_agent.restore.host import journal as J
    from etcd_agent.restore.host.node import NodeRestore

    cfg, errors = parse_text(
        f'[cluster]\nname = "k"\n[etcd]\ndata_dir = "{tmp_path}/{{name}}.etcd"\n'
        f'conf_file = "{tmp_path}/{{name}}.conf"\n[backup]\ndir = "{tmp_path}/backups"\n' + "".join(
            f'[[member]]\nname = "m{i}"\nhost = "127.0.0.1"\nclient_url = "http://127.0.0.1:{2379 + 10 * i}"\n'
            f'peer_url = "http://127.0.0.1:{2380 + 10 * i}"\n' for i in (1, 2, 3)))
    assert cfg is not None and not errors, errors
    os.makedirs(cfg.backup.dir, mode=0o700)
    full = "etcd-2026-12-01-10-00-00.tar"
    with open(os.path.join(cfg.backup.dir, full), "wb") as fh:
        fh.write(b"not a backup: its entry has no revision")
    read = []
    real = catalog.entry_for
    monkeypatch.setattr(catalog, "entry_for", lambda path, **kw: read.append(path) or real(path, **kw))
    for op in ("op1", "op2"):
        for m in ("m1", "m2", "m3"):
            j = J.Journal(op=op, member=m, backup=f"{tmp_path}/backups/.pitr/{full}.to-42.db", token="t",
                          initial_cluster="", sha256="cd" * 32, size=1, bump=None, fence_owner=False,
                          new_cluster=False, was_running=True, created=T)
            NodeRestore(cfg, m, op)._record_boundary(j, None)
    assert len(read) == 2, read  # once for op1's three members, once for op2's
    assert [b.op for b in B.read(cfg.backup.dir)] == ["op1", "op2"]


WRITTEN = (  # the record as this version writes it (an optional field that is None left out)
    '{\n "restores": [\n  {\n   "op": "detected-1799999000000",\n   "time": 1799999000.0,\n   "kind": "detected",\n'
    '   "set_aside": [],\n   "cluster_id": "cafe",\n   "reason": "another cluster id"\n  },\n  {\n   "op": "r1",\n'
    '   "time": 1800000000.0,\n   "kind": "restore",\n   "from_backup": "src",\n   "from_sha256": "' + "ab" * 32 + '",\n'
    '   "set_aside": [\n    "/a"\n   ],\n   "reason": ""\n  }\n ]\n}\n')
# as an older version wrote it: every field, null ones too, before point-in-time restores
OLDER = json.dumps({"restores": [
    {"op": "detected-1799999000000", "time": 1799999000.0, "kind": "detected", "from_backup": None, "from_sha256": None,
     "set_aside": [], "cluster_id": "cafe", "reason": "another cluster id"},
    {"op": "r1", "time": 1800000000, "kind": "restore", "from_backup": "src", "from_sha256": "ab" * 32,
     "set_aside": ["/a"], "cluster_id": None, "reason": ""}]}, indent=1) + "\n"


def test_the_record_is_written_byte_for_byte_as_before_and_an_old_one_reads(tmp_path: Any) -> None:
    d = str(tmp_path)
    with open(os.path.join(d, B.FILE), "w") as fh:
        fh.write(OLDER)
    rec = B.load(d)
    assert rec.problem is None and [(b.op, b.kind, b.set_aside) for b in rec.boundaries] == [
        ("detected-1799999000000", "detected", ()), ("r1", "restore", ("/a",))]
    os.unlink(os.path.join(d, B.FILE))
    assert B.record(d, rec.boundaries[1]) and B.record(d, rec.boundaries[0])
    with open(os.path.join(d, B.FILE)) as fh:
        assert fh.read() == WRITTEN


@pytest.mark.parametrize("doc,problem", [
    ({}, "RestoreRecord lacks its field 'restores'"),
    ({"restores": {"op": "r1"}}, "RestoreRecord.restores must be a list, not an object"),
    ({"restores": None}, "RestoreRecord.restores must not be null"),
    ([], "RestoreRecord must be a JSON object, not a list"),
])
def test_a_record_without_its_list_is_one_error_naming_the_field(tmp_path: Any, doc: Any, problem: str) -> None:
    with pytest.raises(B.RecordUnreadable) as exc:
        B.RestoreRecord.from_json(doc, "x.json")
    assert exc.value.message == f"x.json: {problem}"
    path = os.path.join(str(tmp_path), B.FILE)
    with open(path, "w") as fh:
        json.dump(doc, fh)
    assert B.load(str(tmp_path)).problem == f"{path} is not a restore record: {problem}"
