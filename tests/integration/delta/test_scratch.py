"""The throwaway etcd: private dir, random loopback ports, stop by escalation, cleanup."""
import os
import pwd
import stat

import psutil
import pytest

from etcd_agent.chain.errors import ScratchError
from etcd_agent.etcd import proto
from etcd_agent.scratch.machine import PORT_RANGE
from etcd_agent.scratch.member import ScratchOptions, scratch_etcd

from .helpers import dump

pytestmark = pytest.mark.integration


def test_restore_start_stop(live, tmp_path):
    live.rpc.txn([proto.op_put(b"a", b"1"), proto.op_put(b"b", b"2")])
    snap = str(tmp_path / "full.db")
    status = live.snapshot_save(snap)
    assert status.revision == 2 and stat.S_IMODE(os.stat(snap).st_mode) == 0o600
    with scratch_etcd(snap, ScratchOptions(parent_dir=str(tmp_path), nice=10, ionice="idle")) as s:
        assert s.endpoint.startswith("http://127.0.0.1:")
        assert PORT_RANGE[0] <= s.client_port < PORT_RANGE[1] and s.peer_port == s.client_port + 1
        assert s.client_port != live.client_port
        assert stat.S_IMODE(os.stat(s.dir).st_mode) == 0o700
        assert {k: v[0] for k, v in dump(s.rpc).items()} == {b"a": b"1", b"b": b"2"}
        assert s.rpc.header().revision == 2  # restore keeps the revision
        p = psutil.Process(s.pid)
        assert p.nice() == 10 and p.ionice().ioclass == psutil.IOPRIO_CLASS_IDLE
        assert all(not k.startswith("ETCD_") for k in p.environ())
        pid, d = s.pid, s.dir
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(d)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")
def test_runs_as_etcd_user_when_root(live, tmp_path):
    try:
        etcd_uid = pwd.getpwnam("etcd").pw_uid
    except KeyError:
        pytest.fail("no etcd user (Debian's etcd-server creates it)")
    snap = str(tmp_path / "full.db")
    live.snapshot_save(snap)
    with pytest.raises(ScratchError, match="cannot reach"):  # pytest's tmp dirs are root-only
        with scratch_etcd(snap, ScratchOptions(parent_dir=str(tmp_path), user="etcd")):
            pass
    with scratch_etcd(snap, ScratchOptions(user="etcd")) as s:  # under /tmp (1777)
        assert psutil.Process(s.pid).uids().real == etcd_uid
        assert os.stat(s.data_dir).st_uid == etcd_uid
        # the result is still saved as us
        out = str(tmp_path / "out.db")
        s.snapshot_save(out)
        assert os.stat(out).st_uid == 0


def test_unknown_user_runs_as_self(live, tmp_path):
    snap = str(tmp_path / "full.db")
    live.snapshot_save(snap)
    with scratch_etcd(snap, ScratchOptions(parent_dir=str(tmp_path), user="no-such-user-xyz")) as s:
        assert psutil.Process(s.pid).uids().real == os.geteuid()


def test_bad_snapshot_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a bolt db" * 100)
    parent = tmp_path / "scratch"
    parent.mkdir()
    with pytest.raises(ScratchError, match="restoring"):
        with scratch_etcd(str(bad), ScratchOptions(parent_dir=str(parent))):
            pass
    assert os.listdir(parent) == []


def test_snapshot_save_never_overwrites(live, tmp_path):
    out = tmp_path / "x.db"
    out.write_bytes(b"keep me")
    with pytest.raises(ScratchError):
        live.snapshot_save(str(out))
    assert out.read_bytes() == b"keep me"
    assert [e for e in os.listdir(tmp_path) if e != "x.db"] == []


def test_a_bumped_restore_compacts_its_history_in_large_batches(live, tmp_path):
    """A replay waits for the compaction of the history its bumped restore marks compacted: the
    throwaway member runs it in batches of 100,000 revisions, not etcd's 1000 with a 10 ms sleep
    after each (the release lists the flag: 3.5.16 here)."""
    for i in range(50):
        live.rpc.txn([proto.op_put(b"k%02d" % (i % 5), b"v%d" % i)])
    snap = str(tmp_path / "full.db")
    live.snapshot_save(snap)
    with scratch_etcd(snap, ScratchOptions(parent_dir=str(tmp_path)), bump_revision=1000) as s:
        cmd = psutil.Process(s.pid).cmdline()
        assert "--experimental-compaction-batch-limit=100000" in cmd, cmd
        assert s.rpc.header().revision == 51 + 1000
        assert {k: v[0] for k, v in dump(s.rpc).items()} == {b"k%02d" % i: b"v%d" % (45 + i) for i in range(5)}
