"""The replay's defragment is done when the replayed db is mostly free pages (a live db's full
backup or checkpoint, its overwritten values freed) and skipped when it is mostly in use (a lean
checkpoint and a short tail): either way the saved db holds exactly the live store at the target.
Real etcd 3.5.16 on loopback."""
import os

import pytest

from etcd_agent.pitr.replay import Target
from etcd_agent.pitr.replayrun import replay

from .helpers import assert_replayed, dump, put
from .test_watch_replay import finish, full_backup, restored, started

pytestmark = pytest.mark.integration

KEYS = 200
VALUE = 8 * 1024


def _chain_of_a_short_tail(live, tmp_path, base):
    segdir = str(tmp_path / "seg")
    w = started(live, base, segdir, close_bytes=32 * 1024)
    for i in range(10):
        put(live.rpc, b"tail/%02d" % i, b"t" * 100)
    finish(w, live)
    return sorted(os.path.join(segdir, n) for n in os.listdir(segdir) if n.endswith(".seg"))


def _replayed(live, tmp_path, full, base, paths):
    final = live.rpc.header().revision
    want = dump(live.rpc)
    res = replay(full, paths, Target.newest(), output=str(tmp_path / "pitr.db"))
    assert res.complete and res.reached_revision == final
    with restored(res.snapshot_path) as s:
        assert_replayed(dump(s.rpc), want, base, final)
    return res, dict(res.phases)


def test_a_db_mostly_free_is_defragmented(live, tmp_path):
    r = live.rpc
    for _ in range(5):  # every value overwritten four times, then compacted: its old pages free
        for i in range(KEYS):
            put(r, b"big/%03d" % i, os.urandom(VALUE))
    r.compact(r.header().revision, physical=True)
    full, base = full_backup(live, str(tmp_path))
    res, phases = _replayed(live, tmp_path, full, base, _chain_of_a_short_tail(live, tmp_path, base))
    assert "defragment" in phases and "defragment skipped (mostly in use)" not in phases, phases
    assert os.path.getsize(res.snapshot_path) * 2 < os.path.getsize(full), (
        os.path.getsize(res.snapshot_path), os.path.getsize(full))


def test_a_db_mostly_in_use_is_not_rewritten(live, tmp_path):
    r = live.rpc
    for i in range(KEYS):  # written once: nothing to free
        put(r, b"big/%03d" % i, os.urandom(VALUE))
    full, base = full_backup(live, str(tmp_path))
    _res, phases = _replayed(live, tmp_path, full, base, _chain_of_a_short_tail(live, tmp_path, base))
    assert "defragment skipped (mostly in use)" in phases and "defragment" not in phases, phases
