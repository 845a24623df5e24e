"""What a host's bootstrap record proves of the cluster (``evidence.local_hosts``): the record is
read as the typed ``BootstrapRecord`` that ``state.bootstrap`` writes, so a member id that is not
the hex string the agent writes is a note naming the field, never an id read some other way."""
from __future__ import annotations

import json
from typing import Any

from etcd_agent.backup.evidence import local_hosts
from etcd_agent.state import bootstrap
from tests.unit.test_json_readers import _cfg


def write(path: str, doc: Any) -> None:
    with open(path, "w") as fh:
        json.dump(doc, fh)


def test_the_record_the_agent_writes_is_evidence_of_its_member_id(tmp_path: Any) -> None:
    c = _cfg(tmp_path)
    bootstrap.remember(c, "m1", 0xCAFE, 0x8E9E05C52164694D, "tok")
    hosts, notes = local_hosts(c)
    assert notes == [] and [h.ids for h in hosts] == [frozenset({0x8E9E05C52164694D})]


def test_a_record_of_the_previous_version_is_evidence_too(tmp_path: Any) -> None:
    c = _cfg(tmp_path)
    write(bootstrap.record_path(c, "m1"), {"cluster": "u", "cluster_id": "cafe", "member_id": "beef", "since": ""})
    hosts, notes = local_hosts(c)
    assert notes == [] and [h.ids for h in hosts] == [frozenset({0xBEEF})]


def test_a_member_id_written_as_a_number_is_a_note_naming_the_field(tmp_path: Any) -> None:
    c = _cfg(tmp_path)
    path = bootstrap.record_path(c, "m1")
    write(path, {"cluster": "u", "member_id": 51966})  # read before as the hex id 0x51966
    hosts, notes = local_hosts(c)
    assert hosts == [] and notes == [f"bootstrap record {path} unreadable (bootstrap record {path}: "
                                     "BootstrapRecord.member_id must be a string, not a number)"]


def test_a_record_without_a_member_id_or_with_a_wrong_one_is_a_note(tmp_path: Any) -> None:
    c = _cfg(tmp_path)
    path = bootstrap.record_path(c, "m1")
    for doc in ({"cluster": "u"}, {"cluster": "u", "member_id": ""}, {"cluster": "u", "member_id": "xyz"}, [1]):
        write(path, doc)
        hosts, notes = local_hosts(c)
        assert hosts == [] and len(notes) == 1 and notes[0].startswith(f"bootstrap record {path} unreadable ("), doc
