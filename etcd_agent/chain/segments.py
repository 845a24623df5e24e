"""Delta segment files: the format, what a segment holds as typed values, and the file names.

A segment holds every etcd event after a full backup, in revision order, chained by sha256:
``segwriter`` writes one, ``segreader`` reads and checks one, ``segchain`` follows a chain.

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
sequence number and the full backup's revision (``base_revision``). ``segchain.check_chain``
follows the links from the base and stops at the first gap, corrupt file or broken link.

Times are wall-clock Unix milliseconds at which the watcher received the revision (within
milliseconds of the commit while the watch is live). Revisions received while catching up after a
(re)connect carry flag ``CATCHUP``: their time is only an upper bound of the commit time.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Dict, List, Optional, Tuple

from etcd_agent.chain.errors import SegmentCorrupt
from etcd_agent.errors import AgentError
from etcd_agent.typedjson import HEX, Codec, Document, Items, JsonObject, Text

FORMAT = "etcd-agent-delta"
FORMAT_VERSION = 1
MAGIC = b"ETCDDSEG"
DIGEST = 32
REC_TXN, REC_LEASE, REC_FOOTER = 1, 2, 3
PUT, DELETE = 0, 1
FLAG_CATCHUP = 0x01
SIG_ALG = "hmac-sha256"  # a signed footer's (``segsign``), as an encrypted segment's seal's (``segseal``)

MAX_JSON = 64 * 1024
# one record is one revision; etcd's own request limit is --max-request-bytes (1.5 MiB default,
# raised in some clusters), so a revision far beyond that is damage, not data
MAX_RECORD = 256 * 1024 * 1024
MAX_SEGMENT = 1024 * 1024 * 1024

REC_HEAD = struct.Struct(">BI")
TXN_HEAD = struct.Struct(">QqIB")
EVENT_HEAD = struct.Struct(">BIIQQq")
LEASE_BODY = struct.Struct(">qqqq")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
TRAILER = 8 + DIGEST

NAME_RE = re.compile(r"^etcd-delta-(\d{1,19})-(\d{1,19})-(\d{8}T\d{6}(?:\.\d{3})?Z)\.seg(\.age)?$")
SEALED_EXT = ".age"  # an encrypted segment: <segment name>.age (``segseal``)
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


SHA256_HEX = r"[0-9a-f]{64}"


class SegmentRecord(Document):
    """A segment's own JSON (header, footer, seal): refused as damage to the file, ``where``."""

    WHAT: ClassVar[str] = "record"

    @classmethod
    def refused(cls, where: str, problem: str) -> AgentError:
        return SegmentCorrupt(where, f"bad {cls.WHAT}: {problem}")


@dataclass(frozen=True)
class SegmentHeader(SegmentRecord):
    WHAT = "header"
    TAGS = {"format": (FORMAT,), "format_version": tuple(range(1, FORMAT_VERSION + 1))}
    REQUIRED = ("cluster_id", "member_id", "endpoint")  # every writer has written them
    OMIT_DEFAULT = ("base_sha256",)  # absent rather than empty: older readers see the header they know

    chain_id: Annotated[str, Text(32, r"[0-9a-f]{32}")]
    seq: int
    base_revision: int
    start_revision: int
    prev_sha256: Annotated[str, Text(64, f"(?:{SHA256_HEX})?")]
    start_time_ms: int
    cluster_id: Annotated[int, HEX] = 0
    member_id: Annotated[int, HEX] = 0
    endpoint: Annotated[str, Text(4096)] = ""
    # sha256 of the full backup's snapshot db this chain continues ("": written before chains
    # named it). Two full backups can share a revision (etcd 3.4 restores do not bump it): the
    # revision alone cannot tell which one a chain continues.
    base_sha256: Annotated[str, Text(64, f"(?:{SHA256_HEX})?")] = ""

    def violation(self) -> Optional[str]:
        if self.seq < 0 or self.base_revision < 0 or self.start_revision < self.base_revision + 1:
            return "seq/base_revision/start_revision out of range"
        if (self.seq == 0) != (self.prev_sha256 == "") or (self.seq == 0 and self.start_revision != self.base_revision + 1):
            return "only the first segment of a chain (seq 0, at base + 1) has no previous segment"
        return None


