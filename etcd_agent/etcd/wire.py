"""A minimal protobuf wire-format reader for the few etcd messages whose generated stubs are stale.

The etcd3 stubs predate fields the agent needs (``StatusResponse.errors``/``isLearner``/
``dbSizeInUse``, ``Member.isLearner``). Decoding those messages from their raw bytes with the
field numbers of etcd's ``rpc.proto`` is simpler and safer than regenerating stubs. Pure code.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Tuple, Union

Value = Union[int, bytes]


def _varint(buf: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _walk(buf: bytes) -> Iterator[Tuple[int, bool, int, int]]:
    """(field number, length-delimited?, varint value or length, end) per varint or
    length-delimited field (the bytes are ``buf[end - length : end]``); fixed-size fields are
    skipped. ValueError on what does not add up."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        num, wtype = key >> 3, key & 7
        if wtype == 0:
            val, pos = _varint(buf, pos)
            yield num, False, val, pos
        elif wtype == 2:
            ln, pos = _varint(buf, pos)
            if pos + ln > end:
                raise ValueError("truncated field")
            pos += ln
            yield num, True, ln, pos
        elif wtype in (1, 5):
            pos += 8 if wtype == 1 else 4
            if pos > end:
                raise ValueError("truncated field")
        else:
            raise ValueError(f"unsupported wire type {wtype}")


def iter_fields(buf: bytes) -> Iterator[Tuple[int, int, Value]]:
    """(field number, wire type 0 or 2, value) in order: varints as int, length-delimited as
    bytes; fixed-size fields skipped. ValueError on malformed input."""
    for num, delimited, val, at in _walk(buf):
        yield (num, 2, buf[at - val : at]) if delimited else (num, 0, val)


def signed(v: int) -> int:
    """A varint read as int64 (negative numbers are 10-byte two's complement)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def fields(buf: bytes) -> Dict[int, List[Value]]:
    """Field number -> values in order (varints as int, length-delimited as bytes)."""
    out: Dict[int, List[Value]] = {}
    for num, delimited, val, at in _walk(buf):
        out.setdefault(num, []).append(buf[at - val : at] if delimited else val)
    return out


def bytes_view(buf: bytes, num: int) -> memoryview:
    """The last length-delimited field ``num`` of ``buf`` as a view into it (no copy; empty if
    absent): for messages read by the million, such as the snapshot's 32 KiB chunks."""
    view = memoryview(buf)
    found = view[0:0]
    for n, delimited, val, at in _walk(buf):
        if n == num and delimited:
            found = view[at - val : at]
    return found


def get_int(f: Dict[int, List[Value]], num: int, default: int = 0) -> int:
    vals = f.get(num)
    v = vals[-1] if vals else default
    return v if isinstance(v, int) else default


def get_bytes(f: Dict[int, List[Value]], num: int) -> bytes:
    vals = f.get(num)
    v = vals[-1] if vals else b""
    return v if isinstance(v, bytes) else b""


def get_strings(f: Dict[int, List[Value]], num: int) -> List[str]:
    return [v.decode("utf-8", "replace") for v in f.get(num, []) if isinstance(v, bytes)]


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_field(num: int, value: Union[int, bytes, str]) -> bytes:
    """Encode one field (int as varint, bytes/str as length-delimited)."""
    if isinstance(value, int):
        return encode_varint(num << 3) + encode_varint(value)
    data = value.encode() if isinstance(value, str) else value
    return encode_varint((num << 3) | 2) + encode_varint(len(data)) + data
