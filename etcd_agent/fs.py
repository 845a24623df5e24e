"""File-system helpers every part of the agent uses: atomic writes, dirs with exact modes, bounded reads.

Every file and directory the agent creates gets an explicit mode, whatever the process umask: a
restore run from a shell with ``umask 000`` must not leave a conf dir another local user can swap
files in. And the agent never changes the mode of a directory it did not create: ``/tmp`` given
as a backup dir once lost its sticky bit to a "tightening" chmod.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
import tempfile
from typing import Any, BinaryIO, Callable, Iterator, List, Optional, Union

from etcd_agent.errors import RefusedError

log = logging.getLogger(__name__)

# StagedFile starts the writeback of every so many bytes as they are written, so the disk works
# while the data still streams in and ``commit``'s fsync has little left to wait for (left to
# the kernel, nothing goes out before gigabytes are dirty, and then all at once, at the fsync)
WRITEBACK = 16 << 20
SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages out; wait for nothing else


def _sync_file_range() -> Optional[Callable[[int, int, int, int], int]]:
    import ctypes  # here, not at the top: every agent process imports this module, few write big files

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None  # not glibc/Linux: commit's fsync does it all
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_UNRESOLVED: Any = object()
_SYNC_FILE_RANGE: Any = _UNRESOLVED  # libc's, looked up at the first writeback (None: there is none)


def start_writeback(fd: int, offset: int, n: int) -> None:
    """Ask the kernel to start writing ``n`` bytes of ``fd`` from ``offset`` out now. The pages
    stay in the page cache (a restore reads them next); only a hint: commit's fsync still counts."""
    global _SYNC_FILE_RANGE
    if _SYNC_FILE_RANGE is _UNRESOLVED:
        _SYNC_FILE_RANGE = _sync_file_range()
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, n, SYNC_FILE_RANGE_WRITE)


F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux; the name is in fcntl from Python 3.10
PIPE_SIZE = 1 << 20  # a bulk stream's pipe: fewer, larger reads and writes (the default is 64 KiB)


def enlarge_pipe(fd: int, size: int = PIPE_SIZE) -> None:
    """Make the pipe ``fd`` holds an end of ``size`` bytes big, if the kernel lets us."""
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, size)
    except OSError:
        pass  # not a pipe, or over /proc/sys/fs/pipe-max-size: the default size works too


