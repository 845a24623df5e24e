"""The snapshot stream of ``etcd-agent node receive`` (node protocol 7), both ends' rules.

A restore ships its snapshot to every member's host over one stream per member, beside the JSON
session (a multi-GB payload would not fit its bounded lines). What the two ends say:

- sender -> receiver, stdin: frames ``kind (1 byte) length (4 bytes, big-endian) payload``. The
  first is ``O``, the order (JSON: member, op, the lock owner's token, size, codec). A receiver can
  so be started before the restore knows what it will send (``restore.ship.Standby``: while the
  hosts pre-check), and nothing about the op or its owner's token is on a command line (``ps``).
  A stream that ends before its order was not needed: the receiver exits 0, having said nothing.
- receiver -> sender, stdout: one ``Ready`` line as soon as it can take the snapshot (lock, journal,
  codec, a locked temp file, disk room: all checked) or an error document, and it exits. The sender
  sends nothing more before every receiver is ready, so a full disk fails in a round trip, not
  after a GB.
- sender -> receiver, stdin: ``D`` carries the snapshot as sent (raw, or one zstd frame cut across D frames), at most
  ``MAX_FRAME`` bytes; ``E`` ends it: the plaintext's size and the sha256 the sender read (and
  checked against the manifest) as JSON, then end-of-file. Anything else is refused.
- receiver -> sender, stdout: one last line, ``Received`` (what it committed) or an error document.

A receiver commits nothing without the end record: a sender that stops - its own sha256 did not
match the manifest, a host failed, it died - leaves only temp files that their receivers remove.
Every length is bounded before it is read; zstd output comes in slices of at most ``SLICE`` bytes
and never past the declared size, so a decompression bomb is refused, not written.

Compression pays when the snapshot compresses (Kubernetes objects: about 5.5x at zstd level 1) and
costs CPU for nothing when it does not (encrypted values): ``choose_codec`` samples the snapshot.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterator, List, Optional, Tuple, Union

from etcd_agent.config.model import NAME_RE  # a member name, and an op id (stamp-sha-random) within it
from etcd_agent.errors import OperationFailed, RefusedError
from etcd_agent.safejson import UnsafeJson, loads
from etcd_agent.typedjson import Document, JsonObject, Text

CODECS = ("none", "zstd")
ZSTD_LEVEL = 1  # on two cores, level 1 moves the most bytes per CPU-second; higher levels gain ~3%
ORDER, DATA, END = b"O", b"D", b"E"
HEADER = struct.Struct(">cI")
MAX_FRAME = 4 << 20
MAX_END = 4096
MAX_ORDER = 4096
TOKEN_RE = re.compile(r"^[0-9a-f]{16,128}$")
SLICE = 128 << 10  # decompressed bytes per step: big buffers are fresh mmaps each time (page faults)
# level 1 uses a 512 KiB window; a frame asking for more than this is refused, not allocated
MAX_WINDOW = 8 << 20
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

ReadAt = Callable[[int, int], bytes]
ReadInto = Callable[[memoryview], int]  # fills a prefix of the view; 0 at end-of-file
Chunk = Union[bytes, memoryview]


class StreamError(OperationFailed):
    """The snapshot stream broke a rule (cut short, malformed, more than declared, wrong hash)."""


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - a dependency of the package
        raise RefusedError("the zstandard module is missing on this host (reinstall etcd-agent)") from None
    return zstandard


def require_codec(codec: str) -> None:
    """Refuse, before any data, a codec this agent cannot decode."""
    if codec not in CODECS:
        raise RefusedError(f"unknown codec {codec!r} (this agent knows {', '.join(CODECS)})")
    if codec == "zstd":
        _zstd()


# ---------------------------------------------------------------- the documents

COUNT = (0, (1 << 63) - 1)  # sizes and byte counts: non-negative, within 64 bits
MEMBER = Text(63, NAME_RE.pattern)
SHA256 = Text(64, SHA256_RE.pattern)


@dataclass(frozen=True)
class Ready(Document):
    """The receiver's first line: it holds a temp file with room for the snapshot."""

    ERROR = StreamError
    ENVELOPE = "ready"
    RANGES = {"protocol": COUNT, "free": COUNT}

    protocol: int
    codec: Annotated[str, Text(8, choices=CODECS)]
    free: int  # bytes free beside the temp file


@dataclass(frozen=True)
class Order(Document):
    """The sender's first frame: what this receiver is to take, for whom."""

    ERROR = StreamError
    RANGES = {"size": COUNT}

    member: Annotated[str, MEMBER]
    op: Annotated[str, MEMBER]
    owner: Annotated[str, Text(128, TOKEN_RE.pattern)]  # the token of the session owner that holds the host's lock
    size: int
    # any word: a codec this agent does not know is the receiver's refusal (``require_codec``)
    codec: Annotated[str, Text(16, r"[A-Za-z0-9_.-]+")]


