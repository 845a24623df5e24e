"""The replay's own plan is the plan ``pitr.prepare`` made and the operator was shown: when the
replay checks the chain again itself (the check it was handed has another base) and finds it
stops elsewhere - its files changed since the prepare - it refuses in one sentence naming both
revisions before anything is loaded, and a result that reaches another revision than the
prepared one is never taken as done (a kept replay of an earlier run included). A real full
backup of tests/data's etcd 3.5.16 snapshot and a chain beside it (tests/unit's hostile-chain
bed), a real scratch etcd 3.5.16 for the replays that run."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, List, Tuple

import pytest

from etcd_agent.chain.errors import ReplayError
from etcd_agent.pitr import prepare as pitr
from etcd_agent.pitr.replay import Target
from tests.unit import test_pitr_hostile_chains as plain
from tests.unit.test_pitr_hostile_chains import END, FULL

pytestmark = pytest.mark.integration


@pytest.fixture
def bed(tmp_path: Any) -> Iterator[Tuple[Any, str, List[str]]]:
    """FULL (revision 3) and its chain 4..15 in three segments (4..7, 8..10, 11..15); an etcd
    3.5.16 etcdutl for the scratch member."""
    for cfg, d, segs in plain.bed.__wrapped__(tmp_path):  # type: ignore[attr-defined]
        etcd = dataclasses.replace(cfg.etcd, etcdutl="/opt/etcd/3.5.16/etcdutl", binary="/opt/etcd/3.5.16/etcd",
                                   etcdctl="/opt/etcd/3.5.16/etcdctl")
        yield dataclasses.replace(cfg, etcd=etcd), d, segs


def _prepared(cfg: Any) -> "pitr.Prepared":
    p = pitr.prepare(cfg, FULL, Target.to_revision(END), accept_unsigned=True)
    assert p.plan.complete and p.plan.stop_revision == END, p.plan.because
    return p


def test_a_replay_whose_own_plan_stops_short_of_the_prepared_one_refuses_before_loading(bed: Any) -> None:
    cfg, d, segs = bed
    p = _prepared(cfg)
    # the check handed over has another base: the replay checks the chain again itself, and
    # finds its last segment changed since the prepare (damaged): its own plan stops at 10
    handed = dataclasses.replace(p, check=dataclasses.replace(p.check, base_revision=p.check.base_revision - 1))
    raw = bytearray(open(segs[-1], "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(segs[-1], "wb").write(bytes(raw))
    out = pitr.kept_path(cfg, p, False)
    with pytest.raises(ReplayError) as exc:
        pitr.replay_kept(cfg, handed)
    msg = exc.value.message
    print(f"\nFIGURE the replay's plan is not the prepared one: {msg}")
    assert "\n" not in msg, msg
    assert f"revision {END}" in msg and "revision 10" in msg, msg
    assert not os.path.exists(out) and not os.path.exists(out + ".json")
    work = os.path.dirname(out)
    assert not [n for n in os.listdir(work) if n.startswith("etcd-replay-")], os.listdir(work)


def test_a_kept_replay_that_reached_another_revision_is_not_taken_as_done(bed: Any) -> None:
    """An earlier run's kept replay under the prepared name whose result says it stopped short
    (its result damaged, or left by another plan): replayed again, the result the prepared one."""
    cfg, _d, _segs = bed
    p = _prepared(cfg)
    out = pitr.kept_path(cfg, p, False)
    os.makedirs(os.path.dirname(out), mode=0o700, exist_ok=True)
    path, res, reused = pitr.replay_kept(cfg, p)
    assert not reused and res.reached_revision == END
    side = json.load(open(path + ".json"))
    side.update(reached_revision=10, complete=False)
    with open(path + ".json", "w") as fh:
        json.dump(side, fh)
    path, res, reused = pitr.replay_kept(cfg, p)
    print(f"\nFIGURE a kept replay at revision 10 for a plan to {END}: reused={reused}, reached {res.reached_revision}")
    assert not reused and res.reached_revision == END and res.complete
