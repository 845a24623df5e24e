"""Drift, zombies and learner joins on real etcd."""
import json
import subprocess
import sys

import pytest

from etcd_agent.cluster.drift import CONF_DRIFT, UNKNOWN, ZOMBIE, find_drift
from etcd_agent.cluster.health import cluster_health
from etcd_agent.member.learner import join_as_learner
from etcd_agent.waiting import MEMBERSHIP_TRANSIENT, retry_transient
from tests.harness.loopback import free_port_pairs

pytestmark = pytest.mark.integration


def cli(c, *args):
    return subprocess.run([sys.executable, "-m", "etcd_agent.cli.main", "-c", c.config_path, *args],
                          capture_output=True, text=True, timeout=180)


def test_zombie_and_drifted_conf_flagged_and_repaired(cluster_factory):
    c = cluster_factory(3)
    c.start_static()
    (port, _), = free_port_pairs(1)
    conf = c.cfg.conf_file("m2")
    with c.client() as cl:
        # added, never started (etcd refuses member add for ~5 s after its members connect)
        zombie = retry_transient(lambda: cl.add_member([f"http://127.0.0.1:{port}"]), timeout=90,
                                 what="member add", errors=MEMBERSHIP_TRANSIENT)
    with open(conf) as fh:
        text = fh.read()
    with open(conf, "w") as fh:
        fh.write(text.replace("ETCD_INITIAL_CLUSTER=", "ETCD_INITIAL_CLUSTER=ghost=http://127.0.0.1:1,", 1))

    kinds = {(f.kind, f.member) for f in find_drift(c.cfg)}
    assert (ZOMBIE, zombie.hex_id) in kinds and (CONF_DRIFT, "m2") in kinds, kinds
    st = cli(c, "--json", "status")
    flagged = [e for m in json.loads(st.stdout)["members"] for e in m["errors"]]
    assert any("conf-drift" in e and "ghost" in e for e in flagged), flagged
    assert any("not in the config" in e for e in flagged), flagged

    dry = cli(c, "repair", "--dry-run")
    assert dry.returncode == 0 and "fix: remove never-started member" in dry.stdout and "fix: re-render" in dry.stdout
    res = cli(c, "--json", "repair", "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    done = json.loads(res.stdout)["done"]
    print("\nrepair:\n" + "\n".join(done))
    assert any(zombie.hex_id in d for d in done)
    assert find_drift(c.cfg) == []
    with c.client() as cl:
        assert len(cl.members()) == 3
        ok, problems = cluster_health(c.cfg, cl)
    assert ok, problems


def test_unknown_member_is_explained_not_removed(cluster_factory):
    c = cluster_factory(3)
    c.start_static(count=2)
    # m3 joins but a config without m3 is what the repair sees
    with c.client() as cl:
        c.members[2].join(cl)
    c.members[2].wait_healthy(30)
    import dataclasses

    cfg2 = dataclasses.replace(c.cfg, members=c.cfg.members[:2])
    findings = find_drift(cfg2)
    assert [f.kind for f in findings] == [UNKNOWN]
    from etcd_agent.cluster.drift import plan_repair

    (fix,) = plan_repair(cfg2, findings)
    assert not fix.safe and "member remove" in fix.description


def test_learner_join_promoted_once_caught_up(cluster_factory):
    c = cluster_factory(4)
    c.start_static(count=3)
    with c.client() as cl:
        for i in range(200):
            cl.put(f"/learner-data/{i}", b"y" * 1024)
        info = join_as_learner(c.members[3], cl, timeout=60)
        assert not info.is_learner
        members = cl.members()
    assert len(members) == 4 and not any(m.is_learner for m in members)
    with c.client() as cl:
        assert cl.count_prefix("/learner-data/", endpoint=c.cfg.members[3].client_url) == 200
