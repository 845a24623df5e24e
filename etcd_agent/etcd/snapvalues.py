"""The values inside an etcd snapshot's buckets, decoded and bounded: member entries, MVCC
revisions, uint64s, versions and the small JSON objects of ``members``, ``meta`` and ``cluster``;
and the id arithmetic etcd uses for members and clusters. Pure functions on bytes; every malformed
value is one :class:`SnapshotFormatError` naming where it was. :mod:`.snapdb` walks the buckets."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from etcd_agent import safejson
from etcd_agent.errors import SnapshotFormatError
from etcd_agent.etcd.bbolt import MAX_VALUE

MAX_JSON_DEPTH = 8
MAX_REVISION = (1 << 63) - 1  # etcd keeps revisions in int64

_HEX_ID = re.compile(rb"[0-9a-fA-F]{1,16}\Z")
_VERSION = re.compile(r"[0-9A-Za-z.+\-]{1,64}\Z")


@dataclass(frozen=True)
class Revision:
    """An MVCC revision: ``main`` is what etcd calls the revision, ``sub`` orders one txn's puts."""

    main: int
    sub: int
    tombstone: bool = False


@dataclass(frozen=True)
class Member:
    """One entry of the ``members`` bucket (name and client URLs are empty until it published)."""

    id: int
    name: str
    peer_urls: Tuple[str, ...]
    client_urls: Tuple[str, ...]
    is_learner: bool

    @property
    def id_hex(self) -> str:
        """The id as etcd prints it (``types.ID.String``: hex, no padding)."""
        return format(self.id, "x")

    def is_bootstrap_member_of(self, token: str) -> bool:
        """Whether this id is the one etcd derives at bootstrap (or restore) from the peer URLs and
        ``token`` (``--initial-cluster-token``); a member added at runtime never matches."""
        return member_id_from(self.peer_urls, token) == self.id


@dataclass(frozen=True)
class ConfState:
    """raftpb.ConfState as etcd 3.5+ keeps it in ``meta/confState``."""

    voters: Tuple[int, ...]
    learners: Tuple[int, ...]
    voters_outgoing: Tuple[int, ...]
    learners_next: Tuple[int, ...]
    auto_leave: bool


@dataclass(frozen=True)
class Downgrade:
    """``cluster/downgrade`` (etcd 3.5+)."""

    target_version: str
    enabled: bool


# --- identity arithmetic (server/etcdserver/api/membership/member.go, cluster.go) -------------
def member_id_from(peer_urls: Sequence[str], token: str = "", unix_time: Optional[int] = None) -> int:
    """The member id etcd computes in ``membership.NewMember``: the first 8 bytes (big-endian) of
    sha1(sorted peer URLs concatenated + cluster name + decimal unix seconds if a time is given).

    At bootstrap and at ``snapshot restore`` etcd passes the ``--initial-cluster-token`` and no
    time, so the id depends only on the peer URLs and the token. ``member add`` passes an empty
    cluster name and ``time.Now()``, so a runtime-added member's id is sha1(peer URLs + seconds).
    """
    b = "".join(sorted(peer_urls)).encode() + token.encode()
    if unix_time is not None:
        b += str(unix_time).encode()
    return int.from_bytes(hashlib.sha1(b).digest()[:8], "big")


def cluster_id_from(member_ids: Sequence[int]) -> int:
    """The cluster id etcd computes in ``RaftCluster.genID``: the first 8 bytes of sha1 of the
    sorted member ids, each 8 bytes big-endian. etcd computes it once, at bootstrap (or restore),
    and keeps it in the WAL: after any member add/remove the stored id no longer follows from the
    current members."""
    b = b"".join(i.to_bytes(8, "big") for i in sorted(member_ids))
    return int.from_bytes(hashlib.sha1(b).digest()[:8], "big")


