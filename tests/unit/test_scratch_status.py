"""What ``etcdutl snapshot status -w json`` says of a snapshot the scratch etcd saved: a typed
document, read through the same checks as every record; a reply of the wrong shape is one
ScratchError naming the field, never a number read from a string."""
from __future__ import annotations

import json

import pytest

from etcd_agent.chain.errors import ScratchError
from etcd_agent.scratch.member import SnapshotStatus, snapshot_status

GOOD = {"hash": 3838428383, "revision": 151, "totalKey": 1203, "totalSize": 2101248, "version": "3.5.0"}


def test_what_etcdutl_prints_reads() -> None:
    assert snapshot_status("/x.db", json.dumps(GOOD)) == SnapshotStatus("/x.db", 151, 1203, 2101248, 3838428383)


@pytest.mark.parametrize("out, why", [
    (json.dumps(dict(GOOD, revision="151")), "EtcdutlStatus.revision must be an integer, not a string"),
    (json.dumps(dict(GOOD, totalKey=1.9)), "EtcdutlStatus.totalKey must be an integer, not a number"),
    (json.dumps(dict(GOOD, totalSize=True)), "EtcdutlStatus.totalSize must be an integer, not a boolean"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "hash"}), "EtcdutlStatus lacks its field 'hash'"),
    (json.dumps([GOOD]), "EtcdutlStatus must be a JSON object, not a list"),
    ("Error: no such file", "printed no JSON"),
])
def test_a_reply_of_the_wrong_shape_is_a_scratch_error(out: str, why: str) -> None:
    with pytest.raises(ScratchError) as ei:
        snapshot_status("/x.db", out)
    assert ei.value.message.startswith("snapshot status of /x.db") and why in ei.value.message, ei.value.message
