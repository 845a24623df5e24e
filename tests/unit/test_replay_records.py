"""A kept replay's result (``<kept>.json`` beside the replayed db: what a crashed restore resumes
from, what ``--from <kept>`` reads) and the records inside it (where the chain stopped, the fate of
each lease), with the replay's target: typed documents. A hostile one - a field of the wrong type,
an over-long string, a nested value, a pair of the wrong length, a field missing - is one
BackupCorrupt naming the record and the field: never a "false" read as true, never a KeyError."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Dict

import pytest

from etcd_agent.chain.check import ChainStop
from etcd_agent.errors import AgentError, BackupCorrupt
from etcd_agent.pitr.leases import LeaseFate
from etcd_agent.pitr.replay import LeaseOutcome, ReplayResult, Target

STOP = ChainStop("gap", "segment 3 is missing", 151, "/b/etcd-delta-x.seg", 150, 1_700_000_000_000)
RESULT = ReplayResult(
    "/b/.pitr/etcd-2026-12-05.db", 100, 150, datetime(2026, 12, 5, 10, 0, 1, 500000, tzinfo=timezone.utc), 70, 50, 3,
    "a gap", False, STOP, LeaseOutcome(1, 1, 0, 2, 1, (LeaseFate(0x694D8E9E05C52164, True, 30, 60, "alive"),
                                                      LeaseFate(0x1F, False, None, -1, "expired at 10:00:00"))),
    (151, 152), 152, 0, 1.5, 1.25, 40, (151,), "etcd-2026-12-05-09-00-00.tar", 90, (("stage", 0.25), ("load", 1.0)))


def doc() -> Dict[str, Any]:
    return json.loads(json.dumps(RESULT.to_json()))


def test_a_kept_result_reads_back_as_it_was_written() -> None:
    assert ReplayResult.from_json(doc(), "kept.json") == RESULT
    assert RESULT.to_json()["lost_after"]["last_good_time"] == "2023-11-14T22:13:20+00:00"  # for people, unread
    assert RESULT.to_json()["leases"]["fates"][0]["lease"] == "694d8e9e05c52164"
    assert RESULT.to_json()["phases"] == {"stage": 0.25, "load": 1.0}
    older = {k: v for k, v in doc().items() if k not in (
        "snapshot_keys", "seconds", "replay_seconds", "keys_loaded", "load_revisions", "started_from",
        "started_revision", "phases", "fixup_revisions", "snapshot_revision")}  # kept by an older agent
    got = ReplayResult.from_json(dict(older, reached_time=None, lost_after=None), "kept.json")
    assert got.phases == () and got.started_from == "" and got.reached_time is None and got.lost_after is None
    for t in (Target.newest(), Target.to_revision(5), Target.to_time(datetime(2026, 1, 1, tzinfo=timezone.utc))):
        assert Target.from_json(json.loads(json.dumps(t.to_json())), "target") == t


def _set(path: str, value: Any) -> Dict[str, Any]:
    d = doc()
    *outer, last = path.split(".")
    node: Any = d
    for k in outer:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return d


@pytest.mark.parametrize("path, value, why", [
    ("complete", "false", "ReplayResult.complete must be a boolean, not a string"),
    ("snapshot_path", ["/b/x.db"], "ReplayResult.snapshot_path must be a string, not a list"),
    ("snapshot_path", "/b/" + "x" * 5000, "ReplayResult.snapshot_path is longer than 4096 characters"),
    ("fixup_revisions", [151.5], "ReplayResult.fixup_revisions[0] must be an integer, not a number"),
    ("phases", {"stage": "0.25"}, "ReplayResult.phases must map each phase's name to its seconds"),
    ("phases", [["stage", 0.25, 1]], "ReplayResult.phases must map each phase's name to its seconds"),
    ("reached_time", "yesterday", "ReplayResult.reached_time is not an ISO-8601 time"),
    ("leases", KeyError, "ReplayResult lacks its field 'leases'"),
    ("leases.alive", KeyError, "ReplayResult.leases: LeaseOutcome lacks its field 'alive'"),
    ("leases.fates.0.lease", "f" * 2000, "ReplayResult.leases: LeaseOutcome.fates[0]: LeaseFate.lease must be up to 16"),
    ("leases.fates.0.alive", "no", "ReplayResult.leases: LeaseOutcome.fates[0]: LeaseFate.alive must be a boolean"),
    ("lost_after.at_revision", {"rev": [151]}, "ReplayResult.lost_after: ChainStop.at_revision must be an integer"),
    ("lost_after.kind", "g" * 100, "ReplayResult.lost_after: ChainStop.kind is longer than 16 characters"),
    ("lost_after.path", KeyError, "ReplayResult.lost_after: ChainStop lacks its field 'path'"),
])
def test_a_hostile_kept_result_is_backup_corrupt(path: str, value: Any, why: str) -> None:
    with pytest.raises(BackupCorrupt) as ei:
        ReplayResult.from_json(_set(path, value), "/b/.pitr/kept.db.json")
    assert ei.value.message.startswith(f"/b/.pitr/kept.db.json: {why}"), ei.value.message


@pytest.mark.parametrize("d, why", [
    ({"kind": "revision", "revision": "5"}, "Target.revision must be an integer, not a string"),
    ({"kind": "tomorrow"}, "Target.kind must be one of newest, revision, time"),
    ({"kind": "revision"}, "a revision target names its revision"),
])
def test_a_hostile_target_is_refused(d: Dict[str, Any], why: str) -> None:
    with pytest.raises(AgentError) as ei:
        Target.from_json(d, "target")
    assert ei.value.message == f"target: {why}"