@dataclass(frozen=True)
class End(Document):
    """The sender's last frame: the plaintext it read, checked on its side."""

    ERROR = StreamError
    RANGES = {"size": COUNT}

    size: int
    sha256: Annotated[str, SHA256]


@dataclass(frozen=True)
class Received(Document):
    """The receiver's last line: what it committed under the final name."""

    ERROR = StreamError
    ENVELOPE = "received"
    RANGES = {"size": COUNT, "wire": COUNT}

    member: Annotated[str, MEMBER]
    size: int
    sha256: Annotated[str, SHA256]
    wire: int  # stream bytes read, frames included


# ---------------------------------------------------------------- the sender's side


def data_frames(payload: Chunk) -> List[Tuple[bytes, memoryview]]:
    """(header, payload) pairs carrying ``payload``, cut at ``MAX_FRAME``; none for an empty one."""
    view = memoryview(payload)
    return [(HEADER.pack(DATA, len(view[i:i + MAX_FRAME])), view[i:i + MAX_FRAME])
            for i in range(0, len(view), MAX_FRAME)]


def end_frame(end: End) -> Tuple[bytes, memoryview]:
    return _json_frame(END, end)


def order_frame(order: Order) -> Tuple[bytes, memoryview]:
    return _json_frame(ORDER, order)


def _json_frame(kind: bytes, doc: Document) -> Tuple[bytes, memoryview]:
    body = json.dumps(doc.to_json(), sort_keys=True).encode()
    return HEADER.pack(kind, len(body)), memoryview(body)


class Encoder:
    """Plaintext in, D payloads out: the one compressor of a fan-out, shared by every host."""

    def __init__(self, codec: str, size: int) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        self.codec = codec
        self._z = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=size) if codec == "zstd" else None

    def feed(self, chunk: bytes) -> bytes:
        return chunk if self._z is None else bytes(self._z.compress(chunk))

    def flush(self) -> bytes:
        return b"" if self._z is None else bytes(self._z.flush())


@dataclass(frozen=True)
class CodecChoice:
    """How a snapshot travels, and why."""

    codec: str
    ratio: float  # of the sampled bytes at ZSTD_LEVEL
    sampled: int

    def describe(self) -> str:
        verdict = "compressed in transit" if self.codec == "zstd" else "sent as it is"
        return f"{verdict} (zstd -{ZSTD_LEVEL} shrinks a {self.sampled >> 20} MiB sample {self.ratio:.2f}x)"