# a full backup's name as the agent writes it (``backup.archive.NAME_RE``): what a footer may vouch for
CHECKPOINT_NAME_RE = re.compile(r"etcd-\d{4}-\d\d-\d\d-\d\d-\d\d-\d\d\.tar(?:\.gz|\.zst)?\Z")
MAX_CHECKPOINTS = 8  # vouched for in one footer (the daemon takes one a minute at most)


@dataclass(frozen=True)
class Checkpoint(Document):
    """A full backup the daemon took *inside* this chain, vouched for by the chain itself: the
    watcher wrote this into a segment's footer only after it had written every revision up to
    ``revision`` and checked the member again after the backup was taken. A restore may start
    its replay from it instead of from the chain's base - if the file's snapshot has exactly
    this sha256 (its content, not its manifest, decides) and this revision.

    ``leases_from``: just before the backup the watcher observed every lease the member had (a
    lease census) and wrote those records into the segment holding this revision; every segment
    from that one on holds what the lease rule needs about the leases in the checkpoint, so a
    replay from it reads nothing of the chain before that segment."""

    CLOSED = True  # {name, sha256, revision, leases_from}: what the chain vouches for, nothing else

    name: Annotated[str, Text(80, CHECKPOINT_NAME_RE.pattern)]  # the backup's file name, in the same dir
    sha256: Annotated[str, Text(64, SHA256_HEX)]  # of its snapshot db (the plaintext, when the backup is encrypted)
    revision: int  # the snapshot's revision
    leases_from: int  # the revision the chain had written at the lease census (<= revision)

    def violation(self) -> Optional[str]:
        if self.revision < 1 or not 0 <= self.leases_from <= self.revision:
            return "checkpoint revision out of range"
        return None

    def served_from(self, begins_at: int) -> bool:
        """Does a run of the chain that begins at revision ``begins_at`` (a partial chain: the
        segments before it not here) hold all that a replay from this checkpoint reads: the
        segment of its lease census and every one after it?"""
        return self.leases_from >= begins_at


def signature_json(sig: Tuple[str, str]) -> Dict[str, str]:
    """A signature (key id, hex mac) as a footer or a seal writes it."""
    return {"alg": SIG_ALG, "key_id": sig[0], "mac": sig[1]}


def parse_signature(v: Any) -> Tuple[str, str]:
    """(key id, hex mac) of a footer's or a seal's "signature"; ValueError if malformed."""
    if not isinstance(v, dict) or v.get("alg") != SIG_ALG or set(v) != {"alg", "key_id", "mac"} or \
            not all(isinstance(v[k], str) and 0 < len(v[k]) <= 128 for k in ("key_id", "mac")):
        raise ValueError(f"is malformed (want {{alg: {SIG_ALG}, key_id, mac}})")
    return str(v["key_id"]), str(v["mac"])


SIGNATURE = Codec(parse_signature, signature_json)


@dataclass(frozen=True)
class SegmentFooter(SegmentRecord):
    WHAT = "footer"
    REQUIRED = ("catchup_until",)
    OMIT_DEFAULT = ("checkpoints",)  # absent rather than empty: older readers see the footer they know

    end_revision: int
    end_time_ms: int
    txns: int
    events: int
    leases: int
    confirmed: bool  # coverage up to end_time confirmed by a watch progress notification
    catchup_until: int = 0  # revisions <= this were received while catching up (0: none)
    # full backups taken inside the chain that it vouches for (optional: older readers ignore it)
    checkpoints: Annotated[Tuple[Checkpoint, ...], Items(1, MAX_CHECKPOINTS)] = ()
    # (manifest key id, hex HMAC-SHA256) of a plain segment signed by the daemon (``segsign``;
    # optional: older readers ignore it); an encrypted segment's seal carries its signature instead
    signature: Annotated[Optional[Tuple[str, str]], SIGNATURE] = None

    def unsigned(self) -> "SegmentFooter":
        return dataclasses.replace(self, signature=None)

    def with_signature(self, signature: Tuple[str, str]) -> "SegmentFooter":
        return dataclasses.replace(self, signature=signature)

    def violation(self) -> Optional[str]:
        if min(self.end_revision, self.txns, self.events, self.leases, self.catchup_until) < 0:
            return "negative count in footer"
        if any(c.revision > self.end_revision for c in self.checkpoints):
            return "a checkpoint past the segment's end: the chain cannot vouch for it"
        return None


