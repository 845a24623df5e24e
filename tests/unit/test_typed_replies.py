"""Typed step replies and the journal: what a reply from the wire (or a journal from disk) must be,
and what happens when it is not - a ProtocolError naming the field, never a KeyError/TypeError."""
from __future__ import annotations

import json
import os

import pytest

from etcd_agent.errors import EXIT_FAILED, OperationFailed, ProtocolError, error_from_json
from etcd_agent.node.replies import (
    AsideReply,
    CleanupReply,
    Decision,
    FenceReply,
    MemberSteps,
    ReceiveReply,
    RepairReply,
    RestoreReply,
    RollbackReply,
    ServingReply,
    StepReply,
    StepsReply,
    StopReply,
    UpgradeReply,
)
from etcd_agent.restore.host import journal as J
from etcd_agent.restore.host.facts import NodeFacts
from etcd_agent.restore.host.receive import Landed

W = "m1 (10.0.0.1): node fence reply"


def refused(kind: type, doc: object) -> str:
    with pytest.raises(ProtocolError) as ei:
        kind.from_json(doc, W)  # type: ignore[attr-defined]
    assert ei.value.exit_code == EXIT_FAILED and isinstance(ei.value, OperationFailed)
    assert ei.value.message.startswith(W + ": ")
    return ei.value.message


def test_a_reply_is_read_as_its_steps_type() -> None:
    r = StepReply.from_json({"step": "fence", "member": "m1", "method": "unit", "was_active": True, "at": 12}, W)
    assert r == FenceReply(step="fence", member="m1", at=12.0, method="unit", was_active=True)
    assert isinstance(r.at, float)
    # a step without fields of its own, and one this agent does not know, are the base reply
    assert type(StepReply.from_json({"step": "start", "member": "m1"}, W)) is StepReply
    assert type(StepReply.from_json({"step": "frobnicate", "member": "m1"}, W)) is StepReply


def test_every_reply_survives_the_wire_unchanged() -> None:
    replies = [
        FenceReply(step="fence", member="m1", at=1.5, method="manifest", moved="/etc/k/aside/kube-apiserver.yaml"),
        AsideReply(step="aside", member="m1", moved=None, skipped="already done"),
        ReceiveReply(step="receive", member="m1", sha256="ab" * 32, size=1 << 33),
        RestoreReply(step="restore", member="m1", argv=("etcdutl", "snapshot", "restore"), output="/d.restoring"),
        RepairReply(step="repair", member="m1", conf="kept", unit="missing", unit_created=True),
        RollbackReply(step="rollback", member="m1", did=("etcd stopped",), running=True, was_running=True),
        StopReply(step="stop", member="m1", strays=("pid 4242 (/usr/bin/etcd) listens on 10.0.0.1:2379",)),
        ServingReply(step="serving", member="m1", pid=4242, cluster_id="19df0d2c6c21d2d", revision=1_000_000_102),
    ]
    for r in replies:
        line = json.dumps(r.to_json())  # exactly what crosses: JSON text
        assert StepReply.from_json(json.loads(line), W) == r
    steps = StepsReply((MemberSteps("m1", tuple(replies[:2])), MemberSteps("m2", (), {"error": "BusyError"})))
    assert StepsReply.from_json(json.loads(json.dumps(steps.to_json())), W) == steps
    c = CleanupReply("m1", True, (Decision("/d.pre-restore-1", False, "older than the newest 1"),), ())
    assert CleanupReply.from_json(c.to_json(), W) == c


def test_none_is_left_out_and_absent_reads_as_null() -> None:
    assert AsideReply(step="aside", member="m1").to_json() == {"step": "aside", "member": "m1"}
    # what agents before the typed replies sent (explicit nulls) reads the same
    old = {"step": "aside", "member": "m1", "moved": None, "at": 1700000000.25}
    assert StepReply.from_json(old, W) == AsideReply(step="aside", member="m1", at=1700000000.25)


def test_a_missing_field_is_refused_by_name() -> None:
    assert "StepReply lacks its field 'step'" in refused(StepReply, {"member": "m1"})
    assert "FenceReply lacks its field 'member'" in refused(StepReply, {"step": "fence", "method": "unit"})
    assert "UpgradeReply lacks its field 'outcome'" in refused(UpgradeReply, {"member": "m1", "version": "3.5.16"})
    assert "StepReply.member must not be null" in refused(StepReply, {"step": "start", "member": None})


def test_a_field_of_the_wrong_type_is_refused_by_name() -> None:
    msg = refused(StepReply, {"step": "aside", "member": "m1", "moved": 5})
    assert "AsideReply.moved must be a string, not a number" in msg
    # a boolean is not an integer, nor a string a number
    assert "ReceiveReply.size must be an integer, not a boolean" in refused(
        StepReply, {"step": "receive", "member": "m1", "size": True})
    assert "StepReply.at must be a number, not a string" in refused(StepReply, {"step": "start", "member": "m1", "at": "1"})
    assert "RestoreReply.argv must be a list, not a string" in refused(
        StepReply, {"step": "restore", "member": "m1", "argv": "etcdutl snapshot restore"})
    assert "RestoreReply.argv[1] must be a string, not an object" in refused(
        StepReply, {"step": "restore", "member": "m1", "argv": ["etcdutl", {}]})
    # an unhashable step tag is a wrong type like any other, not a TypeError
    assert "StepReply.step must be a string, not a list" in refused(StepReply, {"step": ["fence"], "member": "m1"})
    assert "StepReply must be a JSON object, not a list" in refused(StepReply, [{"step": "fence"}])


