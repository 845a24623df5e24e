"""Delta segment files: every etcd event after a full backup, in revision order, chained by sha256.

A segment is written beside the full backups as
``etcd-delta-<start revision>-<end revision>-<UTC end time, ms>.seg`` (revisions zero-padded to
16 digits, so a listing sorts by revision; an idle segment that holds no events has end = start - 1).

Layout (all integers big-endian)::

    magic       8 bytes  b"ETCDDSEG"
    header      u32 length + UTF-8 JSON (SegmentHeader; <= 64 KiB)
    record*     u8 type + u32 length + payload
                  1 TXN    u64 revision, i64 time_ms, u32 n_events, u8 flags, then n events:
                           u8 kind (0 put, 1 delete), u32 key_len, u32 value_len,
                           u64 create_revision, u64 version, i64 lease, key, value
                           (a delete has value_len = create_revision = version = lease = 0;
                           every event's mod_revision is the record's revision)
                  2 LEASE  i64 lease_id, i64 granted_ttl, i64 remaining_ttl, i64 observed_ms
                           (remaining_ttl -1: no such lease any more; granted_ttl -1: unknown)
                  3 FOOTER UTF-8 JSON (SegmentFooter; <= 64 KiB), exactly once, last
    footer_at   u64 offset of the FOOTER record (lets a listing read the footer cheaply)
    digest      32 bytes sha256 of every byte before it

One TXN record is one etcd revision: all events of a transaction stay together. Revisions are
contiguous: a watch on the whole keyspace sees every revision (etcd bumps the revision only for
a write that changes at least one key, and each change is an event), so the first TXN of a
segment is its header's ``start_revision`` and each next one is +1.

The chain: a segment's header names the previous segment's sha256 (of the whole file, what
``sha256sum`` prints; "" for the first segment after the full backup), the chain id, its
sequence number and the full backup's revision (``base_revision``). ``check_chain`` follows the
links from the base and stops at the first gap, corrupt file or broken link.

Times are wall-clock Unix milliseconds at which the watcher received the revision (within
milliseconds of the commit while the watch is live). Revisions received while catching up after a
(re)connect carry flag ``CATCHUP``: their time is only an upper bound of the commit time.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, BinaryIO, Dict, Iterable, List, Optional, Sequence, Tuple

from etcd_agent.fs import fsync_dir

from .errors import DeltaError, SegmentCorrupt

log = logging.getLogger(__name__)

FORMAT = "etcd-agent-delta"
FORMAT_VERSION = 1
MAGIC = b"ETCDDSEG"
DIGEST = 32
REC_TXN, REC_LEASE, REC_FOOTER = 1, 2, 3
PUT, DELETE = 0, 1
FLAG_CATCHUP = 0x01

MAX_JSON = 64 * 1024
# one record is one revision; etcd's own request limit is --max-request-bytes (1.5 MiB default,
# raised in some clusters), so a revision far beyond that is damage, not data
MAX_RECORD = 256 * 1024 * 1024
MAX_SEGMENT = 1024 * 1024 * 1024

_REC = struct.Struct(">BI")
_TXN = struct.Struct(">QqIB")
_EV = struct.Struct(">BIIQQq")
_LEASE = struct.Struct(">qqqq")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_TRAILER = 8 + DIGEST

NAME_RE = re.compile(r"^etcd-delta-(\d{1,19})-(\d{1,19})-(\d{8}T\d{6}(?:\.\d{3})?Z)\.seg$")
TEMP_PREFIX = ".delta-open-"  # not ".etcd-*.partial": the backup's remove_partials must not touch it


# ---------------------------------------------------------------- the data


@dataclass(frozen=True)
class Event:
    """One watch event. A delete carries only its key (and the revision)."""

    kind: int
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class Txn:
    """The events of one revision, and when the watcher received them."""

    revision: int
    time_ms: int
    events: Tuple[Event, ...]
    catchup: bool = False


@dataclass(frozen=True)
class LeaseRecord:
    """What LeaseTimeToLive said about a lease at ``observed_ms``."""

    lease_id: int
    granted_ttl: int
    remaining_ttl: int
    observed_ms: int

    @property
    def alive(self) -> bool:
        return self.remaining_ttl >= 0


def _req(d: Dict[str, Any], key: str, kind: type) -> Any:
    v = d.get(key)
    if kind is int and isinstance(v, bool):
        raise ValueError(f"{key} must be an integer")
    if not isinstance(v, kind):
        raise ValueError(f"{key} must be {kind.__name__}, got {type(v).__name__}")
    return v


@dataclass(frozen=True)
class SegmentHeader:
    chain_id: str
    seq: int
    base_revision: int
    start_revision: int
    prev_sha256: str
    start_time_ms: int
    cluster_id: int = 0
    member_id: int = 0
    endpoint: str = ""

    def to_json(self) -> Dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "chain_id": self.chain_id,
            "seq": self.seq,
            "base_revision": self.base_revision,
            "start_revision": self.start_revision,
            "prev_sha256": self.prev_sha256,
            "start_time_ms": self.start_time_ms,
            "cluster_id": f"{self.cluster_id:x}",
            "member_id": f"{self.member_id:x}",
            "endpoint": self.endpoint,
        }

    @classmethod
    def from_json(cls, d: Any) -> "SegmentHeader":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not an {FORMAT} header")
        version = _req(d, "format_version", int)
        if version < 1 or version > FORMAT_VERSION:
            raise ValueError(f"format version {version} not supported (max {FORMAT_VERSION})")
        h = cls(
            chain_id=_req(d, "chain_id", str),
            seq=_req(d, "seq", int),
            base_revision=_req(d, "base_revision", int),
            start_revision=_req(d, "start_revision", int),
            prev_sha256=_req(d, "prev_sha256", str),
            start_time_ms=_req(d, "start_time_ms", int),
            cluster_id=int(_req(d, "cluster_id", str) or "0", 16),
            member_id=int(_req(d, "member_id", str) or "0", 16),
            endpoint=_req(d, "endpoint", str),
        )
        if not re.fullmatch(r"[0-9a-f]{32}", h.chain_id):
            raise ValueError("chain_id is not 32 hex digits")
        if h.prev_sha256 and not re.fullmatch(r"[0-9a-f]{64}", h.prev_sha256):
            raise ValueError("prev_sha256 is not a sha256")
        if h.seq < 0 or h.base_revision < 0 or h.start_revision < h.base_revision + 1:
            raise ValueError("seq/base_revision/start_revision out of range")
        if (h.seq == 0) != (h.prev_sha256 == "") or (h.seq == 0 and h.start_revision != h.base_revision + 1):
            raise ValueError("only the first segment of a chain (seq 0, at base + 1) has no previous segment")
        return h


@dataclass(frozen=True)
class SegmentFooter:
    end_revision: int
    end_time_ms: int
    txns: int
    events: int
    leases: int
    confirmed: bool  # coverage up to end_time confirmed by a watch progress notification
    catchup_until: int = 0  # revisions <= this were received while catching up (0: none)

    def to_json(self) -> Dict[str, Any]:
        return {
            "end_revision": self.end_revision,
            "end_time_ms": self.end_time_ms,
            "txns": self.txns,
            "events": self.events,
            "leases": self.leases,
            "confirmed": self.confirmed,
            "catchup_until": self.catchup_until,
        }

    @classmethod
    def from_json(cls, d: Any) -> "SegmentFooter":
        if not isinstance(d, dict):
            raise ValueError("footer is not an object")
        f = cls(
            end_revision=_req(d, "end_revision", int),
            end_time_ms=_req(d, "end_time_ms", int),
            txns=_req(d, "txns", int),
            events=_req(d, "events", int),
            leases=_req(d, "leases", int),
            confirmed=_req(d, "confirmed", bool),
            catchup_until=_req(d, "catchup_until", int),
        )
        if min(f.end_revision, f.txns, f.events, f.leases, f.catchup_until) < 0:
            raise ValueError("negative count in footer")
        return f


@dataclass(frozen=True)
class SegmentInfo:
    """A checked segment without its events: what a listing, a chain check or a resume needs."""

    path: str
    size: int
    sha256: str
    header: SegmentHeader
    footer: SegmentFooter
    lease_records: Tuple[LeaseRecord, ...] = ()

    @property
    def start_revision(self) -> int:
        return self.header.start_revision

    @property
    def end_revision(self) -> int:
        return self.footer.end_revision

    @property
    def empty(self) -> bool:
        return self.footer.txns == 0

    def to_json(self) -> Dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "header": self.header.to_json(),
            "footer": self.footer.to_json(),
        }


@dataclass(frozen=True)
class Segment:
    info: SegmentInfo
    txns: Tuple[Txn, ...]


# ---------------------------------------------------------------- names


def ms_to_datetime(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000.0, tz=timezone.utc)


def datetime_to_ms(when: datetime) -> int:
    if when.tzinfo is None:
        raise ValueError("a naive datetime is ambiguous; give a timezone (UTC)")
    return int(round(when.timestamp() * 1000))


def segment_name(start_revision: int, end_revision: int, end_time_ms: int) -> str:
    stamp = ms_to_datetime(end_time_ms).strftime("%Y%m%dT%H%M%S.%f")[:-3] + "Z"
    return f"etcd-delta-{start_revision:016d}-{end_revision:016d}-{stamp}.seg"


def parse_name(name: str) -> Optional[Tuple[int, int]]:
    """(start revision, end revision) of a segment file name, or None."""
    m = NAME_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def list_segments(directory: str) -> List[str]:
    """Segment files of ``directory`` in revision order (temp files of an open segment excluded)."""
    found = []
    for entry in os.listdir(directory):
        rng = parse_name(entry)
        if rng is not None:
            found.append((rng, entry))
    found.sort()
    return [os.path.join(directory, e) for _r, e in found]


# ---------------------------------------------------------------- encoding


def encode_txn(txn: Txn) -> bytes:
    parts = [_TXN.pack(txn.revision, txn.time_ms, len(txn.events), FLAG_CATCHUP if txn.catchup else 0)]
    for ev in txn.events:
        if ev.kind == PUT:
            parts.append(_EV.pack(PUT, len(ev.key), len(ev.value), ev.create_revision, ev.version, ev.lease))
            parts.append(ev.key)
            parts.append(ev.value)
        else:
            parts.append(_EV.pack(DELETE, len(ev.key), 0, 0, 0, 0))
            parts.append(ev.key)
    payload = b"".join(parts)
    return _REC.pack(REC_TXN, len(payload)) + payload


def encode_lease(rec: LeaseRecord) -> bytes:
    payload = _LEASE.pack(rec.lease_id, rec.granted_ttl, rec.remaining_ttl, rec.observed_ms)
    return _REC.pack(REC_LEASE, len(payload)) + payload


def _json_bytes(d: Dict[str, Any]) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


# ---------------------------------------------------------------- writing


class SegmentWriter:
    """Writes one segment under a hidden temp name; ``close`` makes it visible atomically.

    The file is 0600 whatever the umask, fsynced before it is linked to its final name (never
    replacing a file), and the directory is fsynced after. ``abort`` (or a crash) leaves at most
    the hidden temp file, which ``remove_stale_temps`` clears on the next start.
    """

    def __init__(self, directory: str, header: SegmentHeader, *, buffer_size: int = 1 << 20) -> None:
        self.directory = directory
        self.header = header
        self.tmp = os.path.join(directory, f"{TEMP_PREFIX}{header.chain_id[:12]}-{header.seq:08d}.tmp")
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)
        self._fh: Optional[BinaryIO] = os.fdopen(fd, "wb", buffering=buffer_size)
        self._hash = hashlib.sha256()
        self.size = 0
        self.txns = 0
        self.events = 0
        self.leases = 0
        self.last_revision = header.start_revision - 1
        self.last_time_ms = header.start_time_ms
        self.catchup_until = 0
        try:
            head = _json_bytes(header.to_json())
            self._write(MAGIC + _U32.pack(len(head)) + head)
        except BaseException:
            self.abort()
            raise

    def _write(self, data: bytes) -> None:
        assert self._fh is not None, "segment already closed"
        self._hash.update(data)
        self._fh.write(data)
        self.size += len(data)

    def add_txn(self, txn: Txn) -> None:
        """Append one revision; revisions must follow each other without a gap."""
        if txn.revision != self.last_revision + 1:
            raise DeltaError(f"segment {self.tmp}: revision {txn.revision} does not follow {self.last_revision}")
        if not txn.events:
            raise DeltaError(f"segment {self.tmp}: revision {txn.revision} has no events")
        data = encode_txn(txn)
        if len(data) > MAX_RECORD:
            raise DeltaError(f"revision {txn.revision} is {len(data)} bytes, over the {MAX_RECORD}-byte record limit")
        # time never goes backwards inside a chain, even if the wall clock is stepped back
        if txn.time_ms < self.last_time_ms:
            txn = Txn(txn.revision, self.last_time_ms, txn.events, txn.catchup)
            data = encode_txn(txn)
        self._write(data)
        self.txns += 1
        self.events += len(txn.events)
        self.last_revision = txn.revision
        self.last_time_ms = txn.time_ms
        if txn.catchup:
            self.catchup_until = txn.revision

    def add_lease(self, rec: LeaseRecord) -> None:
        self._write(encode_lease(rec))
        self.leases += 1

    def close(self, end_time_ms: int, *, confirmed: bool) -> SegmentInfo:
        """Footer, digest, fsync, link to the final name; returns what the next segment chains to."""
        footer = SegmentFooter(
            end_revision=self.last_revision,
            end_time_ms=max(end_time_ms, self.last_time_ms),
            txns=self.txns,
            events=self.events,
            leases=self.leases,
            confirmed=confirmed,
            catchup_until=self.catchup_until,
        )
        assert self._fh is not None, "segment already closed"
        try:
            body = _json_bytes(footer.to_json())
            footer_at = self.size
            self._write(_REC.pack(REC_FOOTER, len(body)) + body + _U64.pack(footer_at))
            digest = self._hash.digest()
            whole = self._hash.copy()
            whole.update(digest)
            self._fh.write(digest)
            self.size += DIGEST
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
            final = os.path.join(
                self.directory, segment_name(self.header.start_revision, footer.end_revision, footer.end_time_ms)
            )
            os.link(self.tmp, final)  # never replaces an existing segment
            os.unlink(self.tmp)
            fsync_dir(self.directory)
        except OSError as exc:
            self.abort()
            raise DeltaError(f"closing segment {self.tmp} failed: {exc.strerror or exc}") from exc
        return SegmentInfo(final, self.size, whole.hexdigest(), self.header, footer)

    def abort(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def remove_stale_temps(directory: str) -> List[str]:
    """Remove temp files of segments that were open when a watcher died (hold the dir lock)."""
    removed = []
    for entry in os.listdir(directory):
        if entry.startswith(TEMP_PREFIX) and entry.endswith(".tmp"):
            os.unlink(os.path.join(directory, entry))
            removed.append(entry)
    if removed:
        log.info("removed %d unfinished segment(s) of an earlier watcher: %s", len(removed), ", ".join(removed))
    return removed


# ---------------------------------------------------------------- reading


def _read_file(path: str, max_bytes: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot open: {exc.strerror or exc}") from None
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise SegmentCorrupt(path, f"{size} bytes, more than the {max_bytes}-byte limit")
        chunks = []
        left = size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 22))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _parse_json(path: str, raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SegmentCorrupt(path, f"{what} is not valid JSON ({exc})") from None


def _header_of(path: str, data: bytes) -> Tuple[SegmentHeader, int]:
    if data[:8] != MAGIC:
        raise SegmentCorrupt(path, "not a delta segment (bad magic)")
    if len(data) < 12:
        raise SegmentCorrupt(path, "truncated header")
    (hlen,) = _U32.unpack_from(data, 8)
    if hlen > MAX_JSON or 12 + hlen > len(data):
        raise SegmentCorrupt(path, f"header length {hlen} out of bounds")
    try:
        header = SegmentHeader.from_json(_parse_json(path, data[12 : 12 + hlen], "header"))
    except ValueError as exc:
        raise SegmentCorrupt(path, f"bad header: {exc}") from None
    return header, 12 + hlen


def read_header(path: str) -> SegmentHeader:
    """Only the header (bounded read of the first bytes; no digest check)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(12 + MAX_JSON)
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot read: {exc.strerror or exc}") from None
    return _header_of(path, data)[0]


