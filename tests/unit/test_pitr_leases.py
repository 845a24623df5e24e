"""The lease rule (pure)."""
from etcd_agent.chain.segments import LeaseRecord
from etcd_agent.pitr.leases import fate_of

S = 1000  # ms
T = 1_700_000_000_000


def rec(observed_s, remaining, granted=60, lid=7):
    return LeaseRecord(lid, granted, remaining, T + observed_s * S)


def test_alive_gets_the_ttl_left_at_the_target():
    f = fate_of(7, [rec(0, 50)], T + 20 * S)
    assert f.alive and f.ttl == 30


def test_expired_when_the_ttl_ran_out_before_the_target():
    f = fate_of(7, [rec(0, 10)], T + 12 * S)
    assert not f.alive
    # within the one second of TTL rounding it still counts as alive, with the minimum TTL
    f = fate_of(7, [rec(0, 10)], T + 10500)
    assert f.alive and f.ttl == 5


def test_gone_when_observed_gone():
    f = fate_of(7, [rec(0, 50), rec(5, -1, granted=-1)], T + 6 * S)
    assert not f.alive
    # but before that observation it was alive
    f = fate_of(7, [rec(0, 50), rec(5, -1, granted=-1)], T + 4 * S)
    assert f.alive and f.ttl == 46


def test_renewed_by_keepalive_between_observations():
    # at 0: 10s left; the target at 15s is past that, but at 20s it is alive with 55s left:
    # a keep-alive came in between, so it was alive at the target
    f = fate_of(7, [rec(0, 10), rec(20, 55)], T + 15 * S)
    assert f.alive and f.ttl == 60  # 60s left at most (the granted TTL)


def test_first_observed_after_the_target():
    f = fate_of(7, [rec(10, 40)], T + 5 * S)
    assert f.alive and f.ttl == 45
    f = fate_of(7, [rec(10, -1, granted=-1)], T + 5 * S)
    assert f.alive and f.ttl == 5  # keys written alive; it ended soon after: about to expire


def test_unknown_and_bounds():
    f = fate_of(8, [rec(0, 50)], T)
    assert f.alive and f.ttl is None  # no observation of lease 8
    assert fate_of(7, [rec(0, 2)], T + 1 * S).ttl == 5  # at least min_ttl
    assert fate_of(7, [rec(0, 2)], T + 1 * S, min_ttl=1).ttl == 1
    assert fate_of(7, [rec(0, 600, granted=600)], T).ttl == 600
