from etcd_agent.member.quorum import can_add, can_remove, has_quorum, quorum


def test_quorum_sizes():
    assert [quorum(n) for n in range(1, 8)] == [1, 2, 2, 3, 3, 4, 4]
    assert has_quorum(3, 2) and not has_quorum(3, 1) and not has_quorum(0, 0)


def test_add():
    assert can_add(3, 3)[0]
    ok, why = can_add(3, 2)
    assert not ok and "need 3 healthy" in why
    assert can_add(3, 2, learner=True)[0]
    assert not can_add(3, 1, learner=True)[0]
    assert can_add(1, 1)[0] and not can_add(2, 1)[0]


def test_remove():
    assert can_remove(5, 5, target_is_voter=True, target_healthy=True)[0]
    assert can_remove(3, 2, target_is_voter=True, target_healthy=False)[0]
    ok, why = can_remove(3, 2, target_is_voter=True, target_healthy=True)
    assert not ok and "quorum needs 2" in why
    assert not can_remove(1, 1, target_is_voter=True, target_healthy=True)[0]
    assert can_remove(1, 1, target_is_voter=False, target_healthy=True)[0]
