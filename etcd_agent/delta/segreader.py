"""Reading one delta segment (layout in ``segments``), bounded, trusting nothing it has not checked.

``read_segment`` reads a whole file and checks all of it (digest first, then every record);
``read_header`` and ``read_summary`` read only the ends, for listings and resuming, never for
trusting the content. Any damage is ``SegmentCorrupt``, and nothing else.
"""
from __future__ import annotations

import hashlib
import os
import struct
from typing import Any, List, Tuple

from etcd_agent import safejson

from .errors import SegmentCorrupt
from .segments import (
    DELETE,
    DIGEST,
    EVENT_HEAD,
    FLAG_CATCHUP,
    LEASE_BODY,
    MAGIC,
    MAX_JSON,
    MAX_RECORD,
    MAX_SEGMENT,
    PUT,
    REC_FOOTER,
    REC_HEAD,
    REC_LEASE,
    REC_TXN,
    TRAILER,
    TXN_HEAD,
    U32,
    U64,
    Event,
    LeaseRecord,
    Segment,
    SegmentFooter,
    SegmentHeader,
    SegmentInfo,
    Txn,
    is_sealed,
)
from .segseal import read_seal


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
    try:  # bounded in depth too: json.loads recurses per level (RecursionError, not ValueError)
        return safejson.loads(raw, max_bytes=MAX_JSON)
    except ValueError as exc:
        raise SegmentCorrupt(path, f"{what} is not valid JSON ({exc})") from None


def _header_of(path: str, data: bytes) -> Tuple[SegmentHeader, int]:
    if data[:8] != MAGIC:
        raise SegmentCorrupt(path, "not a delta segment (bad magic)")
    if len(data) < 12:
        raise SegmentCorrupt(path, "truncated header")
    (hlen,) = U32.unpack_from(data, 8)
    if hlen > MAX_JSON or 12 + hlen > len(data):
        raise SegmentCorrupt(path, f"header length {hlen} out of bounds")
    try:
        header = SegmentHeader.from_json(_parse_json(path, data[12 : 12 + hlen], "header"))
    except ValueError as exc:
        raise SegmentCorrupt(path, f"bad header: {exc}") from None
    return header, 12 + hlen


def read_header(path: str) -> SegmentHeader:
    """Only the header (bounded read of the first bytes; no digest check). An encrypted segment's
    comes from its seal, unchecked (``segseal``)."""
    if is_sealed(path):
        return read_seal(path).header
    try:
        with open(path, "rb") as fh:
            data = fh.read(12 + MAX_JSON)
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot read: {exc.strerror or exc}") from None
    return _header_of(path, data)[0]


def read_summary(path: str) -> Tuple[SegmentHeader, SegmentFooter]:
    """Header and footer from the two ends of the file, without reading the events (no digest
    check: for listings and for finding where to resume, never for trusting the content). An
    encrypted segment's come from its seal."""
    if is_sealed(path):
        seal = read_seal(path)
        return seal.header, seal.footer
    try:
        with open(path, "rb") as fh:
            head = fh.read(12 + MAX_JSON)
            header, _ = _header_of(path, head)
            size = os.fstat(fh.fileno()).st_size
            if size < len(MAGIC) + 4 + REC_HEAD.size + TRAILER:
                raise SegmentCorrupt(path, "truncated (no footer)")
            fh.seek(size - TRAILER)
            (footer_at,) = U64.unpack(fh.read(8))
            if not 12 <= footer_at <= size - TRAILER - REC_HEAD.size:
                raise SegmentCorrupt(path, f"footer offset {footer_at} out of bounds")
            fh.seek(footer_at)
            raw = fh.read(size - TRAILER - footer_at)
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot read: {exc.strerror or exc}") from None
    return header, _footer_of(path, raw, 0, len(raw))


def _footer_of(path: str, data: bytes, pos: int, end: int) -> SegmentFooter:
    kind, ln = REC_HEAD.unpack_from(data, pos)
    if kind != REC_FOOTER or ln > MAX_JSON or pos + REC_HEAD.size + ln != end:
        raise SegmentCorrupt(path, "footer record missing or misplaced")
    try:
        return SegmentFooter.from_json(_parse_json(path, data[pos + REC_HEAD.size : end], "footer"))
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
    if size < len(MAGIC) + 4 + REC_HEAD.size + TRAILER:
        raise SegmentCorrupt(path, f"truncated ({size} bytes)")
    body_end = size - DIGEST
    # the digest first: any damage at all is reported as what it is
    digest = hashlib.sha256(memoryview(data)[:body_end])
    if digest.digest() != data[body_end:]:
        raise SegmentCorrupt(path, f"sha256 digest mismatch ({size} bytes): damaged or truncated")
    header, pos = _header_of(path, data)
    (footer_at,) = U64.unpack_from(data, body_end - 8)
    records_end = body_end - 8
    if not pos <= footer_at <= records_end - REC_HEAD.size:
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
    # the whole file's sha256 (what the next segment names) continues the body's: one pass, not two
    digest.update(memoryview(data)[body_end:])
    whole = digest.hexdigest()
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
        if pos + REC_HEAD.size > end:
            raise SegmentCorrupt(path, f"truncated record header at offset {pos}")
        kind, ln = REC_HEAD.unpack_from(data, pos)
        pos += REC_HEAD.size
        if ln > MAX_RECORD or ln > end - pos:
            raise SegmentCorrupt(path, f"record at offset {pos - REC_HEAD.size}: length {ln} out of bounds")
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
            if ln != LEASE_BODY.size:
                raise SegmentCorrupt(path, f"lease record of {ln} bytes")
            lid, granted, remaining, observed = LEASE_BODY.unpack_from(data, pos)
            if lid <= 0 or granted < -1 or remaining < -1:
                raise SegmentCorrupt(path, f"lease record {lid:x}: values out of range")
            leases.append(LeaseRecord(lid, granted, remaining, observed))
        else:
            raise SegmentCorrupt(path, f"unknown record type {kind} at offset {pos - REC_HEAD.size}")
        pos = rec_end
    return txns, leases


def _parse_txn(path: str, data: bytes, pos: int, end: int) -> Txn:
    if end - pos < TXN_HEAD.size:
        raise SegmentCorrupt(path, "truncated transaction record")
    rev, time_ms, n, flags = TXN_HEAD.unpack_from(data, pos)
    pos += TXN_HEAD.size
    if n == 0 or n > (end - pos) // EVENT_HEAD.size or flags & ~FLAG_CATCHUP:
        raise SegmentCorrupt(path, f"revision {rev}: bad event count {n} or flags {flags:#x}")
    events = []
    seen = set()
    for _ in range(n):
        if end - pos < EVENT_HEAD.size:
            raise SegmentCorrupt(path, f"revision {rev}: truncated event")
        kind, klen, vlen, create, version, lease = EVENT_HEAD.unpack_from(data, pos)
        pos += EVENT_HEAD.size
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
