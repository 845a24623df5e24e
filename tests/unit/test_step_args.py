"""The arguments of the restore's node steps (``restore.host.steps``) as typed documents: what the
orchestrator sends reads (the same keyword arguments it passes to ``NodeClient.call``), and a wrong
or missing argument is one RefusedError (exit 3) naming the step and the field."""
from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from etcd_agent.errors import EXIT_REFUSED, RefusedError
from etcd_agent.node.protocol import Args
from etcd_agent.restore.host import steps as S


def wire(**kw: Any) -> Dict[str, Any]:
    """The arguments as the host reads them: JSON, as the node protocol carries them."""
    return dict(json.loads(json.dumps(kw)))


def test_what_the_orchestrator_sends_reads() -> None:
    # orchestrate.call adds member and op to every step's keyword arguments
    begin = Args(wire(member="m1", op="op1", token="t", initial_cluster="m1=https://a:2380", sha256="ab" * 32,
                      size=20512, backup="/b/x.tar", bump=None, fence_owner=True, new_cluster=False), "begin")
    assert begin.read(S.BeginArgs) == S.BeginArgs("m1", "t", "m1=https://a:2380", 20512, "/b/x.tar", "op1", "ab" * 32,
                                                   None, True, False)
    rec = Args(wire(member="m1", op="op1", sha256=None, copy_from="/b/x.tar", offset=512), "receive").read(S.ReceiveArgs)
    assert (rec.copy_from, rec.offset, rec.sha256) == ("/b/x.tar", 512, None)
    fin = Args(wire(member="m1", op="op1", member_id=None, cluster_id="cafe", ancestors=["1f", "2e"]), "finish")
    assert fin.read(S.FinishArgs).ancestors == ("1f", "2e")
    assert Args(wire(member="m1", op="op1", min_revision=7), "serving").read(S.ServingArgs).min_revision == 7
    assert Args(wire(member="m1", keep=2, dry_run=True), "cleanup").read(S.CleanupArgs) == S.CleanupArgs("m1", 2, None, True)
    assert Args(wire(member="m1"), "precheck").read(S.MemberArgs) == S.MemberArgs("m1")
    batch = Args(wire(op="op1", members=[{"member": "m1", "steps": ["fence", "halt"]}, {"member": "m2", "steps": []}]),
                 "steps")
    assert S.member_steps(batch) == [("m1", ["fence", "halt"]), ("m2", [])]


@pytest.mark.parametrize("step,doc,problem", [
    ("begin", {"member": "m1", "token": "t", "initial_cluster": "c", "size": "20512", "backup": "b"},
     "node begin: BeginArgs.size must be an integer, not a string"),
    ("begin", {"member": "m1", "token": "t", "size": 1, "backup": "b"}, "node begin: BeginArgs lacks its field 'initial_cluster'"),
    ("begin", {"member": "m1", "token": "t", "initial_cluster": "c", "size": 1, "backup": "b", "fence_owner": "yes"},
     "node begin: BeginArgs.fence_owner must be a boolean, not a string"),
    ("receive", {"member": "m1", "copy_from": "/x", "offset": "0"}, "node receive: ReceiveArgs.offset must be an integer"),
    ("finish", {"member": "m1", "ancestors": "1f"}, "node finish: FinishArgs.ancestors must be a list, not a string"),
    ("finish", {"member": "m1", "ancestors": ["1f", 2]}, "node finish: FinishArgs.ancestors[1] must be a string"),
    ("serving", {"member": 7}, "node serving: ServingArgs.member must be a string, not a number"),
    ("cleanup", {"member": "m1"}, "node cleanup: CleanupArgs lacks its field 'keep'"),
    ("steps", {"op": "x", "members": []}, "node steps: StepsArgs.members must hold 1 to"),
    ("steps", {"op": "x", "members": ["m1"]}, "node steps: StepsArgs.members[0]: MemberStepsArgs must be a JSON object"),
    ("steps", {"op": "x", "members": [{"member": "m1", "steps": "fence"}]},
     "node steps: StepsArgs.members[0]: MemberStepsArgs.steps must be a list, not a string"),
])
def test_a_wrong_or_missing_argument_is_one_refusal_naming_it(step: str, doc: Dict[str, Any], problem: str) -> None:
    kinds = {"begin": S.BeginArgs, "receive": S.ReceiveArgs, "finish": S.FinishArgs, "serving": S.ServingArgs,
             "cleanup": S.CleanupArgs, "steps": S.StepsArgs}
    with pytest.raises(RefusedError) as exc:
        Args(wire(**doc), step).read(kinds[step])
    assert exc.value.message.startswith(problem) and exc.value.exit_code == EXIT_REFUSED, exc.value.message


@pytest.mark.parametrize("members,problem", [
    ([{"member": "m1", "steps": ["rm -rf"]}], "node steps: not a simple step: rm -rf"),
    ([{"member": "m1", "steps": []}, {"member": "m1", "steps": ["fence"]}], "node steps: member m1 named twice"),
])
def test_a_batch_of_steps_still_names_only_simple_steps_each_member_once(members: List[Any], problem: str) -> None:
    with pytest.raises(RefusedError, match=problem):
        S.member_steps(Args(wire(op="x", members=members), "steps"))



def test_the_other_node_steps_arguments_are_typed_too() -> None:
    from etcd_agent.cli import nodesteps as N

    # as cluster.upgrade sends them (its timeout= is the call's, NodeClient.call keeps it; the
    # operator's --timeout reaches the host as serve_seconds)
    assert Args(wire(member="m1", to="3.5.16"), "upgrade-member").read(N.UpgradeArgs) == N.UpgradeArgs("m1", "3.5.16", 120.0)
    sent = Args(wire(member="m1", to="3.5.16", serve_seconds=300.0), "upgrade-member").read(N.UpgradeArgs)
    assert sent.serve_seconds == 300.0
    assert Args(wire(version="3.5.16"), "release-version").read(N.ReleaseArgs).version == "3.5.16"
    assert Args(wire(member="m1"), "backup").read(N.BackupArgs).member == "m1"
    assert Args({}, "backup").read(N.BackupArgs).member is None
    with pytest.raises(RefusedError, match=r"^node upgrade-member: UpgradeArgs.timeout must be a number, not a string"):
        Args(wire(member="m1", to="3.5.16", timeout="60"), "upgrade-member").read(N.UpgradeArgs)
    with pytest.raises(RefusedError, match=r"^node release-version: ReleaseArgs lacks its field 'version'"):
        Args({}, "release-version").read(N.ReleaseArgs)
