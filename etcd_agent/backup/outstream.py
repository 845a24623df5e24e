"""The snapshot's way into the archive file as it streams from etcd: one pass, memory flat.

- ``pump``: the chunks arrive on the calling thread (gRPC reads them there); every check, the
  encryption or compression and the write run in one worker thread on batches of ~1 MiB (zstd on
  a worker of its own, ``ZSTD_THREADS``), so the hashing (which releases the GIL), the compressor
  (idem) and the disk overlap the download.
  At most ``DEPTH`` batches wait between the two: the download blocks when the writer lags.
  Within ``low_memory()`` (the daemon's own backups: the chain's base, checkpoints) a thread's
  backups use ``LOW_BATCH`` x ``LOW_DEPTH`` instead: a long-running process keeps what its peak
  took, and a daemon backup need not be as fast as cron's.
- ``FileOut``: unbuffered writes at a known position, and writeback started as the data goes
  (``POSIX_FADV_DONTNEED`` behind the write position: the kernel starts writing the range out and
  drops it from the page cache once clean). The final fsync then has little left to wait for,
  and a 1 GB backup does not push etcd's own db out of the page cache.
- ``ZstdFrames``: the snapshot compressed as independent zstd frames of ``FRAME`` plaintext bytes
  each, with their offsets kept, so the few pages the revision lookup needs are read back by
  decompressing one frame each (``read_at``), not the whole stream; and a reserved head, filled
  last with a frame of its own and a skippable frame (RFC 8878 §3.1.2) as padding, so that the
  manifest (which holds the snapshot's sha256) still comes first in the compressed tar.
"""
from __future__ import annotations

import contextlib
import os
import queue
import struct
import threading
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple, Union

from etcd_agent.errors import BackupError

Chunk = Union[bytes, memoryview]
BATCH = 1 << 20  # bytes handed to the writer thread at once
DEPTH = 4  # batches in flight between the download and the writer
LOW_BATCH = 256 << 10  # within low_memory(): ~6 MiB in flight becomes ~0.75 MiB
LOW_DEPTH = 2
WRITEBACK = 16 << 20  # start writeback every so many bytes
FRAME = 4 << 20  # zstd: plaintext bytes per independent frame (level 1's window is 512 KiB: ~0.2% of ratio lost)
ZSTD_LEVEL = 1  # chosen by measurement on Kubernetes-like data (README, bench/backup_bench.py)
# zstd's own worker thread: the writer thread then only hashes and hands each piece over, so
# hashing and compressing overlap each other and the download (hashing and zstd in one thread
# were the pipeline's slowest stage: 3.3 s per 1.2 GB against the download's 3.1-3.9 s)
ZSTD_THREADS = 1
IOV_MAX = 512  # buffers a writev takes (Linux allows 1024)
SKIPPABLE_MAGIC = 0x184D2A50
SKIPPABLE_HEADER = 8


# ---------------------------------------------------------------- the worker thread


class _Failed:
    def __init__(self) -> None:
        self.exc: Optional[BaseException] = None


_low = threading.local()


@contextlib.contextmanager
def low_memory() -> Iterator[None]:
    """This thread's backups, while inside, stream in smaller batches (``LOW_BATCH``, ``LOW_DEPTH``)."""
    was = getattr(_low, "on", False)
    _low.on = True
    try:
        yield
    finally:
        _low.on = was


def pump(chunks: Iterable[Chunk], consume: Callable[[List[Chunk]], None]) -> None:
    """Call ``consume(batch)`` in a worker thread for consecutive batches of ``chunks``, in order.
    The first exception of either side is raised here, after the worker has stopped."""
    low = getattr(_low, "on", False)
    batch_bytes, depth = (LOW_BATCH, LOW_DEPTH) if low else (BATCH, DEPTH)
    q: "queue.Queue[Optional[List[Chunk]]]" = queue.Queue(depth)
    failed = _Failed()

    def work() -> None:
        while True:
            batch = q.get()
            if batch is None:
                return
            if failed.exc is None:
                try:
                    consume(batch)
                except BaseException as exc:  # handed to the calling thread below
                    failed.exc = exc

    worker = threading.Thread(target=work, name="backup-writer", daemon=True)
    worker.start()
    source = iter(chunks)
    try:
        batch: List[Chunk] = []
        size = 0
        for chunk in source:
            batch.append(chunk)
            size += len(chunk)
            if size >= batch_bytes:
                if failed.exc is not None:
                    break  # the writer refused the stream: stop downloading
                q.put(batch)
                batch, size = [], 0
        if batch and failed.exc is None:
            q.put(batch)
    finally:
        q.put(None)
        worker.join()
        close = getattr(source, "close", None)
        if close is not None:
            close()  # a generator left early (the writer failed): ends the download now
    if failed.exc is not None:
        raise failed.exc


# ---------------------------------------------------------------- the file


