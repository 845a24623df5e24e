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
