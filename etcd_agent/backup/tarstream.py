"""tar, read forward and bounded: the byte stream (plain, gzip, zstd) and the header parser.

Written for ``reader`` instead of using ``tarfile``, which reads a pax header of any size into
memory, expands GNU sparse members to their full size and picks the format from the file name.
Here every extended header (pax, GNU long name) is size-checked before it is read, sparse members
and links are refused where their header is, and the caller gets each member's header with the
stream positioned at its data.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Dict, Iterator, Optional

from etcd_agent.errors import BackupCorrupt, RefusedError

BLOCK = 512
CHUNK = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class Stream:
    """The tar bytes, decompressed if need be, read forward in exact amounts; counts them."""

    def __init__(self, fh: BinaryIO, compression: str) -> None:
        self.fh = fh
        self.compression = compression
        self.pos = 0  # bytes of tar stream consumed
        self._buf = b""
        self._eof = False
        self._z: Any = None
        self._zr: Any = None
        self._pending = b""
        if compression == "gzip":
            self._z = zlib.decompressobj(31)
        elif compression == "zstd":
            import zstandard

            self._zr = zstandard.ZstdDecompressor().stream_reader(fh, read_size=1 << 16, read_across_frames=True)

    def _more(self, want: int) -> bytes:
        """Up to ``want`` new bytes (b"" at the end)."""
        if self.compression == "none":
            return self.fh.read(want)
        if self.compression == "zstd":
            try:
                return bytes(self._zr.read(want))
            except Exception as exc:  # zstandard raises ZstdError
                raise BackupCorrupt(f"zstd stream is corrupt ({exc})") from None
        while not self._eof:
            z = self._z
            if z.eof:  # one gzip member done: another may follow (gzip allows concatenation)
                rest = z.unused_data or self.fh.read(1 << 16)
                if not rest.strip(b"\0") and not self.fh.read(1):
                    self._eof = True
                    break
                self._z, self._pending = zlib.decompressobj(31), rest
                continue
            data = z.unconsumed_tail or self._pending or self.fh.read(1 << 16)
            self._pending = b""
            if not data:
                raise BackupCorrupt("gzip stream ends early (truncated)")
            try:
                out = z.decompress(data, want)
            except zlib.error as exc:
                raise BackupCorrupt(f"gzip stream is corrupt ({exc})") from None
            if out:
                return bytes(out)
        return b""

    def read(self, n: int) -> bytes:
        """Exactly ``n`` bytes, or fewer only at the end of the stream."""
        parts = [self._buf[:n]]
        have = len(parts[0])
        self._buf = self._buf[n:]
        while have < n:
            chunk = self._more(min(n - have, CHUNK))
            if not chunk:
                break
            parts.append(chunk)
            have += len(chunk)
        data = b"".join(parts)
        self.pos += len(data)
        return data

    def skip(self, n: int) -> int:
        """Skip ``n`` bytes (seek for plain tar); returns how many were there."""
        if self.compression == "none" and not self._buf:
            here = self.fh.tell()
            end = os.fstat(self.fh.fileno()).st_size
            got = max(0, min(n, end - here))
            self.fh.seek(here + got)
            self.pos += got
            return got
        done = 0
        while done < n:
            data = self.read(min(CHUNK, n - done))
            if not data:
                break
            done += len(data)
        return done


def sniff(head: bytes) -> str:
    """The container format from the first bytes: "gzip", "zstd" or "none" (a tar)."""
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    if len(head) >= 263 and head[257:262] == b"ustar":
        return "none"
    return "unknown"


# ---------------------------------------------------------------- tar headers


@dataclass
class Header:
    name: str
    type: bytes
    size: int
    linkname: str
    offset_data: int
    mtime: int = 0


def _num(field_: bytes, what: str) -> int:
    if field_ and field_[0] & 0x80:  # GNU base-256
        if field_[0] != 0x80:
            raise BackupCorrupt(f"tar header: negative or huge {what}")
        return int.from_bytes(field_[1:], "big")
    text = field_.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise BackupCorrupt(f"tar header: {what} field {text[:12]!r} is not a number") from None


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def parse_pax(data: bytes) -> Dict[str, str]:
    out: Dict[str, str] = {}
    pos = 0
    while pos < len(data):
        if not data[pos:].strip(b"\0"):
            break
        sp = data.find(b" ", pos)
        if sp < 0:
            raise BackupCorrupt("pax header: malformed record")
        try:
            length = int(data[pos:sp])
        except ValueError:
            raise BackupCorrupt("pax header: malformed record length") from None
        if length <= sp - pos or pos + length > len(data):
            raise BackupCorrupt("pax header: record length out of range")
        rec = data[sp + 1 : pos + length]
        if not rec.endswith(b"\n") or b"=" not in rec:
            raise BackupCorrupt("pax header: malformed record")
        k, v = rec[:-1].split(b"=", 1)
        out[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
        pos += length
    return out


def normalise(name: str) -> str:
    """Strip ``./`` prefixes; refuse absolute paths and ``..`` (the caller refuses the rest)."""
    if "\0" in name:
        raise RefusedError(f"member {name!r} has a NUL in its name")
    if name.startswith(("/", "\\")):
        raise RefusedError(f"member {name!r} has an absolute path")
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        raise RefusedError(f"member {name!r} contains '..'")
    while parts and parts[0] == ".":
        parts = parts[1:]
    if parts and parts[-1] == "":
        parts = parts[:-1]
    return "/".join(parts)


def headers(st: Stream, max_headers: int, max_ext_header: int) -> Iterator[Header]:
    """Yield each real member's header; extended headers (pax, GNU long name) are folded in."""
    count = 0
    pax: Dict[str, str] = {}
    longname: Optional[str] = None
    while True:
        block = st.read(BLOCK)
        if not block:
            return  # EOF at a header boundary without end blocks: accepted (some tools omit them)
        if len(block) < BLOCK:
            raise BackupCorrupt(f"archive ends inside a tar header at byte {st.pos}")
        if block == bytes(BLOCK):
            return
        count += 1
        if count > max_headers:
            raise RefusedError(f"more than {max_headers} tar headers (a backup has at most 5)")
        _check_sum(block, st.pos - BLOCK)
        typ = block[156:157]
        size = _num(block[124:136], "size")
        name = _name(block)
        if typ in _EXTENDED:
            data = _extended_data(st, typ, size, max_ext_header)
            if typ == b"L":
                longname = _text(data)
            else:
                pax.update(_pax_records(typ, data))
            continue
        if typ == b"S":
            raise RefusedError(f"member {name!r} is a GNU sparse file")
        if longname is not None:
            name, longname = longname, None
        h = _member(block, typ, name, size, pax, st.pos)
        pax = {}
        yield h


