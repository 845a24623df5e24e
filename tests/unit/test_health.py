"""The daemon's pure decision, rule by rule."""
import dataclasses
import os

import pytest

from etcd_agent.daemon import health as h

BASE = h.Observation(
    member="m2", bootstrap="incremental", is_seed=False, has_data=True, conf_present=True, unit_state="active",
    local_healthy=True, cluster_reachable=True, voters=3, healthy_voters=3, self_listed=True, self_started=True,
    failures=0, ever_bootstrapped=True,
)


def obs(**kw):
    return dataclasses.replace(BASE, **kw)


@pytest.mark.parametrize(
    "changes, action",
    [
        ({}, h.NONE),
        ({"unit_state": "activating", "local_healthy": False}, h.NONE),
        # an operator's `systemctl restart etcd` is in its stop half: never replace that job
        ({"unit_state": "deactivating", "local_healthy": False, "healthy_voters": 2}, h.WAIT),
        ({"unit_state": "deactivating", "local_healthy": False, "has_data": False, "healthy_voters": 2}, h.WAIT),
        ({"local_healthy": False, "healthy_voters": 1}, h.WAIT),  # no quorum: wait, never act
        ({"unit_state": "failed", "local_healthy": False, "healthy_voters": 2}, h.RESTART),
        ({"local_healthy": False, "self_learner": True, "healthy_voters": 2}, h.PROMOTE),
        # restarting is allowed without quorum: it is how quorum comes back
        ({"unit_state": "failed", "local_healthy": False, "healthy_voters": 0, "cluster_reachable": False}, h.RESTART),
        ({"unit_state": "failed", "local_healthy": False, "healthy_voters": 2, "failures": 3}, h.REPLACE),
        # ... but replacing a corrupt member needs the others to hold quorum
        ({"unit_state": "failed", "local_healthy": False, "healthy_voters": 1, "failures": 3}, h.RESTART),
        ({"unit_state": "failed", "local_healthy": False, "self_listed": False, "voters": 2, "healthy_voters": 2}, h.WAIT),
        ({"conf_present": False}, h.RENDER),
        ({"has_data": False, "unit_state": "inactive", "local_healthy": False, "healthy_voters": 2}, h.REPLACE),
        ({"has_data": False, "unit_state": "active", "local_healthy": False, "healthy_voters": 2}, h.REPLACE),
        ({"has_data": False, "unit_state": "inactive", "local_healthy": False, "healthy_voters": 1}, h.WAIT),
        ({"has_data": False, "unit_state": "inactive", "local_healthy": False, "self_listed": False,
          "self_started": False, "voters": 2, "healthy_voters": 2}, h.JOIN),
        ({"has_data": False, "unit_state": "inactive", "local_healthy": False, "self_started": False,
          "healthy_voters": 2, "ever_bootstrapped": False}, h.JOIN),  # incremental: reuse the half-done add
        ({"has_data": False, "unit_state": "inactive", "local_healthy": False, "self_started": False,
          "healthy_voters": 2, "ever_bootstrapped": False, "bootstrap": "static"}, h.START_STATIC),
        ({"has_data": False, "unit_state": "inactive", "local_healthy": False, "cluster_reachable": False,
          "voters": 0, "healthy_voters": 0, "ever_bootstrapped": False, "bootstrap": "static"}, h.START_STATIC),
        ({"has_data": False, "unit_state": "inactive", "local_healthy": False, "cluster_reachable": False,
          "voters": 0, "healthy_voters": 0, "ever_bootstrapped": False, "is_seed": True}, h.START_SEED),
        ({"has_data": False, "unit_state": "inactive", "local_healthy": False, "cluster_reachable": False,
          "voters": 0, "healthy_voters": 0, "ever_bootstrapped": False}, h.WAIT),  # not the seed
        ({"has_data": False, "unit_state": "inactive", "local_healthy": False, "cluster_reachable": False,
          "voters": 0, "healthy_voters": 0, "is_seed": True}, h.WAIT),  # never a second cluster
        ({"has_data": False, "unit_state": "inactive", "local_healthy": False, "self_listed": False,
          "voters": 2, "healthy_voters": 2, "left": True}, h.WAIT),
    ],
)
def test_decide(changes, action):
    d = h.decide(obs(**changes))
    assert d.action == action, d.reason
    assert d.reason and d.action in h.ACTIONS


@pytest.mark.parametrize(
    "changes",
    [
        {},  # healthy member: still hands off (the restore may stop it any moment)
        {"unit_state": "inactive", "local_healthy": False, "healthy_voters": 0, "cluster_reachable": False},
        {"has_data": False, "unit_state": "inactive", "local_healthy": False, "healthy_voters": 2},  # would REPLACE
        {"unit_state": "failed", "local_healthy": False, "healthy_voters": 2, "failures": 3},  # would REPLACE
        {"conf_present": False},  # would RENDER
        {"has_data": False, "unit_state": "inactive", "local_healthy": False, "cluster_reachable": False,
         "voters": 0, "healthy_voters": 0, "ever_bootstrapped": False, "bootstrap": "static"},  # would START_STATIC
    ],
)
def test_restore_in_progress_means_wait(changes):
    """A restore marker (also one a crashed restore left) keeps the daemon's hands off, whatever
    else it sees, and the reason names the op and both ways out."""
    o = obs(restore_op="20260101T000000Z-abcd1234", restore_backup="/b/etcd-2026-01-01-00-00-00.tar", **changes)
    d = h.decide(o)
    assert d.action == h.WAIT
    assert "20260101T000000Z-abcd1234" in d.reason
    assert "etcd-agent restore --from /b/etcd-2026-01-01-00-00-00.tar --yes" in d.reason
    assert "etcd-agent restore rollback" in d.reason
    # and without the marker the same observation is acted on as before
    assert h.decide(obs(**changes)).action == h.decide(dataclasses.replace(o, restore_op="")).action


def test_unreadable_marker_still_pauses(tmp_path):
    from etcd_agent.config import parse_text
    from etcd_agent.state import markers

    cfg, errors = parse_text(
        f'[cluster]\nname = "t"\ntoken = "t"\n[[member]]\nname = "m1"\nhost = "127.0.0.1"\n'
        f'[daemon]\nstate_dir = "{tmp_path}/state"\n'
    )
    assert cfg is not None, errors
    assert markers.read_restore(cfg, "m1") is None
    markers.write_restore(cfg, "m1", "op1", "/b/x.tar")
    assert markers.read_restore(cfg, "m1").op == "op1"
    assert os.stat(markers.restore_marker_path(cfg, "m1")).st_mode & 0o777 == 0o600
    assert not markers.clear_restore(cfg, "m1", "other-op")  # another op's marker is not ours to remove
    with open(markers.restore_marker_path(cfg, "m1"), "w") as fh:
        fh.write("{not json")
    rec = markers.read_restore(cfg, "m1")
    assert rec is not None and rec.op == "?"
    assert [r.member for r in markers.read_restores(cfg)] == ["m1"]
    assert markers.clear_restore(cfg, "m1") and markers.read_restores(cfg) == []
