"""The pure skew rules: what a rolling upgrade may do in one step, and the path when it may not."""
import pytest

from etcd_agent.etcd.versions import (
    Version,
    check_cluster,
    check_step,
    parse,
    upgrade_path,
)


def step(a, b):
    return check_step(parse(a), parse(b))


def test_parse():
    assert parse("3.5.1") == Version(3, 5, 1)
    assert parse("v3.4.23") == Version(3, 4, 23)
    assert parse("3.6") == Version(3, 6, 0)
    assert parse("3.6.0-rc.1").pre == "rc.1"
    for bad in ("", "3", "x.y.z", "3.5.1.2", "3.5.a"):
        with pytest.raises(ValueError):
            parse(bad)


@pytest.mark.parametrize("a,b", [("3.4.23", "3.5.1"), ("3.4.23", "3.4.30"), ("3.5.26", "3.6.0"), ("3.5.30", "3.6.4")])
def test_allowed_steps(a, b):
    assert step(a, b).ok, step(a, b).reason


def test_same_version_is_a_no_op():
    s = step("3.5.1", "3.5.1")
    assert s.ok and "already" in s.reason


def test_downgrade_and_major_change_refused_without_a_path():
    for a, b in (("3.5.1", "3.4.23"), ("3.5.2", "3.5.1"), ("3.5.1", "4.0.0"), ("2.3.8", "3.0.0")):
        s = step(a, b)
        assert not s.ok and s.path == ()
    assert "downgrade" in step("3.5.1", "3.4.23").reason
    assert "major" in step("3.5.1", "4.0.0").reason


def test_35_to_36_needs_3526():
    s = step("3.5.25", "3.6.0")
    assert not s.ok and "3.5.26" in s.reason
    assert s.path == ("3.5.25", "3.5.26", "3.6.0")
    assert step("3.5.26", "3.6.0").ok


def test_long_jump_refused_with_multi_hop_path():
    s = step("3.4.23", "3.6.1")
    assert not s.ok and "one minor at a time" in s.reason
    assert s.path_text() == "3.4.23 -> 3.5.26 -> 3.6.1"
    assert upgrade_path(parse("3.3.0"), parse("3.5.1")) == ["3.3.0", "3.4.x", "3.5.1"]
    assert upgrade_path(parse("3.2.1"), parse("3.6.0")) == ["3.2.1", "3.3.x", "3.4.x", "3.5.26", "3.6.0"]


def test_cluster_check_lists_members_to_upgrade_and_resumes():
    c = check_cluster([("m1", "3.4.23"), ("m2", "3.4.23"), ("m3", "3.4.23")], "3.5.1")
    assert c.ok and c.to_upgrade == ("m1", "m2", "m3")
    half = check_cluster([("m1", "3.5.1"), ("m2", "3.4.23"), ("m3", "3.4.23")], "3.5.1")
    assert half.ok and half.to_upgrade == ("m2", "m3")
    done = check_cluster([("m1", "3.5.1")] * 3, "3.5.1")
    assert done.ok and done.to_upgrade == ()


def test_cluster_check_refuses_mixed_older_versions_and_long_jumps():
    mixed = check_cluster([("m1", "3.4.20"), ("m2", "3.4.23")], "3.5.1")
    assert not mixed.ok and "different older versions" in mixed.reason
    far = check_cluster([("m1", "3.4.23"), ("m2", "3.4.23")], "3.6.0")
    assert not far.ok and far.to_upgrade == () and far.path_text() == "3.4.23 -> 3.5.26 -> 3.6.0"


# ---------------------------------------------------------------- the hops of one command


def hops(current, target, via=()):
    from etcd_agent.etcd.versions import plan_hops

    return plan_hops(current, target, via)


