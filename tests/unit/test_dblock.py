"""member.dblock: whether etcd still holds its db, read from the real kernel's /proc/locks."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from etcd_agent.member.dblock import MAX_LOCKS, db_locked, db_path, held_in


@pytest.fixture
def data_dir(tmp_path: Path) -> str:
    d = str(tmp_path)
    os.makedirs(os.path.dirname(db_path(d)))
    with open(db_path(d), "wb") as fh:
        fh.write(b"\0" * 4096)
    return d


def test_a_flock_on_the_db_is_seen_while_held_and_gone_once_released(data_dir: str) -> None:
    assert db_locked(data_dir) is False
    fd = os.open(db_path(data_dir), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what bbolt does to a db it opens for writing
        assert db_locked(data_dir) is True
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert db_locked(data_dir) is False
        fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)  # closing the last descriptor drops the lock: what an exiting etcd does
    assert db_locked(data_dir) is False


def test_a_posix_lock_or_another_files_flock_does_not_count(data_dir: str, tmp_path: Path) -> None:
    other = os.path.join(str(tmp_path), "other")
    with open(other, "wb") as fh:
        fh.write(b"x")
    fd_other = os.open(other, os.O_RDWR)
    fd_db = os.open(db_path(data_dir), os.O_RDWR)
    try:
        fcntl.flock(fd_other, fcntl.LOCK_EX)
        fcntl.lockf(fd_db, fcntl.LOCK_EX)  # a POSIX lock: not bbolt's
        assert db_locked(data_dir) is False
    finally:
        os.close(fd_db)
        os.close(fd_other)


def test_what_cannot_be_told_is_none_not_false(data_dir: str, tmp_path: Path) -> None:
    assert db_locked(str(tmp_path / "nowhere")) is None  # no db
    assert db_locked(data_dir, locks=str(tmp_path / "no-locks")) is None
    huge = str(tmp_path / "locks")
    with open(huge, "wb") as fh:
        fh.write(b"1: FLOCK  ADVISORY  WRITE 1 00:00:1 0 EOF\n" * (MAX_LOCKS // 40 + 1))
    assert db_locked(data_dir, locks=huge) is None  # past the bound: not read on, not guessed


def test_the_lines_of_proc_locks() -> None:
    text = (b"1: POSIX  ADVISORY  WRITE 10 fd:00:77 0 EOF\n"
            b"2: FLOCK  ADVISORY  WRITE 11 fd:00:78 0 EOF\n"
            b"2: -> FLOCK  ADVISORY  WRITE 12 fd:00:79 0 EOF\n"
            b"garbage\n")
    assert held_in(text, 0xFD, 0, 78)
    assert not held_in(text, 0xFD, 0, 77)  # POSIX
    assert not held_in(text, 0xFD, 0, 79)  # only waiting for it
    assert not held_in(text, 0xFD, 1, 78)  # another device
    assert not held_in(text, 0xFD, 0, 7)
