"""Which chain the daemon's watch writes now (``chains.active_base``): the lock holder's record
read as a typed view (``WatcherHolder``) of what ``state.locks`` writes, a wrong field one
ProtocolError naming it, and a lock nobody holds naming no chain whatever its record says."""
from __future__ import annotations

import fcntl
import json
import os
from typing import Any, Iterator

import pytest

from etcd_agent.chain import chains
from etcd_agent.chain.chains import WatcherHolder
from etcd_agent.errors import ProtocolError
from etcd_agent.state.locks import Holder


@pytest.fixture
def held(tmp_path: Any) -> Iterator[str]:
    """The watcher lock file, held as a running watcher holds it; its record is the test's."""
    path = str(tmp_path / chains.WATCHER_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(fd)


def record(path: str, text: str) -> None:
    with open(path, "w") as fh:  # another open file: the lock held by the fixture's stays
        fh.write(text)


def test_the_watchers_own_record_names_its_chain(held: str) -> None:
    # the bytes state.locks writes for the watch (json of Holder, sorted keys, a newline)
    rec = Holder(operation="delta-watch", pid=4242, host="m1", since="2026-12-07T12:00:00Z", base_revision=42,
                 endpoint="https://10.0.0.1:2379")
    record(held, json.dumps(rec.to_json(), sort_keys=True) + "\n")
    assert chains.active_base(os.path.dirname(held)) == 42


def test_a_record_of_an_older_agent_or_of_another_operation_names_no_chain(held: str) -> None:
    for text in ("", "backup by pid 7\n", '{"operation": "backup", "pid": 7}', "[42]"):
        record(held, text)
        assert chains.active_base(os.path.dirname(held)) is None, text


@pytest.mark.parametrize("value", ['"42"', "true", "4.5", "[42]", "1e400"])
def test_a_wrong_base_revision_names_no_chain(held: str, value: str) -> None:
    record(held, '{"operation": "delta-watch", "base_revision": %s}' % value)
    assert chains.active_base(os.path.dirname(held)) is None


def test_a_wrong_field_is_one_protocol_error_naming_it() -> None:
    with pytest.raises(ProtocolError) as exc:
        WatcherHolder.from_json({"base_revision": "42"}, "watcher lock /b/.delta-watcher.lock")
    assert exc.value.message == ("watcher lock /b/.delta-watcher.lock: WatcherHolder.base_revision must be an "
                                 "integer, not a string")


def test_a_lock_nobody_holds_names_no_chain(tmp_path: Any) -> None:
    record(str(tmp_path / chains.WATCHER_LOCK), json.dumps(Holder(base_revision=42).to_json()))
    assert chains.active_base(str(tmp_path)) is None