def read_summary(path: str) -> Tuple[SegmentHeader, SegmentFooter]:
    """Header and footer from the two ends of the file, without reading the events (no digest
    check: for listings and for finding where to resume, never for trusting the content)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(12 + MAX_JSON)
            header, _ = _header_of(path, head)
            size = os.fstat(fh.fileno()).st_size
            if size < len(MAGIC) + 4 + _REC.size + _TRAILER:
                raise SegmentCorrupt(path, "truncated (no footer)")
            fh.seek(size - _TRAILER)
            (footer_at,) = _U64.unpack(fh.read(8))
            if not 12 <= footer_at <= size - _TRAILER - _REC.size:
                raise SegmentCorrupt(path, f"footer offset {footer_at} out of bounds")
            fh.seek(footer_at)
            raw = fh.read(size - _TRAILER - footer_at)
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot read: {exc.strerror or exc}") from None
    return header, _footer_of(path, raw, 0, len(raw))


def _footer_of(path: str, data: bytes, pos: int, end: int) -> SegmentFooter:
    kind, ln = _REC.unpack_from(data, pos)
    if kind != REC_FOOTER or ln > MAX_JSON or pos + _REC.size + ln != end:
        raise SegmentCorrupt(path, "footer record missing or misplaced")
    try:
        return SegmentFooter.from_json(_parse_json(path, data[pos + _REC.size : end], "footer"))
    except ValueError as exc:
        raise SegmentCorrupt(path, f"bad footer: {exc}") from None


def read_segment(path: str, *, max_bytes: int = MAX_SEGMENT) -> Segment:
    """Read and check a whole segment; any damage raises SegmentCorrupt (and nothing else).

    Checked: magic, header, sha256 digest, every length against the bytes that remain, record
    types, revision contiguity from the header's start, non-decreasing times, event fields,
    the footer's counts and range, and that nothing follows the digest.
    """
    data = _read_file(path, max_bytes)
    size = len(data)
    if data[:8] != MAGIC:
        raise SegmentCorrupt(path, "not a delta segment (bad magic)")
    if size < len(MAGIC) + 4 + _REC.size + _TRAILER:
        raise SegmentCorrupt(path, f"truncated ({size} bytes)")
    body_end = size - DIGEST
    # the digest first: any damage at all is reported as what it is
    if hashlib.sha256(memoryview(data)[:body_end]).digest() != data[body_end:]:
        raise SegmentCorrupt(path, f"sha256 digest mismatch ({size} bytes): damaged or truncated")
    header, pos = _header_of(path, data)
    (footer_at,) = _U64.unpack_from(data, body_end - 8)
    records_end = body_end - 8
    if not pos <= footer_at <= records_end - _REC.size:
        raise SegmentCorrupt(path, f"footer offset {footer_at} out of bounds")
    try:
        txns, leases = _parse_records(path, data, pos, footer_at, header)
    except struct.error as exc:  # pragma: no cover - every unpack is bounds-checked first
        raise SegmentCorrupt(path, f"malformed record ({exc})") from None
    footer = _footer_of(path, data, footer_at, records_end)
    last_rev = txns[-1].revision if txns else header.start_revision - 1
    n_events = sum(len(t.events) for t in txns)
    if (footer.end_revision, footer.txns, footer.events, footer.leases) != (last_rev, len(txns), n_events, len(leases)):
        raise SegmentCorrupt(
            path,
            f"footer says revisions to {footer.end_revision}, {footer.txns} txns, {footer.events} events, "
            f"{footer.leases} leases; records hold {last_rev}, {len(txns)}, {n_events}, {len(leases)}",
        )
    last_time = txns[-1].time_ms if txns else header.start_time_ms
    if footer.end_time_ms < last_time or footer.end_time_ms < header.start_time_ms:
        raise SegmentCorrupt(path, "footer end time before the segment's last event")
    whole = hashlib.sha256(data).hexdigest()
    info = SegmentInfo(path, size, whole, header, footer, tuple(leases))
    return Segment(info, tuple(txns))


def _parse_records(
    path: str, data: bytes, pos: int, end: int, header: SegmentHeader
) -> Tuple[List[Txn], List[LeaseRecord]]:
    txns: List[Txn] = []
    leases: List[LeaseRecord] = []
    expect = header.start_revision
    last_time = header.start_time_ms
    while pos < end:
        if pos + _REC.size > end:
            raise SegmentCorrupt(path, f"truncated record header at offset {pos}")
        kind, ln = _REC.unpack_from(data, pos)
        pos += _REC.size
        if ln > MAX_RECORD or ln > end - pos:
            raise SegmentCorrupt(path, f"record at offset {pos - _REC.size}: length {ln} out of bounds")
        rec_end = pos + ln
        if kind == REC_TXN:
            txn = _parse_txn(path, data, pos, rec_end)
            if txn.revision != expect:
                raise SegmentCorrupt(path, f"revision {txn.revision} where {expect} was due (gap or disorder)")
            if txn.time_ms < last_time:
                raise SegmentCorrupt(path, f"revision {txn.revision}: time goes backwards")
            txns.append(txn)
            expect += 1
            last_time = txn.time_ms
        elif kind == REC_LEASE:
            if ln != _LEASE.size:
                raise SegmentCorrupt(path, f"lease record of {ln} bytes")
            lid, granted, remaining, observed = _LEASE.unpack_from(data, pos)
            if lid <= 0 or granted < -1 or remaining < -1:
                raise SegmentCorrupt(path, f"lease record {lid:x}: values out of range")
            leases.append(LeaseRecord(lid, granted, remaining, observed))
        else:
            raise SegmentCorrupt(path, f"unknown record type {kind} at offset {pos - _REC.size}")
        pos = rec_end
    return txns, leases


def _parse_txn(path: str, data: bytes, pos: int, end: int) -> Txn:
    if end - pos < _TXN.size:
        raise SegmentCorrupt(path, "truncated transaction record")
    rev, time_ms, n, flags = _TXN.unpack_from(data, pos)
    pos += _TXN.size
    if n == 0 or n > (end - pos) // _EV.size or flags & ~FLAG_CATCHUP:
        raise SegmentCorrupt(path, f"revision {rev}: bad event count {n} or flags {flags:#x}")
    events = []
    seen = set()
    for _ in range(n):
        if end - pos < _EV.size:
            raise SegmentCorrupt(path, f"revision {rev}: truncated event")
        kind, klen, vlen, create, version, lease = _EV.unpack_from(data, pos)
        pos += _EV.size
        if klen == 0 or klen + vlen > end - pos:
            raise SegmentCorrupt(path, f"revision {rev}: key/value length out of bounds")
        key = data[pos : pos + klen]
        value = data[pos + klen : pos + klen + vlen]
        pos += klen + vlen
        if kind == PUT:
            if not (1 <= create <= rev and version >= 1 and lease >= 0):
                raise SegmentCorrupt(path, f"revision {rev}: put of {key[:64]!r} has impossible fields")
        elif kind == DELETE:
            if vlen or create or version or lease:
                raise SegmentCorrupt(path, f"revision {rev}: delete of {key[:64]!r} carries a value")
        else:
            raise SegmentCorrupt(path, f"revision {rev}: unknown event kind {kind}")
        if key in seen:  # etcd refuses a transaction that touches a key twice
            raise SegmentCorrupt(path, f"revision {rev}: key {key[:64]!r} twice")
        seen.add(key)
        events.append(Event(kind, key, value, rev, create, version, lease))
    if pos != end:
        raise SegmentCorrupt(path, f"revision {rev}: {end - pos} stray bytes after its events")
    return Txn(rev, time_ms, tuple(events), bool(flags & FLAG_CATCHUP))


# ---------------------------------------------------------------- the chain


@dataclass(frozen=True)
class ChainStop:
    """Where and why a chain stops being usable; nothing at or after ``at_revision`` is trusted."""

    kind: str  # "gap" | "corrupt" | "mismatch"
    reason: str
    at_revision: int
    path: Optional[str]
    last_good_revision: int
    last_good_time_ms: Optional[int]

    def to_json(self) -> Dict[str, Any]:
        return {
            "kind": self.kind,
            "reason": self.reason,
            "at_revision": self.at_revision,
            "path": self.path,
            "last_good_revision": self.last_good_revision,
            "last_good_time": ms_to_datetime(self.last_good_time_ms).isoformat() if self.last_good_time_ms else None,
            "last_good_time_ms": self.last_good_time_ms,
        }

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ChainStop":
        t = d.get("last_good_time_ms")
        return cls(str(d["kind"]), str(d["reason"]), int(d["at_revision"]), d.get("path"),
                   int(d["last_good_revision"]), None if t is None else int(t))


@dataclass(frozen=True)
class ChainCheck:
    base_revision: int
    segments: Tuple[SegmentInfo, ...]
    stop: Optional[ChainStop]
    lost: Tuple[str, ...] = field(default=())  # segment files of this chain after the stop

    @property
    def end_revision(self) -> int:
        return self.segments[-1].end_revision if self.segments else self.base_revision

    @property
    def end_time_ms(self) -> Optional[int]:
        return self.segments[-1].footer.end_time_ms if self.segments else None

    def to_json(self) -> Dict[str, Any]:
        return {
            "base_revision": self.base_revision,
            "end_revision": self.end_revision,
            "segments": len(self.segments),
            "stop": self.stop.to_json() if self.stop else None,
            "lost": list(self.lost),
        }


def check_chain(
    paths: Iterable[str],
    start_revision: int,
    *,
    verify: bool = True,
    max_bytes: int = MAX_SEGMENT,
) -> ChainCheck:
    """Follow the chain that starts after full backup revision ``start_revision``.

    Returns the good prefix and, if the chain does not run cleanly to its last segment, where
    and why it stops (a revision gap or missing segment, a corrupt file, a broken hash link).
    Segments of other chains among ``paths`` are ignored. ``verify=False`` reads only headers
    and footers (cheap, for finding where a watcher resumes) and cannot see damage inside.
    """
    by_start: Dict[int, List[str]] = {}
    for p in paths:
        rng = parse_name(os.path.basename(p))
        if rng is not None:
            by_start.setdefault(rng[0], []).append(p)
    for lst in by_start.values():
        lst.sort()
    good: List[SegmentInfo] = []
    used = set()
    expect = start_revision + 1
    prev: Optional[SegmentInfo] = None
    while True:
        cands = [p for p in by_start.get(expect, []) if p not in used]
        problems: List[Tuple[str, str, str]] = []  # (kind, path, reason)
        chosen: Optional[SegmentInfo] = None
        for p in cands:
            try:
                info = _load_info(p, verify, max_bytes)
            except SegmentCorrupt as exc:
                problems.append(("corrupt", p, exc.problem))
                continue
            h = info.header
            if h.base_revision != start_revision:
                continue  # another chain's segment that happens to start here
            if prev is None:
                ok = h.seq == 0 and h.prev_sha256 == ""
                why = "is not the first segment of a chain"
            else:
                ok = h.chain_id == prev.header.chain_id and h.seq == prev.header.seq + 1 and (
                    not verify or h.prev_sha256 == prev.sha256
                )
                why = (
                    f"does not link to {os.path.basename(prev.path)} "
                    f"(chain {h.chain_id[:8]} seq {h.seq}, prev sha256 {h.prev_sha256[:12]}; "
                    f"expected chain {prev.header.chain_id[:8]} seq {prev.header.seq + 1}, "
                    f"sha256 {prev.sha256[:12] if verify else '?'})"
                )
            if ok:
                chosen = info
                break
            problems.append(("mismatch", p, why))
        if chosen is not None:
            good.append(chosen)
            used.add(chosen.path)
            prev = chosen
            expect = chosen.end_revision + 1
            continue
        last_rev = prev.end_revision if prev else start_revision
        last_time = prev.footer.end_time_ms if prev else None
        later = sorted(
            (s, p) for s, lst in by_start.items() if s > expect for p in lst if _same_chain(p, start_revision, prev)
        )
        if problems:
            kind, p, why = problems[0]
            return ChainCheck(
                start_revision,
                tuple(good),
                ChainStop(kind, f"{os.path.basename(p)}: {why}", expect, p, last_rev, last_time),
                tuple(sorted({p for _k, p, _w in problems} | {p for _s, p in later})),
            )
        if later:
            nxt = later[0][0]
            reason = f"no segment covers revisions {expect}..{nxt - 1} (missing file); the next one starts at {nxt}"
            return ChainCheck(
                start_revision,
                tuple(good),
                ChainStop("gap", reason, expect, None, last_rev, last_time),
                tuple(p for _s, p in later),
            )
        return ChainCheck(start_revision, tuple(good), None)


def _load_info(path: str, verify: bool, max_bytes: int) -> SegmentInfo:
    if verify:
        return read_segment(path, max_bytes=max_bytes).info
    header, footer = read_summary(path)
    return SegmentInfo(path, os.path.getsize(path), "", header, footer)


def _same_chain(path: str, base: int, prev: Optional[SegmentInfo]) -> bool:
    """Could this later file belong to the chain being followed? Unreadable files count as yes:
    a damaged segment must be reported as lost, never skipped silently."""
    try:
        h = read_header(path)
    except SegmentCorrupt:
        return True
    if h.base_revision != base:
        return False
    return prev is None or h.chain_id == prev.header.chain_id


def tail_sha256(path: str) -> str:
    """sha256 of a whole file (what the next segment's header must name)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot read: {exc.strerror or exc}") from None
    return h.hexdigest()


def describe(segments: Sequence[SegmentInfo]) -> str:
    if not segments:
        return "no segments"
    a, b = segments[0], segments[-1]
    return (
        f"{len(segments)} segment(s), revisions {a.start_revision}..{b.end_revision}, "
        f"{ms_to_datetime(a.header.start_time_ms).isoformat()} .. {ms_to_datetime(b.footer.end_time_ms).isoformat()}"
    )
