"""The heavy tiers on xdist workers (tests/harness/xdistbeds.py): files whose beds share a prefix
go to one worker together, every file stays on one worker, the long ones are dealt first."""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Dict, List

from xdist.remote import Producer

from tests.harness import xdistbeds
from tests.multihost import conftest as multihost

TIER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "multihost")


class Worker:
    """What the scheduler sends a worker (the indexes of its collection), nothing else."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.gateway = SimpleNamespace(id=name)
        self.sent: List[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indexes: List[int]) -> None:
        assert not self.shutting_down, f"{self.name}: work sent after its shutdown"
        self.sent += indexes

    def shutdown(self) -> None:
        self.shutting_down = True


def collection() -> List[str]:
    files = sorted(n for n in os.listdir(TIER) if n.startswith("test_") and n.endswith(".py"))
    assert set(multihost.SHARED_FILES) <= set(files), "a SHARED file is gone: the list is stale"
    return [f"tests/multihost/{f}::test_{i}" for f in files for i in range(3)]


def test_shared_bed_files_go_to_one_worker_and_no_file_is_split() -> None:
    config = SimpleNamespace(getvalue=lambda name: ["2*popen"] if name == "tx" else None,
                             option=SimpleNamespace(loadscopereorder=False))
    quiet = SimpleNamespace(loadscopesched=Producer("sched", enabled=False))
    sched = xdistbeds.BedScheduling(config, quiet, multihost.unit_of)  # type: ignore[arg-type]
    ids = collection()
    workers = [Worker("gw0"), Worker("gw1")]
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, ids)
    sched.schedule()
    done: Dict[str, int] = {w.name: 0 for w in workers}
    while any(done[w.name] < len(w.sent) for w in workers):
        for w in workers:  # each worker finishes its next test in turn, asking for more work
            if done[w.name] < len(w.sent):
                sched.mark_test_complete(w, w.sent[done[w.name]])  # type: ignore[arg-type]
                done[w.name] += 1
    on = {ids[i].split("::")[0]: w.name for w in workers for i in w.sent}
    assert sorted(sum((w.sent for w in workers), [])) == list(range(len(ids))), "a test sent twice or never"
    for w in workers:
        files = [ids[i].split("::")[0] for i in w.sent]
        assert all(on[f] == w.name for f in files), "a file's tests on both workers"
    assert len({on[f"tests/multihost/{f}"] for f in multihost.SHARED_FILES}) == 1, on
    assert {w.name for w in workers} == set(on.values()), "a worker left idle"


def test_long_units_dealt_first_each_in_its_own_order() -> None:
    items = [SimpleNamespace(path=os.path.join(TIER, nid.split("::")[0].rsplit("/", 1)[1]), nodeid=nid)
             for nid in collection()]
    other = SimpleNamespace(path="/elsewhere/test_x.py", nodeid="test_x")
    items.insert(5, other)
    xdistbeds.deal(items, multihost.__file__, multihost.unit_of, multihost.LONG)  # type: ignore[arg-type]
    assert items[5] is other, "another tier's test moved"
    mine = [it for it in items if it is not other]
    units = [multihost.unit_of(os.path.basename(it.path)) for it in mine]
    firsts = list(dict.fromkeys(units))
    assert firsts[:len(multihost.LONG)] == list(multihost.LONG), firsts
    assert all(units.index(u) + units.count(u) - 1 == max(i for i, v in enumerate(units) if v == u) for u in firsts), \
        "a unit's tests not together"
    for f in {it.path for it in mine}:
        names = [it.nodeid for it in mine if it.path == f]
        assert names == sorted(names), f"{f}: its tests reordered"
