"""The host's operation lock: a restore or upgrade waits for this host's own backup to end
(bounded), and is refused at once by anything else. flock conflicts between two open files of
the same process, so one process plays both sides; the clock is fake (no real sleep)."""
from __future__ import annotations

from typing import Any, Optional

import pytest

from etcd_agent.errors import BusyError
from etcd_agent.state.locks import Holder, OperationLock, SessionOwner, holder_of, lock_path_for
from tests.harness.fakes import FakeClock


class ReleasingClock(FakeClock):
    """Releases ``lock`` once ``after`` seconds of sleeps have passed."""

    def __init__(self, lock: Optional[OperationLock], after: float) -> None:
        super().__init__()
        self.lock, self.after, self.t0 = lock, after, self.now

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if self.lock is not None and self.now - self.t0 >= self.after:
            self.lock.release()


def test_a_restore_waits_for_the_hosts_backup(tmp_path: Any) -> None:
    path = str(tmp_path / ".etcd-agent.lock")
    backup = OperationLock(path, "backup").acquire()
    clock = ReleasingClock(backup, after=3.0)
    restore = OperationLock(path, "restore 1", holder=Holder(owner=SessionOwner(command="restore 1"))).acquire(wait=60, clock=clock)
    assert restore.held and 3.0 <= clock.now - clock.t0 < 4.0
    rec = holder_of(str(tmp_path))
    assert rec is not None and rec.operation == "restore 1"
    restore.release()


def test_a_backup_that_does_not_end_in_time_is_named(tmp_path: Any) -> None:
    path = str(tmp_path / ".etcd-agent.lock")
    backup = OperationLock(path, "backup").acquire()
    clock = ReleasingClock(None, after=0)
    with pytest.raises(BusyError, match=r"`etcd-agent backup` from .* \(waited 5s for it to finish\); upgrade not started"):
        OperationLock(path, "upgrade").acquire(wait=5, clock=clock)
    assert 5.0 <= clock.now - clock.t0 < 6.0
    backup.release()


def test_anything_else_is_refused_at_once(tmp_path: Any) -> None:
    path = str(tmp_path / ".etcd-agent.lock")
    other = OperationLock(path, "restore 7", holder=Holder(owner=SessionOwner("restore 7", "m2", 9))).acquire()
    clock = FakeClock()
    with pytest.raises(BusyError, match=r"`etcd-agent restore 7` from m2 \(pid 9\) .*; restore 8 not started"):
        OperationLock(path, "restore 8").acquire(wait=60, clock=clock)
    assert clock.sleeps == []
    # and without wait (a backup meeting a backup): refused at once too
    other.release()
    first = OperationLock(path, "backup").acquire()
    with pytest.raises(BusyError, match="backup not started"):
        OperationLock(path, "backup").acquire(clock=clock)
    assert clock.sleeps == []
    first.release()


@pytest.mark.parametrize("record, named", [
    # what agents before the typed holder wrote: the same keys, read the same
    (b'{"host": "m2", "operation": "restore 3", "owner": {"command": "restore 3", "host": "m1", "pid": 5, '
     b'"token": "t"}, "pid": 6, "since": "2026-12-01T10:00:00Z"}\n', "`etcd-agent restore 3` from m1 (pid 5) since 2026"),
    (b"backup pid 42\n", "backup pid 42"),  # an old plain-text record
    (b'{"operation": "backup", "pid": "many"}', '{"operation": "backup", "pid": "many"}'),  # a wrong type: shown as text
    (b'["backup"]', '["backup"]'),
])
def test_a_held_locks_record_is_read_as_found(tmp_path: Any, record: bytes, named: str) -> None:
    import fcntl
    import os

    path = str(tmp_path / ".etcd-agent.lock")
    with open(path, "wb") as fh:
        fh.write(record)
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a holder that wrote this record
    try:
        rec = holder_of(str(tmp_path))
        assert rec is not None
        with pytest.raises(BusyError) as ei:
            OperationLock(path, "restore 9").acquire()
        assert named in ei.value.message and "restore 9 not started" in ei.value.message
    finally:
        os.close(fd)
    assert holder_of(str(tmp_path)) is None  # the flock decides, not the record left behind


def _gone_pid() -> int:
    """The pid of a real process that has exited (and been reaped)."""
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait(10)
    return proc.pid


def test_a_busy_refusal_names_host_command_pid_and_since_even_from_a_sparse_record(tmp_path: Any) -> None:
    # an owner record without a host (what an orchestrator that could not name itself sends):
    # the refusal still names a host, a pid and a time, from the lock's own record
    path = str(tmp_path / ".etcd-agent.lock")
    held = OperationLock(path, "restore --from x", holder=Holder(owner=SessionOwner(command="restore --from x"))).acquire()
    try:
        with pytest.raises(BusyError) as ei:
            OperationLock(path, "backup").acquire()
        import os
        import socket

        msg = ei.value.message
        assert f"`etcd-agent restore --from x` from {socket.gethostname()} (pid {os.getpid()}) since 20" in msg, msg
    finally:
        held.release()


def test_a_lock_whose_run_is_gone_is_named_stale_with_what_to_do(tmp_path: Any) -> None:
    # the orchestrator on this host died; its node session (here: this process) still holds the lock
    import os
    import socket

    path = str(tmp_path / ".etcd-agent.lock")
    dead = _gone_pid()
    held = OperationLock(path, "restore 5", holder=Holder(owner=SessionOwner("restore 5", socket.gethostname(), dead))).acquire()
    try:
        with pytest.raises(BusyError) as ei:
            OperationLock(path, "restore 6").acquire()
        msg = ei.value.message
        assert f"(pid {dead}) since" in msg and "STALE" in msg, msg
        assert f"pid {dead} is gone" in msg and f"kill {os.getpid()}" in msg, msg
    finally:
        held.release()
    # a live owner is not stale
    held = OperationLock(path, "restore 7", holder=Holder(owner=SessionOwner("restore 7", socket.gethostname(), os.getpid()))).acquire()
    try:
        with pytest.raises(BusyError) as ei:
            OperationLock(path, "restore 8").acquire()
        assert "STALE" not in ei.value.message
    finally:
        held.release()


def test_lock_busy_direct(tmp_path: Any) -> None:
    """A backup dir's lock held by a restore refuses a backup naming it; released, a backup takes it."""
    d = str(tmp_path)
    with OperationLock(lock_path_for(d), "restore"):
        with pytest.raises(BusyError, match="restore"):
            OperationLock(lock_path_for(d), "backup").acquire()
    OperationLock(lock_path_for(d), "backup").acquire().release()