def choose_codec(read_at: ReadAt, size: int, *, samples: int = 8, sample_size: int = 1 << 20,
                 min_ratio: float = 1.3) -> CodecChoice:
    """Compress ``samples`` slices spread over the snapshot: zstd when they shrink at least
    ``min_ratio`` times (below that the CPU costs more than the wire saves on two cores)."""
    n = min(sample_size, size)
    if n <= 0:
        return CodecChoice("none", 1.0, 0)
    cctx = _zstd().ZstdCompressor(level=ZSTD_LEVEL)
    raw = packed = 0
    for off in sorted({(size - n) * k // max(1, samples - 1) for k in range(samples)}):
        block = read_at(off, n)
        raw += len(block)
        packed += len(cctx.compress(block))
    ratio = raw / packed if packed else 1.0
    return CodecChoice("zstd" if ratio >= min_ratio else "none", ratio, raw)


# ---------------------------------------------------------------- the receiver's side


class FrameReader:
    """The frames of one stream, every length checked before anything is read. Data payloads are
    served from one reused buffer (a view is valid until the next call); ``end`` is set once the
    end record arrived, and nothing may follow it."""

    def __init__(self, read_into: ReadInto, what: str) -> None:
        self._read_into = read_into
        self.what = what
        self._buf = memoryview(bytearray(MAX_FRAME))
        self._start = self._stop = 0
        self.end: Optional[End] = None
        self.wire = 0

    def _fill(self, view: memoryview, where: str) -> None:
        got = 0
        while got < len(view):
            n = self._read_into(view[got:])
            if n <= 0:
                raise StreamError(f"{self.what}: the stream was cut {where} after {self.wire + got} bytes "
                                  "(the sender stopped or lost its connection); nothing kept")
            got += n
        self.wire += got

    def order(self) -> Optional[Order]:
        """The stream's first frame, the sender's order; None when the stream ended before any
        byte of it (a receiver started ahead that was not needed)."""
        head = memoryview(bytearray(HEADER.size))
        first = self._read_into(head)
        if first <= 0:
            return None
        self.wire += first
        self._fill(head[first:], "inside the order")
        kind, length = HEADER.unpack(head)
        if kind != ORDER:
            raise StreamError(f"{self.what}: the stream does not begin with the sender's order (frame {kind!r})")
        return Order.from_json(self._record(length, MAX_ORDER, "order"), f"{self.what}: order")

    def _record(self, length: int, limit: int, name: str) -> JsonObject:
        """A JSON object of ``length`` bytes, at most ``limit``, read and parsed within bounds (its
        fields unchecked: the caller reads it as its document)."""
        if not 0 < length <= limit:
            raise StreamError(f"{self.what}: an {name} of {length} bytes (at most {limit})")
        body = memoryview(bytearray(length))
        self._fill(body, f"inside the {name}")
        try:
            doc = loads(bytes(body), max_bytes=limit)
        except UnsafeJson as exc:
            raise StreamError(f"{self.what}: unreadable {name} ({exc})") from None
        if not isinstance(doc, dict):
            raise StreamError(f"{self.what}: the {name} is not an object")
        return doc

    def _next(self) -> bool:
        """The next frame: True with data in the buffer, False at the end record."""
        if self.end is not None:
            return False
        head = memoryview(bytearray(HEADER.size))
        self._fill(head, "between frames")
        kind, length = HEADER.unpack(head)
        if kind == DATA:
            if not 0 < length <= MAX_FRAME:
                raise StreamError(f"{self.what}: a data frame of {length} bytes (at most {MAX_FRAME})")
            self._fill(self._buf[:length], "inside a data frame")
            self._start, self._stop = 0, length
            return True
        if kind != END:
            raise StreamError(f"{self.what}: unknown frame kind {kind!r}")
        self.end = End.from_json(self._record(length, MAX_END, "end record"), f"{self.what}: end record")
        if self._read_into(memoryview(bytearray(1))) > 0:
            raise StreamError(f"{self.what}: data after the end record")
        return False

    def payload(self) -> Optional[memoryview]:
        """What is left of the current data frame, or the next one's; None at the end record."""
        while self._start >= self._stop:
            if not self._next():
                return None
        view = self._buf[self._start:self._stop]
        self._start = self._stop
        return view

    def read(self, n: int = -1) -> bytes:
        """File-like: up to ``n`` payload bytes, b"" at the end record (for the zstd reader)."""
        while self._start >= self._stop:
            if not self._next():
                return b""
        k = self._stop - self._start if n < 0 else min(n, self._stop - self._start)
        out = bytes(self._buf[self._start:self._start + k])
        self._start += k
        return out


class Decoder:
    """The plaintext of a stream, in slices, never more than ``size`` bytes of it; ``finish()``
    then gives the sender's end record once everything declared has arrived."""

    def __init__(self, frames: FrameReader, codec: str, size: int) -> None:
        if codec not in CODECS:
            raise RefusedError(f"{frames.what}: unknown codec {codec!r} (this agent knows {', '.join(CODECS)})")
        self.frames = frames
        self.codec = codec
        self.size = size
        self.got = 0
        self._zstd = _zstd() if codec == "zstd" else None

    def _count(self, n: int) -> None:
        self.got += n
        if self.got > self.size:
            raise StreamError(f"{self.frames.what}: more than the declared {self.size} bytes arrived "
                              f"({'a decompression bomb?' if self.codec == 'zstd' else 'refused'}); nothing kept")

    def chunks(self) -> Iterator[Chunk]:
        if self._zstd is None:
            while True:
                view = self.frames.payload()
                if view is None:
                    return
                self._count(len(view))
                yield view
        z = self._zstd
        dctx = z.ZstdDecompressor(max_window_size=MAX_WINDOW)
        try:
            for out in dctx.read_to_iter(self.frames, read_size=SLICE, write_size=SLICE):
                self._count(len(out))
                yield out
        except z.ZstdError as exc:
            raise StreamError(f"{self.frames.what}: corrupt zstd stream ({exc}); nothing kept") from None
        if self.frames.read(1):
            raise StreamError(f"{self.frames.what}: data after the end of the zstd frame")

    def finish(self) -> End:
        end = self.frames.end
        what = self.frames.what
        if end is None:
            raise StreamError(f"{what}: the stream ended without the sender's end record; nothing kept")
        if self.got != self.size or end.size != self.size:
            raise StreamError(f"{what}: {self.got} bytes arrived, {self.size} were declared and the sender "
                              f"says {end.size}; nothing kept")
        return end
