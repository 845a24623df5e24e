"""``<state_dir>/upgrade.json``, the upgrade's progress for the metrics endpoint: a typed document,
read bounded; a file of the previous version is read, a damaged one blanks only the upgrade gauges."""
import json
import os

import pytest

from etcd_agent.cluster.upgrade import Hop, MemberStep, UpgradePlan, _progress, read_progress
from etcd_agent.config import parse_text
from etcd_agent.daemon.metrics import AgentMetrics
from etcd_agent.errors import ProtocolError
from etcd_agent.safejson import UnsafeJson


def cfg(tmp_path):
    c, errors = parse_text(f'[[member]]\nname = "m1"\nhost = "127.0.0.1"\n[daemon]\nstate_dir = "{tmp_path}/state"\n')
    assert c is not None, errors
    return c


def gauges(m):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in m.registry.collect() for s in f.samples if s.name.startswith("etcd_agent_upgrade")}


def put(c, text):
    os.makedirs(c.daemon.state_dir, exist_ok=True)
    with open(os.path.join(c.daemon.state_dir, "upgrade.json"), "w") as fh:
        fh.write(text)


def test_a_progress_file_of_the_previous_version_is_read(tmp_path):
    c = cfg(tmp_path)
    step = {"name": "m1", "from": "3.4.23", "to": "3.5.16", "seconds": 4.2, "outcome": "rolled back"}
    put(c, json.dumps({"target": "3.5.16", "state": "failed", "total": 3, "done": 1, "steps": [step],
                       "hops": [{"from": "3.4.23", "to": "3.5.16", "members": ["m1"], "backup": None, "seconds": 9.1,
                                 "steps": [step]}], "updated": 1700000000.5}) + "\n")
    rec = read_progress(c)
    assert rec is not None and (rec.target, rec.state, rec.total, rec.done, rec.steps) == ("3.5.16", "failed", 3, 1, (step,))
    m = AgentMetrics()
    m._upgrade(c)
    assert gauges(m) == {("etcd_agent_upgrade_members_total", ()): 3.0, ("etcd_agent_upgrade_members_done", ()): 1.0,
                         ("etcd_agent_upgrade_in_progress", ()): 0.0, ("etcd_agent_upgrade_failed", ()): 1.0,
                         ("etcd_agent_upgrade_target_info", (("version", "3.5.16"),)): 1.0}


def test_the_writer_and_the_reader_agree(tmp_path):
    c = cfg(tmp_path)
    hop = Hop("3.4.23", "3.5.16", ["m1"], steps=[MemberStep("m1", "3.4.23", "3.5.16", 1.234, "upgraded")])
    _progress(c, UpgradePlan("3.5.16", {"m1": "3.4.23"}, "m1", [hop]), "hop 1: upgrading m1")
    rec = read_progress(c)
    assert rec is not None and rec.running and (rec.total, rec.done) == (1, 1)
    assert rec.steps[0] == {"name": "m1", "from": "3.4.23", "to": "3.5.16", "seconds": 1.23, "outcome": "upgraded"}


def test_a_damaged_progress_file_is_refused_naming_the_field(tmp_path):
    c = cfg(tmp_path)
    assert read_progress(c) is None
    put(c, json.dumps({"target": "3.5.16", "state": "done", "total": "3"}))
    with pytest.raises(ProtocolError, match="UpgradeProgress.total must be an integer, not a string"):
        read_progress(c)
    put(c, "[" * 50_000)
    with pytest.raises(UnsafeJson):
        read_progress(c)