# --- value decoding ----------------------------------------------------------------------------
def bounded_json(raw: bytes, what: str, *, max_bytes: int, max_depth: int) -> Dict[str, Any]:
    """A JSON object read by ``safejson`` (size, nesting counted before parsing, finite numbers,
    64-bit integers) with no key named twice; every problem is one SnapshotFormatError naming
    ``what``, worded as it always was."""
    try:
        obj = safejson.loads(raw, max_bytes=max_bytes, max_depth=max_depth, unique_keys=True)
    except safejson.UnsafeJson as exc:
        why = {
            safejson.SIZE: f"JSON of {len(raw)} bytes (limit {max_bytes})",
            safejson.ENCODING: "value is not UTF-8",
            safejson.DEPTH: f"JSON nested deeper than {max_depth}",
        }.get(exc.kind, f"bad JSON ({exc.detail.splitlines()[0][:80]})")
        raise SnapshotFormatError(f"{what}: {why}") from None
    if not isinstance(obj, dict):
        raise SnapshotFormatError(f"{what}: JSON value is not an object")
    return obj


def _json(raw: bytes, what: str) -> Dict[str, Any]:
    """A member / confState / downgrade value: bounded_json with this module's limits."""
    return bounded_json(raw, what, max_bytes=MAX_VALUE, max_depth=MAX_JSON_DEPTH)


def _str_list(obj: Dict[str, Any], key: str, what: str) -> Tuple[str, ...]:
    v = obj.get(key)
    if v is None:  # Go marshals a nil slice as null; omitempty drops it
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise SnapshotFormatError(f"{what}: {key} is not a list of strings")
    return tuple(v)


def _u64_list(obj: Dict[str, Any], key: str, what: str) -> Tuple[int, ...]:
    v = obj.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 64 for i in v
    ):
        raise SnapshotFormatError(f"{what}: {key} is not a list of uint64")
    return tuple(v)


def _bool(obj: Dict[str, Any], key: str, what: str) -> bool:
    v = obj.get(key, False)
    if not isinstance(v, bool):
        raise SnapshotFormatError(f"{what}: {key} is not a boolean")
    return v


def _member_id(key: Optional[bytes], what: str) -> int:
    # types.IDFromString is strconv.ParseUint(s, 16, 64); Python's int() would also take
    # "0x", "_" and spaces, hence the pattern.
    if key is None or not _HEX_ID.match(key):
        shown = "(too long)" if key is None else repr(key[:32])
        raise SnapshotFormatError(f"{what}: key {shown} is not a member id")
    mid = int(key, 16)
    if mid == 0:
        raise SnapshotFormatError(f"{what}: member id 0 (raft's 'none')")
    return mid


def _member(key: Optional[bytes], raw: bytes) -> Member:
    mid = _member_id(key, "members")
    what = f"members/{mid:x}"
    obj = _json(raw, what)
    jid = obj.get("id", mid)
    if isinstance(jid, bool) or not isinstance(jid, int) or jid != mid:
        raise SnapshotFormatError(f"{what}: JSON id {jid!r} differs from the key")
    name = obj.get("name", "")
    if not isinstance(name, str):
        raise SnapshotFormatError(f"{what}: name is not a string")
    return Member(
        id=mid,
        name=name,
        peer_urls=_str_list(obj, "peerURLs", what),
        client_urls=_str_list(obj, "clientURLs", what),
        is_learner=_bool(obj, "isLearner", what),
    )


def _u64(raw: bytes, what: str) -> int:
    if len(raw) != 8:
        raise SnapshotFormatError(f"{what}: {len(raw)} bytes, not a uint64")
    return int.from_bytes(raw, "big")


def _revision(key: bytes, what: str) -> Revision:
    """An MVCC revision key (server/mvcc/revision.go): main(8) '_' sub(8) [+ 't' for a tombstone]."""
    if len(key) not in (17, 18) or key[8:9] != b"_" or (len(key) == 18 and key[17:] != b"t"):
        raise SnapshotFormatError(f"{what}: {key[:20].hex()} is not a revision")
    main = int.from_bytes(key[:8], "big")
    sub = int.from_bytes(key[9:17], "big")
    if main > MAX_REVISION or sub > MAX_REVISION:
        raise SnapshotFormatError(f"{what}: revision {main}.{sub} overflows int64")
    return Revision(main, sub, len(key) == 18)


def _text(raw: bytes, what: str) -> str:
    try:
        s = raw.decode("ascii")
    except UnicodeDecodeError:
        raise SnapshotFormatError(f"{what}: not ASCII") from None
    if not _VERSION.match(s):
        raise SnapshotFormatError(f"{what}: {s[:40]!r} is not a version")
    return s
