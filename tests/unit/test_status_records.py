"""The continuous backup's records on disk and in ``status``: a status document and the chain
breaks kept beside the segments, read as typed documents. A hostile one (a field of the wrong
type, an over-long string, a nested value, a missing field) is one ProtocolError naming the record
and the field - never a value taken as something else, never a TypeError."""
from __future__ import annotations

import json
from typing import Any, Dict

import pytest

from etcd_agent.continuous import status
from etcd_agent.continuous.status import BreakRecord, DeltaStatus
from etcd_agent.errors import ProtocolError

BREAK = {"base_revision": 100, "chain_id": "ab" * 16, "at_revision": 150, "reason": "etcd compacted it",
         "time": 1700000000.5, "compact_revision": 149}


def test_good_records_read_as_ever() -> None:
    rec = BreakRecord.from_json(BREAK, "breaks")
    assert rec == BreakRecord(100, "ab" * 16, 150, "etcd compacted it", 1700000000.5, 149)
    assert rec.to_json() == BREAK
    assert BreakRecord.from_json(dict(BREAK, compact_revision=None), "b").compact_revision is None
    s = DeltaStatus(True, "watching", full_backups={"chain_broken": 2}, durable_revision=5, at=3.0)
    assert DeltaStatus.from_json(json.loads(json.dumps(s.to_json())), "status") == s


@pytest.mark.parametrize("change, why", [
    ({"chain_id": ["ab" * 16]}, "BreakRecord.chain_id must be a string, not a list"),
    ({"base_revision": "100"}, "BreakRecord.base_revision must be an integer, not a string"),
    ({"time": "1700000000"}, "BreakRecord.time must be a number, not a string"),
    ({"reason": "x" * 20000}, "BreakRecord.reason is longer than 16384 characters"),
    ({"reason": {"why": ["nested"]}}, "BreakRecord.reason must be a string, not an object"),
    ({"at_revision": None}, "BreakRecord.at_revision must not be null"),
])
def test_a_hostile_break_record_is_a_protocol_error(change: Dict[str, Any], why: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        BreakRecord.from_json(dict(BREAK, **change), "breaks")
    assert ei.value.message == f"breaks: {why}"


@pytest.mark.parametrize("doc, why", [
    ({"enabled": "yes", "state": "watching"}, "DeltaStatus.enabled must be a boolean, not a string"),
    ({"enabled": True}, "DeltaStatus lacks its field 'state'"),
    ({"enabled": True, "state": "watching", "full_backups": {"x": "2"}},
     "DeltaStatus.full_backups['x'] must be an integer, not a string"),
    ({"enabled": True, "state": "w" * 100}, "DeltaStatus.state is longer than 32 characters"),
])
def test_a_hostile_status_is_a_protocol_error(doc: Dict[str, Any], why: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        DeltaStatus.from_json(doc, "status")
    assert ei.value.message == f"status: {why}"


def test_a_breaks_file_with_a_hostile_record_is_ignored_as_a_whole(tmp_path: Any) -> None:
    """As an unreadable one is (``read_breaks`` logs it): a restore never names a break it made up."""
    doc = {"total": 2, "breaks": [BREAK, dict(BREAK, chain_id=["x"])]}
    (tmp_path / status.BREAKS_FILE).write_text(json.dumps(doc))
    assert status.read_breaks(str(tmp_path)) == (0, [])
    (tmp_path / status.BREAKS_FILE).write_text(json.dumps(dict(doc, breaks=[BREAK])))
    assert status.read_breaks(str(tmp_path)) == (2, [BreakRecord.from_json(BREAK, "b")])


def test_a_watchers_status_is_a_typed_document() -> None:
    """What ``status`` shows of the watch; read back through the same checks as every record."""
    from etcd_agent.continuous.position import WatcherStatus

    w = WatcherStatus("watching", "ab" * 16, 100, 151, 150, 3, "/b/etcd-delta-x.seg", None, durable_revision=149)
    d = json.loads(json.dumps(w.to_json()))
    assert d["broken"] is None and d["last_segment"] == "/b/etcd-delta-x.seg" and d["reconnects"] == 0
    assert WatcherStatus.from_json(d, "watcher") == w
    for change, why in [({"state": ["watching"]}, "WatcherStatus.state must be a string, not a list"),
                        ({"next_revision": "151"}, "WatcherStatus.next_revision must be an integer, not a string"),
                        ({"broken": "x" * 20000}, "WatcherStatus.broken is longer than 16384 characters")]:
        with pytest.raises(ProtocolError) as ei:
            WatcherStatus.from_json(dict(d, **change), "watcher")
        assert ei.value.message == f"watcher: {why}"