def test_a_wrong_type_deep_in_a_steps_reply_names_where() -> None:
    doc = {"members": [{"member": "m1", "steps": [{"step": "stop", "member": "m1"},
                                                  {"step": "repair", "member": "m1", "conf_saved": "yes"}]}]}
    msg = refused(StepsReply, doc)
    assert "StepsReply.members" in msg and "MemberSteps.steps" in msg
    assert "RepairReply.conf_saved must be a boolean, not a string" in msg
    assert "StepsReply lacks its field 'members'" in refused(StepsReply, {})


def test_an_extra_field_is_ignored_and_not_sent_on() -> None:
    r = StepReply.from_json({"step": "fence", "member": "m1", "method": "none", "rm -rf": ["/"], "__class__": 1}, W)
    assert r == FenceReply(step="fence", member="m1", method="none")
    assert r.to_json() == {"step": "fence", "member": "m1", "method": "none"}


def test_an_error_in_a_members_steps_is_rebuilt_as_its_class() -> None:
    from etcd_agent.errors import BusyError

    ms = MemberSteps.from_json({"member": "m1", "steps": [], "error": BusyError("held").to_json()}, W)
    assert ms.error is not None and isinstance(error_from_json(ms.error), BusyError)
    assert "MemberSteps.error must be an object, not a string" in refused(MemberSteps, {"member": "m1", "error": "x"})


def _journal_doc() -> dict:  # type: ignore[type-arg]
    # as the agent before the typed journal wrote it: step records without step/member, an
    # install intention under "from"
    return {"op": "o1", "member": "m1", "backup": "/b/x.tar", "token": "t", "initial_cluster": "m1=http://a:2380",
            "sha256": None, "size": 10, "bump": None, "fence_owner": True, "new_cluster": False, "was_running": True,
            "state": "running", "created": 1.0,
            "steps": {"begin": {"was_running": True, "at": 2.0},
                      "fence": {"method": "manifest", "moved": "/aside/kube-apiserver.yaml", "at": 3.0},
                      "repair": {"conf": "rewritten", "conf_saved": True, "at": 4}},
            "pending": {"aside": {"target": "/d.pre-restore-1"}, "install": {"from": "/d.restoring"}},
            "rollback": []}


def test_a_journal_reads_its_steps_as_their_replies(tmp_path: object) -> None:
    j = J.Journal.from_json(_journal_doc(), "journal.json")
    fence = j.record(FenceReply)
    assert fence is not None and fence.moved == "/aside/kube-apiserver.yaml" and fence.member == "m1"
    rep = j.record(RepairReply)
    assert rep is not None and rep.conf_saved and not rep.conf_created
    assert j.record(AsideReply) is None and j.pending["aside"].target == "/d.pre-restore-1"
    assert "install" in j.pending and j.pending["install"] == J.Pending()
    path = os.path.join(str(tmp_path), "journal.json")
    J.save(path, j)
    again = J.load(path)
    assert again == j


def test_a_damaged_journal_is_refused_naming_the_field() -> None:
    doc = _journal_doc()
    doc["steps"]["fence"]["was_active"] = "no"
    with pytest.raises(ProtocolError) as ei:
        J.Journal.from_json(doc, "/w/journal.json")
    assert "FenceReply.was_active must be a boolean, not a string" in ei.value.message
    doc = _journal_doc()
    del doc["token"]
    with pytest.raises(ProtocolError, match="Journal lacks its field 'token'"):
        J.Journal.from_json(doc, "/w/journal.json")
    doc = _journal_doc()
    doc["steps"] = ["begin"]
    with pytest.raises(ProtocolError, match="Journal.steps must be an object, not a list"):
        J.Journal.from_json(doc, "/w/journal.json")


def test_node_facts_from_the_wire_are_checked() -> None:
    good = NodeFacts(member="m1", protocol=5, agent_version="x", etcd_version=None, etcdctl_version="3.5.16",
                     etcdutl_version=None, free_bytes=1, data_dir="/d", data_dir_state="member", work_dir="/w",
                     conf_file="/c", conf_present=True, unit_present=None, backend="process", running=False,
                     fence_ok=True, fence_detail="", identity_match=True, lineage=(("a", "b"),),
                     journal=J.JournalSummary("o", "running", None, "t", "/b", "ic", False, ("begin",)))
    doc = json.loads(json.dumps(good.to_json()))
    assert NodeFacts.from_json(doc, W) == good
    doc["free_bytes"] = "lots"
    assert "NodeFacts.free_bytes must be an integer, not a string" in refused(NodeFacts, doc)
    doc = good.to_json()
    doc["journal"] = {"op": "o"}
    assert "JournalSummary lacks its field 'state'" in refused(NodeFacts, doc)
    doc = good.to_json()
    del doc["protocol"]
    assert "NodeFacts lacks its field 'protocol'" in refused(NodeFacts, doc)


def test_a_received_record_of_an_older_agent_does_not_claim_the_trailer_was_checked() -> None:
    """``received.json`` written before ``trailer_checked`` existed: the restore step then lets
    etcdutl hash the copy itself (no ``--skip-hash-check``)."""
    old = {"sha256": "ab" * 32, "size": 4128, "ino": 7, "mtime_ns": 1, "pages": 1, "page_size": 4096,
           "codec": "raw", "wire": 4200}
    assert Landed.from_json(old, "received.json").trailer_checked is False
    assert Landed.from_json({**old, "trailer_checked": True}, "received.json").trailer_checked is True
    with pytest.raises(ProtocolError):
        Landed.from_json({**old, "trailer_checked": "yes"}, "received.json")
