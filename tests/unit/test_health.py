"""The daemon's pure decision, rule by rule."""
import dataclasses

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
        ({"local_healthy": False, "healthy_voters": 1}, h.WAIT),  # no quorum: wait, never act
        ({"unit_state": "failed", "local_healthy": False, "healthy_voters": 2}, h.RESTART),
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