def test_hops_through_the_operators_via_releases():
    p = hops("3.4.23", "3.5.30", ("3.5.16",))
    assert p.ok and p.hops == ("3.5.16", "3.5.30"), p.reason
    assert p.reason == "2 hops: 3.4.23 -> 3.5.16 -> 3.5.30"
    direct = hops("3.4.23", "3.5.30")
    assert direct.ok and direct.hops == ("3.5.30",)


def test_hops_add_the_concrete_release_a_rule_names():
    # 3.5 -> 3.6 needs 3.5.26+: the planner adds 3.5.26 itself (a concrete release)
    p = hops("3.5.16", "3.6.0")
    assert p.ok and p.hops == ("3.5.26", "3.6.0"), p.reason
    # the operator's own choice of the 3.5 release wins
    p = hops("3.4.23", "3.6.0", ("3.5.30",))
    assert p.ok and p.hops == ("3.5.30", "3.6.0"), p.reason
    # through a via below the gate: the gate's release is added between
    p = hops("3.4.23", "3.6.0", ("3.5.16",))
    assert p.ok and p.hops == ("3.5.16", "3.5.26", "3.6.0"), p.reason


def test_hops_refuse_what_the_operator_must_choose_or_cannot_have():
    p = hops("3.3.0", "3.5.1")
    assert not p.ok and "--via 3.4.N" in p.reason and p.hops == ()
    assert hops("3.3.0", "3.5.1", ("3.4.23",)).hops == ("3.4.23", "3.5.1")
    p = hops("3.5.16", "3.4.23")
    assert not p.ok and "downgrade" in p.reason
    p = hops("3.4.23", "3.5.30", ("3.5.30", "3.5.16"))
    assert not p.ok and "must ascend" in p.reason
    p = hops("3.4.23", "3.5.16", ("3.4.10",))
    assert not p.ok and "must ascend" in p.reason


def test_cluster_hops_resume_a_half_done_hop_and_refuse_other_mixes():
    from etcd_agent.cluster.upgrade import plan_cluster_hops
    from etcd_agent.errors import RefusedError

    fresh = plan_cluster_hops({"m1": "3.4.23", "m2": "3.4.23", "m3": "3.4.23"}, "3.5.30", ("3.5.16",))
    assert [(h.from_version, h.to_version, h.members) for h in fresh] == [
        ("3.4.23", "3.5.16", ["m1", "m2", "m3"]), ("3.5.16", "3.5.30", ["m1", "m2", "m3"])]
    # stopped in the first hop with m1 on 3.5.16: that hop resumes with the others
    half = plan_cluster_hops({"m1": "3.5.16", "m2": "3.4.23", "m3": "3.4.23"}, "3.5.30", ("3.5.16",))
    assert [(h.to_version, h.members) for h in half] == [("3.5.16", ["m2", "m3"]), ("3.5.30", ["m1", "m2", "m3"])]
    # stopped in the second hop: only the second hop remains, for the members still below it
    second = plan_cluster_hops({"m1": "3.5.30", "m2": "3.5.16", "m3": "3.5.16"}, "3.5.30", ("3.5.16",))
    assert [(h.from_version, h.to_version, h.members) for h in second] == [("3.5.16", "3.5.30", ["m2", "m3"])]
    assert plan_cluster_hops({"m1": "3.5.30"} , "3.5.30") == []
    with pytest.raises(RefusedError, match="three or more releases"):
        plan_cluster_hops({"m1": "3.4.20", "m2": "3.4.23", "m3": "3.5.16"}, "3.5.30")
    with pytest.raises(RefusedError, match="not a half-done step"):
        plan_cluster_hops({"m1": "3.5.30", "m2": "3.4.23"}, "3.5.30", ("3.5.16",))


def test_a_cluster_on_the_target_has_nothing_to_do():
    p = hops("3.5.16", "3.5.16")
    assert p.ok and p.hops == () and "already" in p.reason
    assert not hops("3.5.16", "3.5.16", ("3.5.10",)).ok  # a --via below where it stands is an operator error