@dataclass(frozen=True)
class SealFacts:
    """What an encrypted segment (``segseal``) showed: its file, and how far it was opened."""

    path: str  # the .seg.age file on disk
    recipients: Tuple[str, ...]  # as its seal names them (public keys)
    plain_size: int
    plain_sha256: str  # of the v1 segment inside
    signature: str  # "valid" | "unsigned" | "unknown-key" (the seal's HMAC with the manifest key)
    opened: bool  # decrypted and checked: SegmentInfo.path is then its plaintext in a private dir


@dataclass(frozen=True)
class SegmentInfo:
    """A checked segment without its events: what a listing, a chain check or a resume needs."""

    path: str
    size: int
    sha256: str
    header: SegmentHeader
    footer: SegmentFooter
    lease_records: Tuple[LeaseRecord, ...] = ()
    # an encrypted segment: ``path``/``sha256``/``size`` are then those of the file on disk when
    # checked without the key, and ``path`` is the decrypted copy once opened with it
    sealed: Optional[SealFacts] = None
    # a plain segment's footer signature as checked (``segsign.state``): "" not checked (headers
    # and footers only), "valid" | "unsigned" | "unknown-key"
    footer_signature: str = ""

    @property
    def signature(self) -> str:
        """How its origin is proven: the seal's signature (encrypted), else the footer's."""
        return self.sealed.signature if self.sealed is not None else self.footer_signature

    @property
    def disk_path(self) -> str:
        """The segment's file in the backup dir (for an opened encrypted one, not its plaintext)."""
        return self.sealed.path if self.sealed is not None else self.path

    @property
    def content_sha256(self) -> str:
        """sha256 of the v1 segment file at ``path`` (an opened encrypted one: its plaintext's)."""
        return self.sealed.plain_sha256 if self.sealed is not None and self.sealed.opened else self.sha256

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


def json_bytes(d: JsonObject) -> bytes:
    """A header, footer or seal as the format writes it: sorted keys, no spaces."""
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


# ---------------------------------------------------------------- names


def ms_to_datetime(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000.0, tz=timezone.utc)


def datetime_to_ms(when: datetime) -> int:
    if when.tzinfo is None:
        raise ValueError("a naive datetime is ambiguous; give a timezone (UTC)")
    return int(round(when.timestamp() * 1000))


def segment_name(start_revision: int, end_revision: int, end_time_ms: int, *, sealed: bool = False) -> str:
    stamp = ms_to_datetime(end_time_ms).strftime("%Y%m%dT%H%M%S.%f")[:-3] + "Z"
    return f"etcd-delta-{start_revision:016d}-{end_revision:016d}-{stamp}.seg{SEALED_EXT if sealed else ''}"


def is_sealed(path: str) -> bool:
    """An encrypted segment, by its name (``.seg.age``)."""
    return path.endswith(".seg" + SEALED_EXT)


def name_time_ms(name: str) -> Optional[int]:
    """The end time a segment file's name states (Unix ms; the twin of ``segment_name``), or None."""
    m = NAME_RE.match(name)
    if not m:
        return None
    stamp = m.group(3)[:-1]  # without the Z
    try:
        when = datetime.strptime(stamp, "%Y%m%dT%H%M%S.%f" if "." in stamp else "%Y%m%dT%H%M%S")
    except ValueError:  # digits that are no date (month 13): a name, not a time
        return None
    return int(when.replace(tzinfo=timezone.utc).timestamp() * 1000)


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
