"""Reading one delta segment (layout in ``segments``), bounded, trusting nothing it has not checked.

``read_segment`` reads a whole file and checks all of it (digest first, then every record);
``read_header`` and ``read_summary`` read only the ends, for listings and resuming, never for
trusting the content. Any damage is ``SegmentCorrupt``, and nothing else.
"""
from __future__ import annotations

import hashlib
import os
import struct
from typing import Any, Callable, List, Optional, Set, Tuple

from etcd_agent import safejson
from etcd_agent.chain import sign as segsign
from etcd_agent.chain.errors import NotASegment, SegmentCorrupt, unopenable
from etcd_agent.chain.seal import read_seal
from etcd_agent.chain.segments import (
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
from etcd_agent.fs import open_regular, regular_fd


def _read_file(path: str, max_bytes: int) -> bytes:
    try:
        fd = regular_fd(path)
    except OSError as exc:
        raise unopenable(path, exc, "open") from None
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise SegmentCorrupt(path, f"{size} bytes, more than the {max_bytes}-byte limit")
        # what is left in one read (the file is held whole anyway; a lone chunk is joined without
        # a copy): a segment is a little over close_bytes, and reading it in 4 MiB chunks made two
        # chunks and a join copying them (0.5 s of a 600,000-event replay's two passes)
        chunks = []
        left = size
        while left > 0:
            chunk = os.read(fd, left)
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
        raise NotASegment(path, "not a delta segment (bad magic)")
    if len(data) < 12:
        raise SegmentCorrupt(path, "truncated header")
    (hlen,) = U32.unpack_from(data, 8)
    if hlen > MAX_JSON or 12 + hlen > len(data):
        raise SegmentCorrupt(path, f"header length {hlen} out of bounds")
    return SegmentHeader.from_json(_parse_json(path, data[12 : 12 + hlen], "header"), path), 12 + hlen


def read_header(path: str) -> SegmentHeader:
    """Only the header (bounded read of the first bytes; no digest check). An encrypted segment's
    comes from its seal, unchecked (``segseal``)."""
    if is_sealed(path):
        return read_seal(path).header
    try:
        with open_regular(path) as fh:
            data = fh.read(12 + MAX_JSON)
    except OSError as exc:
        raise unopenable(path, exc, "read") from None
    return _header_of(path, data)[0]


def read_summary(path: str) -> Tuple[SegmentHeader, SegmentFooter]:
    """Header and footer from the two ends of the file, without reading the events (no digest
    check: for listings and for finding where to resume, never for trusting the content). An
    encrypted segment's come from its seal."""
    if is_sealed(path):
        seal = read_seal(path)
        return seal.header, seal.footer
    try:
        with open_regular(path) as fh:
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
        raise unopenable(path, exc, "read") from None
    return header, _footer_of(path, raw, 0, len(raw))


TAIL_BYTES = REC_HEAD.size + MAX_JSON + TRAILER  # a plain segment's last bytes always hold its whole footer


def footer_from_tail(where: str, tail: bytes, size: int) -> SegmentFooter:
    """A plain segment's footer from its last ``TAIL_BYTES`` (fewer: the whole file) of ``size``,
    as one ranged read of an object in the bucket gives them: for choosing what to fetch, never
    for trusting (no digest, no signature checked here). SegmentCorrupt when they hold none."""
    if size < len(MAGIC) + 4 + REC_HEAD.size + TRAILER or len(tail) < TRAILER or len(tail) > size:
        raise SegmentCorrupt(where, "truncated (no footer)")
    (footer_at,) = U64.unpack_from(tail, len(tail) - TRAILER)
    pos = footer_at - (size - len(tail))
    if not 0 <= pos <= len(tail) - TRAILER - REC_HEAD.size or footer_at < 12:
        raise SegmentCorrupt(where, f"footer offset {footer_at} out of bounds")
    return _footer_of(where, tail, pos, len(tail) - TRAILER)


def _footer_of(path: str, data: bytes, pos: int, end: int) -> SegmentFooter:
    kind, ln = REC_HEAD.unpack_from(data, pos)
    if kind != REC_FOOTER or ln > MAX_JSON or pos + REC_HEAD.size + ln != end:
        raise SegmentCorrupt(path, "footer record missing or misplaced")
    return SegmentFooter.from_json(_parse_json(path, data[pos + REC_HEAD.size : end], "footer"), path)


def read_segment(path: str, *, max_bytes: int = MAX_SEGMENT) -> Segment:
    """Read and check a whole segment; any damage raises SegmentCorrupt (and nothing else).

    Checked: magic, header, sha256 digest, every length against the bytes that remain, record
    types, revision contiguity from the header's start, non-decreasing times, event fields,
    the footer's counts and range, and that nothing follows the digest.
    """
    txns: List[Txn] = []

    def build(rev: int, time_ms: int, flags: int, evs: Optional[List[RawEvent]]) -> None:
        assert evs is not None
        txns.append(Txn(rev, time_ms, tuple(Event(k, key, v, rev, c, ver, lease) for k, key, v, c, ver, lease in evs),
                        bool(flags & FLAG_CATCHUP)))

    info = scan_segment(path, build, max_bytes=max_bytes)
    return Segment(info, tuple(txns))


def verify_segment(path: str, *, max_bytes: int = MAX_SEGMENT, key: Optional[bytes] = None) -> SegmentInfo:
    """What ``read_segment(path).info`` returns, checked exactly as strictly, but without building
    an object per event (the chain check's pass: it needs only the verdict and the info). With
    ``key`` (the manifest key) its footer's signature is checked (``segsign.state``)."""
    return scan_segment(path, None, max_bytes=max_bytes, key=key)


# one event as the scan hands it over: (kind, key, value, create revision, version, lease)
RawEvent = Tuple[int, bytes, bytes, int, int, int]
# called once per TXN record, in order, after that record is fully checked:
# (revision, time_ms, flags, its events - or None when the sink wants only revisions)
TxnSink = Callable[[int, int, int, Optional[List[RawEvent]]], None]


def scan_segment(path: str, sink: Optional[TxnSink], *, max_bytes: int = MAX_SEGMENT,
                 want_events: bool = True, key: Optional[bytes] = None) -> SegmentInfo:
    """Read and check a whole segment as ``read_segment`` does, handing each checked revision to
    ``sink`` (None: check only) as plain tuples instead of Txn/Event objects. The digest is
    checked before any record is parsed, so ``sink`` only ever sees bytes the digest covers;
    the footer's counts are checked after the last record (a sink must be ready to discard
    what it got if this raises). ``want_events`` False: ``sink`` gets None for the events.
    The footer's signature is checked with ``key`` (SegmentForged if it does not match; the
    info's ``signature`` says valid, unsigned or unknown-key)."""
    data = _read_file(path, max_bytes)
    size = len(data)
    if data[:8] != MAGIC:
        raise NotASegment(path, "not a delta segment (bad magic)")
    if size < len(MAGIC) + 4 + REC_HEAD.size + TRAILER:
        raise SegmentCorrupt(path, f"truncated ({size} bytes)")
    body_end = size - DIGEST
    # the digest first: any damage at all is reported as what it is; hashed in two parts, so the
    # sha256 of the bytes before the footer (what its signature covers) comes in the same pass
    (footer_at,) = U64.unpack_from(data, body_end - 8)
    split = min(footer_at, body_end)
    digest = hashlib.sha256(memoryview(data)[:split])
    before_footer = digest.digest()
    digest.update(memoryview(data)[split:body_end])
    if digest.digest() != data[body_end:]:
        raise SegmentCorrupt(path, f"sha256 digest mismatch ({size} bytes): damaged or truncated")
    header, pos = _header_of(path, data)
    records_end = body_end - 8
    if not pos <= footer_at <= records_end - REC_HEAD.size:
        raise SegmentCorrupt(path, f"footer offset {footer_at} out of bounds")
    try:
        n_txns, n_events, last_rev, last_time, leases = _parse_records(
            path, data, pos, footer_at, header, sink, want_events and sink is not None)
    except struct.error as exc:  # pragma: no cover - every unpack is bounds-checked first
        raise SegmentCorrupt(path, f"malformed record ({exc})") from None
    footer = _footer_of(path, data, footer_at, records_end)
    if (footer.end_revision, footer.txns, footer.events, footer.leases) != (last_rev, n_txns, n_events, len(leases)):
        raise SegmentCorrupt(
            path,
            f"footer says revisions to {footer.end_revision}, {footer.txns} txns, {footer.events} events, "
            f"{footer.leases} leases; records hold {last_rev}, {n_txns}, {n_events}, {len(leases)}",
        )
    if footer.end_time_ms < last_time or footer.end_time_ms < header.start_time_ms:
        raise SegmentCorrupt(path, "footer end time before the segment's last event")
    if any(c.revision <= header.base_revision or c.leases_from < header.base_revision for c in footer.checkpoints):
        raise SegmentCorrupt(path, "footer vouches for a checkpoint at or before the chain's base")
    # the whole file's sha256 (what the next segment names) continues the body's: one pass, not two
    digest.update(memoryview(data)[body_end:])
    whole = digest.hexdigest()
    signature = segsign.state(path, footer, before_footer, key)
    return SegmentInfo(path, size, whole, header, footer, tuple(leases), footer_signature=signature)


_REC_HEAD_SIZE = REC_HEAD.size
_TXN_HEAD_SIZE = TXN_HEAD.size
_EVENT_HEAD_SIZE = EVENT_HEAD.size
_EV_HEAD = EVENT_HEAD.unpack_from
_NOTHING = (0, 0, 0, 0)  # a delete's value length, create revision, version and lease


def _parse_records(
    path: str, data: bytes, pos: int, end: int, header: SegmentHeader, sink: Optional[TxnSink], want_events: bool
) -> Tuple[int, int, int, int, List[LeaseRecord]]:
    """Every record from ``pos`` to the footer at ``end``, checked; returns (txns, events, last
    revision, last time, lease records). No object per event unless ``want_events``: this is the
    replay's hot path (the chain check and the fold both run it over every byte), so a
    revision costs one call (``_events``) and an event none."""
    leases: List[LeaseRecord] = []
    expect = header.start_revision
    last_time = header.start_time_ms
    n_txns = n_events = 0
    rec_head = REC_HEAD.unpack_from
    txn_head = TXN_HEAD.unpack_from
    rh, th, eh = _REC_HEAD_SIZE, _TXN_HEAD_SIZE, _EVENT_HEAD_SIZE
    not_catchup = ~FLAG_CATCHUP
    while pos < end:
        if pos + rh > end:
            raise SegmentCorrupt(path, f"truncated record header at offset {pos}")
        kind, ln = rec_head(data, pos)
        pos += rh
        if ln > MAX_RECORD or ln > end - pos:
            raise SegmentCorrupt(path, f"record at offset {pos - rh}: length {ln} out of bounds")
        if kind == REC_TXN:
            # one revision: u64 revision, i64 time, u32 n, u8 flags, then n events
            if ln < th:
                raise SegmentCorrupt(path, "truncated transaction record")
            rev, time_ms, n, flags = txn_head(data, pos)
            if n == 0 or n > (ln - th) // eh or flags & not_catchup:
                raise SegmentCorrupt(path, f"revision {rev}: bad event count {n} or flags {flags:#x}")
            evs = _events(path, data, pos + th, pos + ln, n, rev, want_events)
            if rev != expect:
                raise SegmentCorrupt(path, f"revision {rev} where {expect} was due (gap or disorder)")
            if time_ms < last_time:
                raise SegmentCorrupt(path, f"revision {rev}: time goes backwards")
            if sink is not None:
                sink(rev, time_ms, flags, evs)
            n_txns += 1
            n_events += n
            expect += 1
            last_time = time_ms
        elif kind == REC_LEASE:
            leases.append(_lease_record(path, data, pos, ln))
        else:
            raise SegmentCorrupt(path, f"unknown record type {kind} at offset {pos - rh}")
        pos += ln
    return n_txns, n_events, expect - 1, last_time, leases


def _events(path: str, data: bytes, p: int, rec_end: int, n: int, rev: int, want_events: bool
            ) -> Optional[List[RawEvent]]:
    """The ``n`` events of revision ``rev`` from ``p``, which must end exactly at ``rec_end``:
    lengths in bounds, fields possible for their kind, no key twice; the list only if wanted."""
    ev_head = _EV_HEAD
    eh = _EVENT_HEAD_SIZE
    evs: Optional[List[RawEvent]] = [] if want_events else None
    seen: Optional[Set[bytes]] = set() if n > 1 else None
    for _ in range(n):
        if rec_end - p < eh:
            raise SegmentCorrupt(path, f"revision {rev}: truncated event")
        ekind, klen, vlen, create, version, lease = ev_head(data, p)
        p += eh
        if klen == 0 or klen + vlen > rec_end - p:
            raise SegmentCorrupt(path, f"revision {rev}: key/value length out of bounds")
        kend = p + klen
        if ekind == PUT:
            if not (1 <= create <= rev and version >= 1 and lease >= 0):
                raise _bad_event(path, rev, ekind, data[p:kend])
        elif ekind != DELETE or (vlen, create, version, lease) != _NOTHING:  # a delete carries only its key
            raise _bad_event(path, rev, ekind, data[p:kend])
        if seen is None and evs is None:  # the check's pass over single-key revisions: no key copied
            p = kend + vlen
            continue
        key = data[p:kend]
        if seen is not None:
            if key in seen:  # etcd refuses a transaction that touches a key twice
                raise SegmentCorrupt(path, f"revision {rev}: key {key[:64]!r} twice")
            seen.add(key)
        if evs is not None:
            evs.append((ekind, key, data[kend : kend + vlen], create, version, lease))
        p = kend + vlen
    if p != rec_end:
        raise SegmentCorrupt(path, f"revision {rev}: {rec_end - p} stray bytes after its events")
    return evs


def _bad_event(path: str, rev: int, ekind: int, key: bytes) -> SegmentCorrupt:
    """What is wrong with an event whose fields are impossible for its kind."""
    if ekind == PUT:
        return SegmentCorrupt(path, f"revision {rev}: put of {key[:64]!r} has impossible fields")
    if ekind == DELETE:
        return SegmentCorrupt(path, f"revision {rev}: delete of {key[:64]!r} carries a value")
    return SegmentCorrupt(path, f"revision {rev}: unknown event kind {ekind}")


def _lease_record(path: str, data: bytes, pos: int, ln: int) -> LeaseRecord:
    """One LEASE record: a lease the watcher saw alive, checked in range."""
    if ln != LEASE_BODY.size:
        raise SegmentCorrupt(path, f"lease record of {ln} bytes")
    lid, granted, remaining, observed = LEASE_BODY.unpack_from(data, pos)
    if lid <= 0 or granted < -1 or remaining < -1:
        raise SegmentCorrupt(path, f"lease record {lid:x}: values out of range")
    return LeaseRecord(lid, granted, remaining, observed)
