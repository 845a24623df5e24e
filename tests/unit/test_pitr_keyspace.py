"""The offline key space of a replay: last write per key, the same whether held in memory or
spilled to its SQLite file, and memory bounded by the budget whatever the chain's length."""
import os
import random
import stat

from etcd_agent.chain.segments import DELETE, PUT, Event, Txn
from etcd_agent.pitr.keyspace import KeySpace


def chain(n_revisions, seed=3):
    """Revisions of puts (some leased, some in multi-key txns) and deletes over 500 keys; and the
    expected last word on every key, computed the obvious way."""
    rng = random.Random(seed)
    live = {}  # key -> (create, version)
    last = {}
    txns = []
    for rev in range(101, 101 + n_revisions):
        keys = sorted({b"k%03d" % rng.randrange(500) for _ in range(rng.choice((1, 1, 3)))})
        evs = []
        for k in keys:
            if k in live and rng.random() < 0.2:
                del live[k]
                evs.append(Event(DELETE, k, b"", rev, 0, 0, 0))
                last[k] = (None, 0, 0, rev)
            else:
                c, v = live.get(k, (rev, 0))
                live[k] = (c, v + 1)
                lease = rng.choice((0, 0, 0x10 + rng.randrange(5)))
                value = os.urandom(rng.randrange(2000))
                evs.append(Event(PUT, k, value, rev, c, v + 1, lease))
                last[k] = (value, lease, c, rev)
        txns.append(Txn(rev, 1000 + rev, tuple(evs)))
    return txns, last


def folded(ks):
    return {c.key: (c.value, c.lease, c.create_revision, c.mod_revision) for c in ks.changes()}


def test_spilled_equals_in_memory_and_memory_stays_bounded(tmp_path):
    txns, want = chain(6000)
    big = str(tmp_path / "mem")
    small = str(tmp_path / "spill")
    os.mkdir(big, 0o700)
    os.mkdir(small, 0o700)
    budget = 256 * 1024
    with KeySpace(big) as a, KeySpace(small, memory_bytes=budget) as b:
        peak = 0
        for t in txns:
            a.apply(t)
            b.apply(t)
            peak = max(peak, b._used)
        assert not a.spilled and b.spilled and b.spills > 3
        assert peak <= budget  # spilled as soon as it went past
        path = os.path.join(small, "keyspace.sqlite")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert folded(a) == folded(b) == want
        assert list(a.leases) == list(b.leases) == sorted({e.lease for t in txns for e in t.events if e.lease})
        assert a.events == b.events == sum(len(t.events) for t in txns) and b.last_revision == txns[-1].revision
        order = [c.create_revision for c in b.changes()]
        assert order == sorted(order)  # deletes (0) first, then in creation order
    assert not os.path.exists(path)  # closing removes the file


def test_out_of_order_revision_is_refused(tmp_path):
    import pytest

    from etcd_agent.chain.errors import ReplayError

    with KeySpace(str(tmp_path)) as ks:
        ks.apply(Txn(5, 1, (Event(PUT, b"a", b"1", 5, 5, 1, 0),)))
        with pytest.raises(ReplayError):
            ks.apply(Txn(5, 1, (Event(PUT, b"a", b"2", 5, 5, 2, 0),)))


def test_the_loads_transactions_are_the_same_built_ahead_or_not(tmp_path):
    """The replay builds the load's first transactions while its throwaway member starts
    (``loadtail.Batches.prebuild``): the same transactions in the same order either way, the
    deletes in transactions of their own before the first put, never two ops on one key in one."""
    from etcd_agent.etcd.pb.rpc_pb2 import RequestOp
    from etcd_agent.pitr import loadtail

    small = loadtail.Limits(7, loadtail.LOAD_BYTES)  # many transactions out of a small chain
    txns, last = chain(300)
    restored = 150  # keys created after it and never deleted need no delete
    with KeySpace(str(tmp_path)) as ks:
        for t in txns:
            ks.apply(t)
        plain = loadtail.Batches(ks, restored, small)
        want = [[op.SerializeToString() for op in ops] for _kind, ops in plain]
        for ahead in (0, 1, 5_000, 1 << 30):
            b = loadtail.Batches(ks, restored, small)
            b.prebuild(ahead)
            got = [[op.SerializeToString() for op in ops] for _kind, ops in b]
            assert got == want, ahead
            assert b.keys == plain.keys == len(last)
    kinds = [[RequestOp.FromString(op).WhichOneof("request") for op in ops] for ops in want]
    assert len(kinds) > 10 and all(len(set(k)) == 1 for k in kinds)  # no transaction mixes the two
    first_put = next(i for i, k in enumerate(kinds) if k[0] == "request_put")
    assert all(k[0] == "request_delete_range" for k in kinds[:first_put])
    assert all(k[0] == "request_put" for k in kinds[first_put:])
    assert sum(len(k) for k in kinds[first_put:]) == sum(1 for v in last.values() if v[0] is not None)