# extended header types: what each is called in an error
_EXTENDED = {b"x": "pax", b"g": "pax global", b"L": "GNU long-name", b"K": "GNU long-link"}


def _check_sum(block: bytes, at: int) -> None:
    """The header checksum, as unsigned or (old tars) signed bytes; ``at`` is the block's offset."""
    chk = _num(block[148:156], "checksum")
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    signed = sum((b - 256 if b > 127 else b) for b in block[:148]) + 8 * 32 + sum(
        (b - 256 if b > 127 else b) for b in block[156:])
    if chk not in (unsigned, signed):
        raise BackupCorrupt(f"tar header at byte {at} has a bad checksum (not a tar, or damaged)")


def _name(block: bytes) -> str:
    name = _text(block[0:100])
    if block[257:263] == b"ustar\0":  # POSIX: the prefix field extends the name
        prefix = _text(block[345:500])
        if prefix:
            name = prefix + "/" + name
    return name


def _extended_data(st: Stream, typ: bytes, size: int, max_ext_header: int) -> bytes:
    """An extended header's data, bounded; the stream is left at the next header."""
    what = _EXTENDED[typ]
    if typ == b"K":
        raise RefusedError("a GNU long-link header (links are never part of a backup)")
    if size > max_ext_header:
        raise RefusedError(f"a {what} header of {size} bytes (limit {max_ext_header})")
    data = st.read(size)
    if len(data) < size:
        raise BackupCorrupt(f"archive ends inside a {what} header")
    st.skip(-size % BLOCK)
    return data


def _pax_records(typ: bytes, data: bytes) -> Dict[str, str]:
    """The records of a pax header that apply to the next member (none from a global one)."""
    recs = parse_pax(data)
    sparse = [k for k in recs if k.startswith("GNU.sparse")]
    if sparse:
        raise RefusedError(f"a GNU sparse member ({sparse[0]})")
    if typ == b"g":
        if "path" in recs or "size" in recs:
            raise RefusedError("a pax global header that renames or resizes members")
        return {}
    return recs


def _member(block: bytes, typ: bytes, name: str, size: int, pax: Dict[str, str], offset_data: int) -> Header:
    """The member's header, with what a pax header before it overrides."""
    if "path" in pax:
        name = pax["path"]
    if "size" in pax:
        try:
            size = int(pax["size"])
        except ValueError:
            raise BackupCorrupt("pax header: size is not a number") from None
    linkname = pax.get("linkpath", _text(block[157:257]))
    try:
        mtime = int(float(pax["mtime"])) if "mtime" in pax else _num(block[136:148], "mtime")
    except ValueError:
        mtime = 0
    if size < 0:
        raise BackupCorrupt(f"member {name!r} has a negative size")
    return Header(name, typ, size, linkname, offset_data, mtime)


def refuse_type(h: Header, norm: str) -> None:
    t = h.type
    if t in (b"1", b"2"):
        raise RefusedError(f"member {h.name!r} is a link (to {h.linkname!r})")
    if t in (b"3", b"4", b"6"):
        raise RefusedError(f"member {h.name!r} is a device or fifo")
    if t == b"5":
        if norm == "":
            return
        raise RefusedError(f"member {h.name!r} is a directory")
    if t not in (b"0", b"\0"):
        raise RefusedError(f"member {h.name!r} is not a regular file (type {t.decode('latin-1')!r})")