class FileOut:
    """Writes to ``fd`` from its current position on, starting writeback as it goes."""

    def __init__(self, fd: int, pos: int = 0) -> None:
        self.fd = fd
        self.pos = pos
        self._advised = pos  # writeback started up to here
        self._dropped = pos  # and asked to be dropped from the cache up to here
        os.lseek(fd, pos, os.SEEK_SET)

    def write(self, data: Chunk) -> None:
        self._write_rest(memoryview(data))
        if self.pos - self._advised >= WRITEBACK:
            self._writeback()

    def write_all(self, parts: List[Chunk]) -> None:
        """``parts`` in order, in as few system calls as the kernel allows (writev)."""
        for i in range(0, len(parts), IOV_MAX):
            group = parts[i : i + IOV_MAX]
            n = os.writev(self.fd, group)
            self.pos += n
            for p in group:  # after a short write, the rest one by one
                if n >= len(p):
                    n -= len(p)
                    continue
                self._write_rest(memoryview(p)[n:])
                n = 0
        if self.pos - self._advised >= WRITEBACK:
            self._writeback()

    def _write_rest(self, view: memoryview) -> None:
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
            self.pos += n

    def _writeback(self) -> None:
        # DONTNEED on dirty pages starts their writeback (WB_SYNC_NONE) and drops only clean ones:
        # the window just written starts going out; the one before it, written out by now, goes
        # from the cache
        os.posix_fadvise(self.fd, self._advised, self.pos - self._advised, os.POSIX_FADV_DONTNEED)
        if self._dropped < self._advised:
            os.posix_fadvise(self.fd, self._dropped, self._advised - self._dropped, os.POSIX_FADV_DONTNEED)
        self._dropped, self._advised = self._advised, self.pos

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)


# ---------------------------------------------------------------- zstd frames


def zstandard_module() -> Any:
    try:
        import zstandard
    except ImportError:
        raise BackupError("zstd archives need the Python package zstandard (pip install zstandard)") from None
    return zstandard


def compress_bound(n: int) -> int:
    """The most bytes zstd turns ``n`` bytes into, frame header included (ZSTD_COMPRESSBOUND)."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0) + 64


def skippable_frame_header(content: int) -> bytes:
    return struct.pack("<II", SKIPPABLE_MAGIC, content)


class ZstdFrames:
    """The snapshot (and the tar's tail) as independent zstd frames, written after a reserved head.

    ``write`` the snapshot's bytes, ``end_snapshot`` then ``tail`` (the tar padding and end
    blocks); ``read_at`` reads the snapshot's plaintext back from the file; ``head`` fills the
    reserved bytes with the archive's beginning (its compressed size must fit: ``head_room``)."""

    def __init__(self, out: FileOut, head_room: int, level: int = ZSTD_LEVEL) -> None:
        self._zstd = zstandard_module()
        self.out = out
        self.head_room = head_room
        self._cctx = self._zstd.ZstdCompressor(level=level, threads=ZSTD_THREADS)
        self._level = level
        self._obj: Any = None
        self._in_frame = 0  # plaintext bytes in the open frame
        self._plain = 0  # snapshot plaintext bytes so far
        # (first plaintext byte, file offset, compressed length) of every finished snapshot frame
        self.index: List[Tuple[int, int, int]] = []
        self._frame_start = out.pos
        self._cache: Tuple[int, bytes] = (-1, b"")

    def write(self, data: Chunk) -> None:
        view = memoryview(data)
        while view:
            if self._obj is None:
                self._obj = self._cctx.compressobj()
                self._frame_start, self._in_frame = self.out.pos, 0
            take = min(len(view), FRAME - self._in_frame)
            part = self._obj.compress(view[:take])
            if part:
                self.out.write(part)
            self._in_frame += take
            view = view[take:]
            if self._in_frame == FRAME:
                self._close_frame()

    def _close_frame(self) -> None:
        self.out.write(self._obj.flush())
        self.index.append((self._plain, self._frame_start, self.out.pos - self._frame_start))
        self._plain += self._in_frame
        self._obj, self._in_frame = None, 0

    def end_snapshot(self) -> None:
        if self._obj is not None:
            self._close_frame()

    def tail(self, data: bytes) -> None:
        """The rest of the tar stream, one more frame (not part of the snapshot). The compressor is
        done then: dropped, so its worker's buffers are freed before ``read_at`` decompresses
        frames (the backup's peak memory is the larger of the two phases, not their sum)."""
        self.out.write(self._cctx.compress(data))
        self._cctx = self._obj = None

    def read_at(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes of the snapshot from ``offset``, decompressed frame by frame."""
        parts: List[bytes] = []
        while n > 0 and offset < self._plain:
            k = self._frame_of(offset)
            first, _at, _length = self.index[k]
            data = self._frame(k)
            piece = data[offset - first : offset - first + n]
            if not piece:
                break
            parts.append(piece)
            offset += len(piece)
            n -= len(piece)
        return b"".join(parts)

    def _frame_of(self, offset: int) -> int:
        lo, hi = 0, len(self.index) - 1
        while lo < hi:  # the last frame starting at or before offset
            mid = (lo + hi + 1) // 2
            if self.index[mid][0] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _frame(self, k: int) -> bytes:
        if self._cache[0] == k:
            return self._cache[1]
        _first, at, length = self.index[k]
        raw = self.out.pread(length, at)
        data = self._zstd.ZstdDecompressor().decompressobj().decompress(raw)
        if len(data) > FRAME:
            raise BackupError(f"zstd frame {k} of the archive being written decompresses to {len(data)} bytes")
        self._cache = (k, bytes(data))
        return self._cache[1]

    def head(self, data: bytes) -> None:
        """Write ``data`` (compressed) into the reserved head, the rest of it a skippable frame."""
        frame = self._zstd.ZstdCompressor(level=self._level).compress(data)
        pad = self.head_room - len(frame) - SKIPPABLE_HEADER
        if pad < 0:
            raise BackupError(f"the archive's head compresses to {len(frame)} bytes, more than the "
                              f"{self.head_room} reserved for it")
        # the padding's content stays a hole in the file: zeros, no disk blocks
        os.pwrite(self.out.fd, frame + skippable_frame_header(pad), 0)
