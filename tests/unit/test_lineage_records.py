"""The restore lineage this host keeps (``<state_dir>/lineage.json``): each entry a typed record
(``LineageEntry``), the file's bytes as before, a file of the previous version still read and
kept when appended to, a damaged entry skipped (one ProtocolError naming its field)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import pytest

from etcd_agent.errors import ProtocolError
from etcd_agent.state import lineage
from etcd_agent.state.lineage import LineageEntry
from tests.unit.test_state_records import cfg

OLD: List[Dict[str, Any]] = [  # as the previous version wrote them
    {"member_ids": ["8e9e05c52164694d"], "op": "20261201T000000Z-ab12", "at": "2026-12-01T00:00:10Z"},
    {"member_ids": ["2e0a5e0f1ab7a62b", "a1f2e7d3c0b4a5f6"], "op": "20261205T000000Z-cd34", "at": "2026-12-05T00:00:09Z"},
]


def old_bytes(entries: List[Dict[str, Any]]) -> bytes:
    return (json.dumps(entries, indent=1) + "\n").encode()


def test_an_entry_is_written_byte_for_byte_as_before() -> None:
    e = LineageEntry(("8e9e05c52164694d",), "20261201T000000Z-ab12", "2026-12-01T00:00:10Z")
    assert old_bytes([e.to_json()]) == old_bytes(OLD[:1])


def test_a_file_of_the_previous_version_reads_and_is_kept_when_appended_to(tmp_path: Any) -> None:
    c = cfg(tmp_path)
    path = lineage.lineage_path(c)
    with open(path, "wb") as fh:
        fh.write(old_bytes(OLD))
    assert lineage.read(c) == [{"8e9e05c52164694d"}, {"2e0a5e0f1ab7a62b", "a1f2e7d3c0b4a5f6"}]
    lineage.record(c, ["BEEF", "CAFE"], "20261207T000000Z-ef56")
    with open(path, "rb") as fh:
        raw = fh.read()
    at = json.loads(raw)[-1]["at"]
    assert raw == old_bytes(OLD + [{"member_ids": ["beef", "cafe"], "op": "20261207T000000Z-ef56", "at": at}])
    assert lineage.read(c)[-1] == {"beef", "cafe"}


def test_a_damaged_entry_is_skipped_and_the_others_read(tmp_path: Any) -> None:
    c = cfg(tmp_path)
    bad = [{"member_ids": []}, {"member_ids": "beef"}, {"member_ids": ["beef", 7]}, ["beef"], "beef", None]
    with open(lineage.lineage_path(c), "w") as fh:
        json.dump(bad + OLD[:1], fh)
    assert lineage.read(c) == [{"8e9e05c52164694d"}]
    lineage.record(c, ["cafe"], "op")  # what could not be read is not carried on
    assert lineage.read(c) == [{"8e9e05c52164694d"}, {"cafe"}]
    with open(lineage.lineage_path(c), "w") as fh:
        fh.write("[" * 5000)
    assert lineage.read(c) == []


@pytest.mark.parametrize("doc,problem", [
    ({"op": "x"}, "LineageEntry lacks its field 'member_ids'"),
    ({"member_ids": []}, "LineageEntry.member_ids must hold 1 to 64 items, not 0"),
    ({"member_ids": ["beef", 7]}, "LineageEntry.member_ids[1] must be a string, not a number"),
    ({"member_ids": ["beef"], "op": 7}, "LineageEntry.op must be a string, not a number"),
])
def test_a_wrong_field_is_one_protocol_error_naming_it(doc: Any, problem: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        LineageEntry.from_json(doc, "lineage entry 0")
    assert exc.value.message == f"lineage entry 0: {problem}"


def test_no_file_is_no_lineage(tmp_path: Any) -> None:
    c = cfg(tmp_path)
    assert not os.path.exists(lineage.lineage_path(c)) and lineage.read(c) == []
