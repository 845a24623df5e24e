"""The writer's stream: the worker thread (order, errors both ways), the file (writev, writeback),
zstd frames read back at any offset, the reserved head and its skippable padding."""
from __future__ import annotations

import hashlib
import os
import random
import threading
from typing import Any, Iterator, List

import pytest
import zstandard

from etcd_agent.backup import outstream
from etcd_agent.backup.outstream import FRAME, FileOut, ZstdFrames, compress_bound, pump
from etcd_agent.backup.snapcheck import StreamCheck
from etcd_agent.errors import BackupCorrupt, BackupError


def _text(n: int, seed: int = 7) -> bytes:
    """Compressible, not constant: lines of words and numbers."""
    r = random.Random(seed)
    words = [b"pod", b"namespace", b"kube-system", b"image", b"registry.k8s.io", b"uid", b"status", b"Running"]
    out = bytearray()
    while len(out) < n:
        out += b" ".join(r.choice(words) for _ in range(8)) + b" %d\n" % r.getrandbits(40)
    return bytes(out[:n])


def _pieces(data: bytes, sizes: List[int]) -> Iterator[memoryview]:
    view = memoryview(data)
    pos = i = 0
    while pos < len(data):
        yield view[pos : pos + sizes[i % len(sizes)]]
        pos += sizes[i % len(sizes)]
        i += 1


def test_pump_keeps_order_and_batches() -> None:
    data = _text(5 << 20)
    got: List[bytes] = []
    sizes: List[int] = []
    pump(_pieces(data, [1, 32768, 7, 65536]), lambda batch: (got.extend(bytes(c) for c in batch),
                                                            sizes.append(sum(len(c) for c in batch))))
    assert b"".join(got) == data
    assert all(s >= outstream.BATCH for s in sizes[:-1])  # ~1 MiB handed over at a time


def test_pump_stops_the_download_when_the_writer_fails() -> None:
    pulled = [0]
    closed = threading.Event()

    def chunks() -> Iterator[bytes]:
        try:
            while True:
                pulled[0] += 1
                yield bytes(32768)
        finally:
            closed.set()

    def consume(batch: List[Any]) -> None:
        raise BackupCorrupt("snapshot: not an etcd snapshot")

    with pytest.raises(BackupCorrupt, match="not an etcd snapshot"):
        pump(chunks(), consume)
    assert closed.is_set()  # the stream was closed, not left open
    # stopped after the batches already queued, not at the end of an endless stream
    assert pulled[0] * 32768 <= (outstream.DEPTH + 3) * outstream.BATCH


def test_pump_raises_the_downloads_error_after_the_writer_stopped() -> None:
    consumed: List[int] = []

    def chunks() -> Iterator[bytes]:
        yield bytes(2 << 20)
        raise ConnectionError("etcd went away")

    with pytest.raises(ConnectionError):
        pump(chunks(), lambda batch: consumed.append(len(batch)))
    assert consumed == [1]  # what came before the error was written; then the worker ended


def test_file_out_writes_many_small_parts_in_order(tmp_path: Any) -> None:
    data = _text(3 << 20)
    parts = list(_pieces(data, [3, 5, 1000]))  # far more than one writev takes
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        out = FileOut(fd, 100)
        out.write_all(parts)
        out.write(b"end")
        assert out.pos == 100 + len(data) + 3
        assert os.pread(fd, len(data) + 3, 100) == data + b"end"
    finally:
        os.close(fd)


def _framed(tmp_path: Any, data: bytes, room: int = 4096) -> Any:
    fd = os.open(tmp_path / "z", os.O_RDWR | os.O_CREAT, 0o600)
    frames = ZstdFrames(FileOut(fd, room), room)
    for piece in _pieces(data, [32768, 1, 100000]):
        frames.write(piece)
    frames.end_snapshot()
    frames.tail(b"TAIL" * 100)
    return fd, frames


def test_zstd_frames_read_back_anywhere(tmp_path: Any) -> None:
    data = _text(3 * FRAME + 12345)
    fd, frames = _framed(tmp_path, data)
    try:
        assert [f[0] for f in frames.index] == [0, FRAME, 2 * FRAME, 3 * FRAME]
        for off, n in ((0, 100), (FRAME - 10, 20), (2 * FRAME - 1, FRAME + 2), (len(data) - 5, 100), (len(data), 4)):
            assert frames.read_at(off, n) == data[off : off + n]
        frames.head(b"HEAD" * 256)
        with open(tmp_path / "z", "rb") as fh:
            whole = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True).readall()
        assert whole == b"HEAD" * 256 + data + b"TAIL" * 100  # the skippable padding is skipped
    finally:
        os.close(fd)


def test_zstd_head_must_fit_its_room(tmp_path: Any) -> None:
    fd, frames = _framed(tmp_path, _text(1000), room=64)
    try:
        with pytest.raises(BackupError, match="more than the 64 reserved"):
            frames.head(os.urandom(1000))
    finally:
        os.close(fd)


def test_compress_bound_holds_for_incompressible_data() -> None:
    c = zstandard.ZstdCompressor(level=outstream.ZSTD_LEVEL)
    for n in (0, 1, 1000, 128 << 10, 300 << 10):
        assert len(c.compress(os.urandom(n))) <= compress_bound(n)


def test_stream_check_hashes_once_for_both_sums() -> None:
    """etcd's trailer (sha256 of all but the last 32 bytes) and the file's sha256, from one state."""
    snap = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "snap-a.db"), "rb").read()
    for sizes in ([1], [31], [32], [33], [4096, 17], [len(snap)]):
        c = StreamCheck()
        for piece in _pieces(snap, sizes):
            c.update(piece)
        facts = c.finish()
        assert facts.trailer_checked and facts.sha256 == c.sha256 == hashlib.sha256(snap).hexdigest()
