"""fs helpers on real files: exact modes whatever the umask, existing dirs never touched, bounded reads."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
from typing import Iterator, List

import pytest

from etcd_agent.errors import RefusedError
from etcd_agent.fs import NotARegularFile, ensure_private_dir, makedirs, missing_dirs, open_append, read_regular
from tests.harness.modes import umask


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a FIFO read would block forever)."""
    def expired(signum: int, frame: object) -> None:
        raise AssertionError(f"still blocked after {seconds}s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def mode(path: object) -> int:
    return stat.S_IMODE(os.stat(str(path)).st_mode)


def test_missing_dirs_outermost_first() -> None:
    have = {"/", "/a"}
    assert missing_dirs("/a/b/c", have.__contains__) == ["/a/b", "/a/b/c"]
    assert missing_dirs("/a", have.__contains__) == []


def test_makedirs_gives_each_created_dir_the_exact_mode_under_umask_000(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "a" / "b" / "c"
    with umask(0):
        created = makedirs(str(target), 0o750)
    assert created == [str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(target)]
    assert [mode(d) for d in created] == [0o750, 0o750, 0o750]
    with umask(0o077):  # and a strict umask does not narrow it either
        makedirs(str(tmp_path / "x" / "y"), 0o755)
    assert mode(tmp_path / "x") == mode(tmp_path / "x" / "y") == 0o755


def test_makedirs_never_touches_an_existing_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    assert makedirs(str(shared), 0o700) == []
    assert makedirs(str(shared / "mine"), 0o700) == [str(shared / "mine")]
    assert mode(shared) == 0o1777, "an existing dir lost its mode (the sticky bit)"
    assert mode(shared / "mine") == 0o700


def test_ensure_private_dir_creates_0700_under_umask_000(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "backups" / "etcd"
    with umask(0):
        ensure_private_dir(str(d))
    assert mode(d) == mode(d.parent) == 0o700
    ensure_private_dir(str(d))  # found private: accepted as is
    assert mode(d) == 0o700


@pytest.mark.parametrize("found", [0o1777, 0o755, 0o750, 0o701])
def test_ensure_private_dir_refuses_an_open_dir_and_leaves_its_mode(tmp_path, found: int) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "backups"
    d.mkdir()
    os.chmod(d, found)
    with pytest.raises(RefusedError) as ei:
        ensure_private_dir(str(d))
    assert ei.value.message == (
        f"{d} has mode {found:04o} but must be private (0700): it holds every Kubernetes Secret and the agent "
        f"does not change the mode of a directory it did not create, so run `chmod 700 {d}` or configure a new directory"
    )
    assert mode(d) == found


def test_ensure_private_dir_refuses_someone_elses_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() == 0:
        d = tmp_path / "theirs"
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
        owner = 65534
    else:
        d, owner = tmp_path.anchor, 0  # "/" is root's  # type: ignore[assignment]
    with pytest.raises(RefusedError, match=rf"is owned by uid {owner}, not by the agent's user \(uid {os.geteuid()}\)"):
        ensure_private_dir(str(d))


def test_ensure_private_dir_refuses_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(RefusedError, match=f"^{f} exists and is not a directory$"):
        ensure_private_dir(str(f))
    with pytest.raises(RefusedError, match=rf"^cannot create {f}/sub: File exists \({f}\)$"):
        ensure_private_dir(str(f / "sub"))


def test_open_append_new_file_gets_its_mode_existing_keeps_its_own(tmp_path) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "etcd.log"
    with umask(0), open_append(str(log), mode=0o600) as fh:
        fh.write(b"one\n")
    assert mode(log) == 0o600
    os.chmod(log, 0o640)
    with umask(0), open_append(str(log), mode=0o600) as fh:
        fh.write(b"two\n")
    assert mode(log) == 0o640 and log.read_bytes() == b"one\ntwo\n"
    (tmp_path / "link").symlink_to(log)
    with pytest.raises(OSError):
        open_append(str(tmp_path / "link"))


def test_read_regular_refuses_what_is_not_a_regular_file_without_blocking(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dev").symlink_to("/dev/null")
    cases = {str(fifo): "is a FIFO, not a regular file", "/dev/zero": "is a character device, not a regular file",
             str(tmp_path): "is a directory, not a regular file", str(tmp_path / "dev"): "is a character device, not a regular file"}
    for path, why in cases.items():
        with deadline(5), pytest.raises(NotARegularFile) as ei:
            read_regular(path, 1 << 20)
        assert ei.value.strerror == why, path


def test_read_regular_is_bounded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "big"
    f.write_bytes(b"x" * 1024)
    assert read_regular(str(f), 1024) == b"x" * 1024
    (tmp_path / "link").symlink_to(f)  # a symlink to a regular file is fine
    assert read_regular(str(tmp_path / "link"), 1024) == b"x" * 1024
    with pytest.raises(NotARegularFile) as ei:
        read_regular(str(f), 1023)
    assert ei.value.strerror == "is larger than 1023 bytes"


def test_open_regular_refuses_a_fifo_a_device_a_dir_and_a_symlink_without_blocking(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent.fs import open_regular

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_bytes(b"data")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    cases = {str(tmp_path / "fifo"): "is a FIFO, not a regular file", "/dev/zero": "is a character device, not a regular file",
             str(tmp_path): "is a directory, not a regular file"}
    for path, why in cases.items():
        with deadline(5), pytest.raises(NotARegularFile) as ei:
            open_regular(path)
        assert ei.value.strerror == why, path
    with pytest.raises(OSError) as el:
        open_regular(str(tmp_path / "link"))  # never followed: the backup dir's files are its own
    assert el.value.errno == errno.ELOOP and el.value.strerror == "is a symlink (not followed), not a regular file"
    with open_regular(str(tmp_path / "link"), follow_symlinks=True) as fh:
        assert fh.read() == b"data"
    with open_regular(str(tmp_path / "file")) as fh:  # blocking again: an ordinary reader
        assert os.get_blocking(fh.fileno()) and fh.read() == b"data"
    with pytest.raises(NotARegularFile) as eb:
        open_regular(str(tmp_path / "file"), limit=3)
    assert eb.value.strerror == "is larger than 3 bytes"


def test_a_staged_file_lands_whole_under_its_name_or_not_at_all(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent.fs import StagedFile

    d = str(tmp_path)
    with open(os.path.join(d, "snap.db"), "wb") as fh:
        fh.write(b"old")
    with umask(0):
        s = StagedFile(d, "snap.db")
    assert os.path.basename(s.path).startswith(".snap.db.") and s.path.endswith(".part")
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    s.write(b"new ")
    s.write(memoryview(b"bytes"))
    with open(os.path.join(d, "snap.db"), "rb") as fh:
        assert fh.read() == b"old"  # nothing visible under the name before the commit
    s.commit()
    with open(os.path.join(d, "snap.db"), "rb") as fh:
        assert fh.read() == b"new bytes"
    assert sorted(os.listdir(d)) == ["snap.db"] and s.size == 9
    s.discard()  # after a commit: nothing to remove
    t = StagedFile(d, "snap.db")
    t.write(b"half")
    t.discard()
    assert sorted(os.listdir(d)) == ["snap.db"]


def test_a_dead_writers_temp_goes_a_live_ones_stays(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent.fs import StagedFile, remove_stale_parts

    d = str(tmp_path)
    live = StagedFile(d, "snap.db")  # holds its flock, as a running receiver does
    for name in (".snap.db.0123456789ab.part", ".other.db.0123456789ab.part", "snap.db.part"):
        with open(os.path.join(d, name), "wb") as fh:
            fh.write(b"left by a SIGKILLed writer")
    os.symlink("/etc/passwd", os.path.join(d, ".snap.db.symlink.part"))
    nxt = StagedFile(d, "snap.db")
    assert nxt.removed == [".snap.db.0123456789ab.part"]  # only this name's, only unlocked, never a symlink
    assert os.path.exists(live.path) and os.path.exists(nxt.path)
    assert os.path.exists(os.path.join(d, ".other.db.0123456789ab.part"))
    assert os.path.lexists(os.path.join(d, ".snap.db.symlink.part")) and os.path.exists("/etc/passwd")
    live.discard()
    nxt._close()  # its writer "dies": the lock goes with the descriptor
    assert remove_stale_parts(d, "snap.db") == [os.path.basename(nxt.path)]
    assert remove_stale_parts(os.path.join(d, "gone"), "snap.db") == []


def test_a_staged_file_starts_its_writeback_as_it_grows_in_consecutive_windows(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from etcd_agent import fs

    real = fs._sync_file_range()
    assert real is not None, "Linux/glibc has sync_file_range"
    calls = []

    def record(fd: int, offset: int, n: int, flags: int) -> int:
        calls.append((offset, n, flags))
        return real(fd, offset, n, flags)  # the real call, on the real file

    monkeypatch.setattr(fs, "_SYNC_FILE_RANGE", record)
    d = str(tmp_path)
    s = fs.StagedFile(d, "snap.db")
    piece = os.urandom(1 << 20)
    for _ in range(40):
        s.write(piece)
    s.commit()
    w = fs.WRITEBACK
    assert calls == [(0, w, fs.SYNC_FILE_RANGE_WRITE), (w, w, fs.SYNC_FILE_RANGE_WRITE)]
    with open(os.path.join(d, "snap.db"), "rb") as fh:
        assert fh.read() == piece * 40


def test_a_staged_file_that_need_not_be_durable_is_neither_written_back_nor_fsynced(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore's staged snapshot: read once within this boot, then deleted. Its pages are left
    to the kernel (often dropped unwritten); the rename still happens and the file is whole."""
    from etcd_agent import fs

    synced: List[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    def no_writeback(fd: int, offset: int, n: int, flags: int) -> int:
        raise AssertionError("writeback started for a file that need not be durable")

    monkeypatch.setattr(fs, "_SYNC_FILE_RANGE", no_writeback)
    monkeypatch.setattr(fs.os, "fsync", fsync)
    d = str(tmp_path)
    s = fs.StagedFile(d, "snap.db", durable=False)
    piece = os.urandom(1 << 20)
    for _ in range(40):
        s.write(piece)
    s.commit()
    assert synced == ["dir"], "only the dir holding the new name is synced"
    with open(os.path.join(d, "snap.db"), "rb") as fh:
        assert fh.read() == piece * 40
    synced.clear()
    durable = fs.StagedFile(d, "other.db")
    durable.write(b"x")
    monkeypatch.setattr(fs, "_SYNC_FILE_RANGE", None)
    durable.commit()
    assert synced == ["file", "dir"]


def test_the_boot_id_is_this_kernels_and_nothing_else(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from etcd_agent import fs

    with open("/proc/sys/kernel/random/boot_id") as fh:
        assert fs.boot_id() == fh.read().strip()
    fake = os.path.join(str(tmp_path), "boot_id")
    for text, want in ((b"not-a-uuid\n", None), (b"\xff" * 36, None), (b"", None),
                       (b"0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n", "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")):
        with open(fake, "wb") as fh:
            fh.write(text)
        monkeypatch.setattr(fs, "BOOT_ID", fake)
        assert fs.boot_id() == want
    monkeypatch.setattr(fs, "BOOT_ID", os.path.join(str(tmp_path), "absent"))
    assert fs.boot_id() is None


def test_fsync_path_syncs_a_regular_file_through_a_read_only_descriptor_it_closes(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file another writer made (a copy, etcdctl, a download): synced through a read-only
    descriptor, closed after; a FIFO, a dir or a symlink under the name is refused without
    blocking, and nothing is synced."""
    import fcntl

    from etcd_agent import fs

    synced: List[tuple] = []  # type: ignore[type-arg]
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE))
        real_fsync(fd)

    monkeypatch.setattr(fs.os, "fsync", fsync)
    d = str(tmp_path)
    path = os.path.join(d, "download.tar")
    with open(path, "wb") as fh:
        fh.write(b"x" * 4096)
    before = sorted(os.listdir("/proc/self/fd"))
    fs.fsync_path(path)
    assert synced == [(path, os.O_RDONLY)]
    assert sorted(os.listdir("/proc/self/fd")) == before, "the descriptor is closed"
    os.mkfifo(os.path.join(d, "fifo"))
    os.symlink(path, os.path.join(d, "link"))
    synced.clear()
    with deadline(5):
        for name in ("fifo", "link", "."):
            with pytest.raises(NotARegularFile):
                fs.fsync_path(os.path.join(d, name))
    assert synced == []
    with pytest.raises(FileNotFoundError):
        fs.fsync_path(os.path.join(d, "gone"))
