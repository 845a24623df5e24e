"""The check cache's entries: typed, read bounded; a cache of the previous version is read, an
entry that is not a check reads as unchecked, what an entry shows stays bounded."""
import json
import os

from etcd_agent.backup import checks


def stamp(path):
    return list(checks.stamp_of(os.stat(path)))


def test_a_cache_of_the_previous_version_is_read(tmp_path):
    f = tmp_path / "b.tar"
    f.write_bytes(b"x")
    # as asdict wrote it: every key, nulls included
    (tmp_path / checks.CACHE).write_text(json.dumps({"b.tar": {
        "stamp": stamp(f), "ok": False, "how": "verify", "at": 1700000000, "kind": "agent", "revision": 7,
        "sha256": "ab" * 32, "member_ids": ["8e9e05c52164694d"], "problem": "p" * 5000, "signature": None}}, indent=1))
    c = checks.lookup(checks.load(str(tmp_path)), "b.tar", os.stat(f))
    assert c is not None and (c.ok, c.how, c.at, c.revision, c.member_ids) == (False, "verify", 1700000000.0, 7,
                                                                             ("8e9e05c52164694d",))
    assert c.problem == "p" * 2000  # cut as the previous reader cut it


def test_an_entry_that_is_not_a_check_is_unchecked_and_the_others_stay(tmp_path):
    f = tmp_path / "b.tar"
    f.write_bytes(b"x")
    good = checks.check_of(str(f), ok=True, how="written")
    assert good is not None
    (tmp_path / checks.CACHE).write_text(json.dumps({
        "b.tar": good.to_json(),
        "c.tar": {**good.to_json(), "ok": "yes"},  # read as True before: a string is not a result
        "d.tar": {**good.to_json(), "stamp": [1, 2, 3]},
        "e.tar": {**good.to_json(), "revision": "7"},
    }))
    assert set(checks.load(str(tmp_path))) == {"b.tar"}


def test_a_deeply_nested_cache_is_ignored(tmp_path):
    (tmp_path / checks.CACHE).write_text('{"b.tar": ' + "[" * 5000)
    assert checks.load(str(tmp_path)) == {}


def _check_many(d, who, n):
    for i in range(n):  # as `backup verify` and a backup's writer record at once
        name = f"{who}-{i}.tar"
        c = checks.check_of(os.path.join(d, name), ok=True, how="verify")
        assert c is not None
        checks.record(d, name, c)


def _drill_many(d, who, n):
    from etcd_agent.drill.record import DrillRecord, record_backup

    for i in range(n):  # as two drills of this dir, at once
        path = os.path.join(d, f"{who}-{i}.tar")
        record_backup(d, path, DrillRecord(os.path.basename(path), True, 1.0, 2.0), os.stat(path))


def test_concurrent_records_lose_no_check_and_no_drill(tmp_path):
    """Separate processes recording checks and drills of one backup dir at once: each
    read-modify-write is under the dir's lock (fs.dir_locked), so none is lost."""
    import multiprocessing

    from etcd_agent.drill import record as drillrecord

    d = str(tmp_path)
    names = [f"p{k}-{i}.tar" for k in range(4) for i in range(10)]
    for n in names:
        (tmp_path / n).write_bytes(n.encode())
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=fn, args=(d, f"p{k}", 10)) for fn in (_check_many, _drill_many) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(checks.load(d)) == sorted(names)
    assert sorted(drillrecord.load_records(d)) == sorted(names)
    assert [n for n in os.listdir(d) if n.endswith(".lock")] == []  # the dir's own lock: no lock file left