def write_atomic(path: str, data: bytes, *, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename (+ fsync of the dir)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StagedFile:
    """A large file written beside its final name, as ``.<name>.<random>.part`` (0600), flocked for
    as long as its writer lives, its writeback started as it grows (``WRITEBACK``); ``commit()``
    fsyncs it, renames it over the final name and fsyncs the dir; ``discard()`` removes it.
    Creating one first removes the temp files of writers that died without cleaning up (SIGKILL,
    power loss: nothing holds their lock any more). The dir's own flock makes that sweep and the
    new file's creation one step, so a live writer's file is never taken for a dead one's.

    ``durable=False``: the data is neither written back early nor fsynced; the rename and the dir
    are. For a file that is read soon and then deleted, whose reader trusts it only within the
    kernel boot that wrote it (``boot_id``) and checks it again after a restart: the restore's
    staged snapshot. Its pages are then often dropped unwritten, and the disk, which the
    restore's own ``snapshot restore`` needs, is spared a gigabyte per member."""

    def __init__(self, directory: str, name: str, *, durable: bool = True) -> None:
        self.durable = durable
        self.directory = directory
        self.final = os.path.join(directory, name)
        with dir_locked(directory):
            self.removed = _remove_stale(directory, name)
            self.path = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.part")
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
        self.size = 0
        self._written_back = 0  # writeback started up to here

    def write(self, data: Union[bytes, memoryview]) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self.size += len(data)
        if self.durable and self.size - self._written_back >= WRITEBACK:
            start_writeback(self._fd, self._written_back, self.size - self._written_back)
            self._written_back = self.size

    def commit(self) -> None:
        """fsync (when durable), rename over the final name (still locked: no sweep can take it),
        fsync the dir."""
        if self.durable:
            os.fsync(self._fd)
        os.rename(self.path, self.final)
        self._close()
        fsync_dir(self.directory)

    def discard(self) -> None:
        """Remove it (unlinked while still locked, then closed); safe to call after commit."""
        if self._fd >= 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._close()

    def _close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> Optional[str]:
    """This kernel boot's id (a new one after every restart; containers share their host's), or
    None where the kernel does not say. Data that was never fsynced is what was written only
    while this id stays the same."""
    try:
        with open(BOOT_ID, "rb") as fh:
            raw = fh.read(64).strip().decode("ascii")
    except (OSError, UnicodeDecodeError):
        return None
    return raw if len(raw) == 36 and all(c in "0123456789abcdef-" for c in raw) else None


def remove_stale_parts(directory: str, name: str) -> List[str]:
    """Remove the ``StagedFile`` temps of ``name`` in ``directory`` whose writers are gone."""
    try:
        with dir_locked(directory):
            return _remove_stale(directory, name)
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def dir_locked(directory: str) -> Iterator[None]:
    """The dir's own flock, held for a short step that must not interleave with another process's
    (a listing and a create; a small record's read-modify-write): microseconds, so it blocks."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove_stale(directory: str, name: str) -> List[str]:
    removed = []
    for entry in os.listdir(directory):
        if not (entry.startswith(f".{name}.") and entry.endswith(".part")):
            continue
        path = os.path.join(directory, entry)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, or a symlink: not one of ours
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # locked: its writer lives
        else:
            os.unlink(path)
            removed.append(entry)
            log.info("removed %s, left by a writer that died", path)
        finally:
            os.close(fd)
    return removed


def missing_dirs(path: str, exists: Callable[[str], bool]) -> List[str]:
    """The components of absolute ``path`` that do not exist yet, outermost first (pure; ``exists``
    answers for the host concerned, so the systemd backend can ask a remote one)."""
    out: List[str] = []
    p = path.rstrip("/") or "/"
    while p != "/" and not exists(p):
        out.append(p)
        p = os.path.dirname(p)
    return out[::-1]


def makedirs(path: str, mode: int) -> List[str]:
    """Create ``path`` and every missing parent with exactly ``mode``, whatever the umask.

    Directories that already exist are never touched (their mode is the operator's business);
    one that appears meanwhile (another process) counts as existing. Returns the dirs created,
    outermost first.
    """
    created: List[str] = []
    for d in missing_dirs(os.path.abspath(path), os.path.isdir):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            if os.path.isdir(d):
                continue  # made by someone else meanwhile: not ours, so not touched
            raise
        # mkdir applies the umask; set the exact mode on the dir we just made, never through a
        # symlink swapped in meanwhile
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        created.append(d)
    return created


def ensure_private_dir(directory: str) -> None:
    """``directory`` exists, is owned by this process's user and open to nobody else (0700).

    Missing: created 0700. Existing: checked, never chmodded - the agent does not change the mode
    of a directory it did not create (that is how ``/tmp`` once lost its sticky bit). Backups hold
    every Kubernetes Secret, and a dir others can write lets them plant a tarball that ``restore
    --from latest`` would pick, so a dir that is group/other-accessible or someone else's is
    refused with one sentence saying how to fix it.
    """
    try:
        if makedirs(directory, 0o700):
            return
        st = os.stat(directory)
    except OSError as exc:
        if os.path.lexists(directory) and not os.path.isdir(directory):
            raise RefusedError(f"{directory} exists and is not a directory") from None
        where = f" ({exc.filename})" if exc.filename and exc.filename != directory else ""
        raise RefusedError(f"cannot create {directory}: {exc.strerror or exc}{where}") from None
    me = os.geteuid()
    if st.st_uid != me:
        raise RefusedError(
            f"{directory} is owned by uid {st.st_uid}, not by the agent's user (uid {me}): it holds "
            f"every Kubernetes Secret, so use a directory of the agent's own"
        )
    if st.st_mode & 0o077:
        raise RefusedError(
            f"{directory} has mode {stat.S_IMODE(st.st_mode):04o} but must be private (0700): it holds every "
            f"Kubernetes Secret and the agent does not change the mode of a directory it did not create, "
            f"so run `chmod 700 {directory}` or configure a new directory"
        )


def open_append(path: str, *, mode: int = 0o600) -> BinaryIO:
    """Open ``path`` for appending; a new file gets exactly ``mode`` (an existing one keeps its own).

    Never follows a symlink at ``path``.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
        os.fchmod(fd, mode)  # os.open applies the umask
    except FileExistsError:
        fd = os.open(path, flags)
    return os.fdopen(fd, "ab")


class NotARegularFile(OSError):
    """What ``open_regular`` and ``read_regular`` refuse: not a regular file (a FIFO, device,
    socket, directory; a symlink unless followed), or larger than the limit."""


def regular_fd(path: str, *, follow_symlinks: bool = False, limit: Optional[int] = None) -> int:
    """``path`` opened for reading (a raw descriptor, blocking) if it is a regular file, else
    NotARegularFile (an OSError).

    The one way the agent opens a file it did not just write itself (the backup dir, the bucket's
    staging, the restore record): a FIFO planted there would block a plain ``open`` for ever (and
    with it the daemon's tick, holding the operation lock), a device would feed endless bytes.
    Opened O_NONBLOCK (a FIFO's open returns at once), checked with fstat on the open descriptor
    (no swap between check and use), then made blocking again for ordinary reads. A symlink is
    refused (ELOOP) unless ``follow_symlinks``; ``limit``: a file larger than that is refused
    (the caller still reads with a bound: the file may grow).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags if follow_symlinks else flags | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise NotARegularFile(errno.ELOOP, "is a symlink (not followed), not a regular file", path) from None
        raise
    try:
        st = os.fstat(fd)
        kind = _kind(st.st_mode)
        if kind:
            raise NotARegularFile(errno.EINVAL, f"is {kind}, not a regular file", path)
        if limit is not None and st.st_size > limit:
            raise NotARegularFile(errno.EFBIG, f"is larger than {_size(limit)}", path)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str, *, follow_symlinks: bool = False, limit: Optional[int] = None) -> BinaryIO:
    """``regular_fd`` as a buffered binary file object."""
    return os.fdopen(regular_fd(path, follow_symlinks=follow_symlinks, limit=limit), "rb")


def read_regular(path: str, limit: int, *, follow_symlinks: bool = True) -> bytes:
    """The content of regular file ``path`` (``open_regular``), at most ``limit`` bytes: a larger
    one is NotARegularFile (EFBIG), whatever ``st_size`` claims (the read itself is bounded)."""
    with open_regular(path, follow_symlinks=follow_symlinks) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise NotARegularFile(errno.EFBIG, f"is larger than {_size(limit)}", path)
    return data


def fsync_path(path: str) -> None:
    """The bytes of regular file ``path`` on disk: for a file another writer made and closed (a
    copy, etcdctl, a download), before it is linked or renamed into place. Opened read-only with
    ``regular_fd`` (a FIFO, device or symlink put under the name is refused, never blocked on);
    on Linux fsync through any descriptor flushes the file's dirty pages and its inode."""
    fd = regular_fd(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    """'' for a regular file, else what it is, as a noun phrase."""
    if stat.S_ISREG(mode):
        return ""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n} bytes"


def size_text(n: float) -> str:
    """``n`` bytes for people: 512 B, 3.4 MiB, 1.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover
