"""``snapshot status -w json`` (etcdctl 3.4, etcdutl 3.5) as ``etcd.tools.read_status`` takes it:
the fields the agent compares checked through a typed document (a wrong one is one BackupCorrupt
naming it), the object itself returned as the tool printed it (a manifest records it verbatim)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from etcd_agent.errors import BackupCorrupt
from etcd_agent.etcd.tools import SnapshotStatus, read_status

# printed by /opt/etcd/3.5.16/etcdutl and /usr/bin/etcdctl 3.4.23 for tests/data/snap-a.db
PRINTED = '{"hash":3379021910,"revision":3,"totalKey":10,"totalSize":20480}\n'


def test_what_the_tools_print_is_returned_as_printed() -> None:
    assert read_status("s.db", PRINTED) == {"hash": 3379021910, "revision": 3, "totalKey": 10, "totalSize": 20480}
    with_version = json.dumps({**json.loads(PRINTED), "version": "3.5.0"})  # etcdutl of some releases adds it
    assert read_status("s.db", with_version)["version"] == "3.5.0"
    assert SnapshotStatus.from_json(json.loads(PRINTED), "s") == SnapshotStatus(3379021910, 3, 10, 20480)


@pytest.mark.parametrize("doc,problem", [
    ({"hash": 1, "revision": "3", "totalKey": 10, "totalSize": 20480}, "SnapshotStatus.revision must be an integer, not a string"),
    ({"hash": 1, "revision": 3, "totalKey": 1.5, "totalSize": 20480}, "SnapshotStatus.totalKey must be an integer, not a number"),
    ({"hash": 1, "totalKey": 10, "totalSize": 20480}, "SnapshotStatus lacks its field 'revision'"),
    ({"hash": 1, "revision": -3, "totalKey": 10, "totalSize": 20480}, "SnapshotStatus.revision must be between 0 and"),
    ([3], "SnapshotStatus must be a JSON object, not a list"),
])
def test_a_wrong_field_is_one_backup_corrupt_naming_it(doc: Any, problem: str) -> None:
    with pytest.raises(BackupCorrupt) as exc:
        read_status("/b/etcd_snapshot.db", json.dumps(doc))
    assert exc.value.message.startswith(f"snapshot status of /b/etcd_snapshot.db: {problem}"), exc.value.message


def test_no_json_is_one_backup_corrupt() -> None:
    with pytest.raises(BackupCorrupt, match="printed no JSON"):
        read_status("s.db", "Error: snapshot file has wrong checksum\n")
