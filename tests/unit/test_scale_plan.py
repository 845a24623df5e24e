"""The pure membership planners: what they allow, what they refuse, and what the plan says."""
import pytest

from etcd_agent.cluster.scale import MEMBERSHIP_LOCK
from etcd_agent.cluster.scaleplan import (
    ClusterView,
    decide_add,
    decide_join,
    decide_leave,
    decide_remove,
)
from etcd_agent.config import parse_text
from etcd_agent.errors import RefusedError, UsageError
from etcd_agent.etcd.client import MemberInfo

TOML = "\n".join(
    ['[cluster]\nname = "t"', '[etcd]\ndata_dir = "/var/lib/etcd/{name}.etcd"']
    + [f'[[member]]\nname = "m{i}"\nhost = "10.0.0.{i}"' for i in range(1, 6)]
)


def cfg():
    c, errors = parse_text(TOML)
    assert not errors and c is not None
    return c


def member(i, *, started=True, learner=False):
    return MemberInfo(
        id=i, name=f"m{i}" if started else "", peer_urls=(f"http://10.0.0.{i}:2380",),
        client_urls=(f"http://10.0.0.{i}:2379",) if started else (), is_learner=learner,
    )


def view(n, healthy=None, **kw):
    ms = tuple(member(i) for i in range(1, n + 1))
    return ClusterView(ms, frozenset(range(1, n + 1) if healthy is None else healthy))


def test_add_plan_names_the_lock_and_the_initial_cluster():
    p = decide_add(cfg(), view(3), "m4", None)
    assert p.peer_url == "http://10.0.0.4:2380"
    assert p.initial_cluster.endswith(",m4=http://10.0.0.4:2380") and p.initial_cluster.startswith("m1=")
    assert MEMBERSHIP_LOCK in p.steps[0] and "member add m4" in p.steps[1]


def test_add_refusals():
    c = cfg()
    with pytest.raises(RefusedError, match="need 3 healthy"):
        decide_add(c, view(3, {1, 2}), "m4", None)
    assert decide_add(c, view(3, {1, 2}), "m4", None, learner=True).learner
    with pytest.raises(RefusedError, match="already exists|already belongs"):
        decide_add(c, view(3), "m3", None)
    with pytest.raises(RefusedError, match="configured with peer URL"):
        decide_add(c, view(3), "m4", "http://10.0.0.9:2380")
    with pytest.raises(RefusedError, match="configured for member 'm2'"):
        decide_add(c, view(1), "x9", "http://10.0.0.2:2380")
    with pytest.raises(UsageError, match="give its --peer-url"):
        decide_add(c, view(3), "x9", None)
    with pytest.raises(UsageError):
        decide_add(c, view(3), "bad name", "http://10.0.0.9:2380")
    half = ClusterView(view(3).members + (member(4, started=False),), frozenset({1, 2, 3}))
    with pytest.raises(RefusedError, match="never started"):
        decide_add(c, half, "m4", None)


def test_remove_quorum_last_and_unknown():
    c = cfg()
    assert decide_remove(c, view(3), "m3").member_id == 3
    assert decide_remove(c, view(3, {1, 2}), "m3").member_id == 3  # the dead one: quorum kept
    with pytest.raises(RefusedError, match="quorum needs 2"):
        decide_remove(c, view(3, {1, 2}), "m1")
    with pytest.raises(RefusedError, match="last member"):
        decide_remove(c, view(1), "m1")
    with pytest.raises(RefusedError, match="no member 'm9'"):
        decide_remove(c, view(3), "m9")
    # an unstarted member (no name in etcd yet) is found by its configured peer URL
    half = ClusterView(view(3).members + (member(4, started=False),), frozenset({1, 2, 3}))
    assert decide_remove(c, half, "m4").member_id == 4


def test_join_checks():
    c = cfg()
    p = decide_join(c, view(3), c.member("m4"), has_data=False)
    assert not p.listed and "member add m4" in p.steps[1]
    with pytest.raises(RefusedError, match="already started"):
        decide_join(c, view(3), c.member("m3"), has_data=False)
    with pytest.raises(RefusedError, match="already holds member data"):
        decide_join(c, view(3), c.member("m4"), has_data=True)
    # 1 -> 2 is the documented incremental join
    assert decide_join(c, view(1), c.member("m2"), has_data=False)
    # 3 voters with one down: joining a 4th is fine (3 of 4 healthy once it runs), adding a
    # bare unstarted voter is not
    assert decide_join(c, view(3, {1, 2}), c.member("m4"), has_data=False)
    with pytest.raises(RefusedError):
        decide_add(c, view(3, {1, 2}), "m4", None)
    with pytest.raises(RefusedError, match="no quorum"):
        decide_join(c, view(3, {1}), c.member("m4"), has_data=False)
    half = ClusterView(view(3).members + (member(4, started=False),), frozenset({1, 2, 3}))
    assert decide_join(c, half, c.member("m4"), has_data=False).listed


def test_leave_and_reset_plans():
    c = cfg()
    p = decide_leave(c, view(3), c.member("m3"), data_exists=True, running=True, now=0.0)
    assert p.aside_dir == "/var/lib/etcd/m3.etcd.left-19700101T000000Z"
    assert not any("delete" in s for s in p.steps)
    r = decide_leave(c, view(3), c.member("m3"), data_exists=True, running=True, now=0.0, reset=True)
    assert r.aside_dir.endswith(".reset-19700101T000000Z") and "delete" in r.steps[-1]
    with pytest.raises(RefusedError, match="last member"):
        decide_leave(c, view(1), c.member("m1"), data_exists=True, running=True, now=0.0)
    with pytest.raises(RefusedError, match="quorum"):
        decide_leave(c, view(3, {2, 3}), c.member("m3"), data_exists=True, running=True, now=0.0)
    gone = decide_leave(c, view(2), c.member("m3"), data_exists=False, running=False, now=0.0)
    assert not gone.listed and gone.steps == []
