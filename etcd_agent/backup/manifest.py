"""``manifest.json``: what a backup claims about itself, as one typed value, and its signature.

A manifest is a *claim*. It is parsed with limits (size, nesting, a strict schema: unknown fields
are refused), and it is authenticated with HMAC-SHA256 over its canonical JSON using the
cluster's manifest key (``backup/keys``). Even a valid signature only proves that an agent holding
the key wrote it; *whose* snapshot it is comes from the snapshot's own database (``identity``),
never from ``cluster`` or ``members`` here.

Format 2 adds ``rendered`` (files the agent rendered because the host had none), ``imported``
(a runbook tarball turned into a backup by ``backup import``) and ``signature``; format 1
manifests (unsigned) still parse. Format 3 is a backup whose snapshot is encrypted (``[backup]
encrypt_to``): the member is ``etcd_snapshot.db.age``, ``files`` has its ciphertext's size and
sha256, and ``encryption`` says for whom (the recipients' public keys, never a key that decrypts)
and what decrypting it must give (the plaintext's size and sha256). Plain backups are still
written as format 2, so an older agent reads them.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field, replace
from typing import Annotated, Dict, Optional, Tuple

from etcd_agent.chain.sign import key_id
from etcd_agent.errors import AgentError, BackupCorrupt, SnapshotFormatError
from etcd_agent.etcd.snapdb import bounded_json
from etcd_agent.typedjson import Document, Items, JsonObject, Text

FORMAT = "etcd-agent-backup"
FORMAT_VERSION = 2  # what a plain backup's manifest is written as
ENCRYPTED_FORMAT_VERSION = 3  # an encrypted one's; also the highest this agent reads
CONF = "etcd.conf"
UNIT = "etcd.service"
SNAPSHOT = "etcd_snapshot.db"
# who took a backup (``snapshot.taken_by``): the operator's (cron, a timer, by hand, before an
# upgrade) or the daemon's own, taken to start a delta chain. Retention counts them apart.
ORIGINS = ("operator", "daemon")
# the encrypted snapshot: a standard age file, so `age -d -i KEY -o etcd_snapshot.db etcd_snapshot.db.age`
SNAPSHOT_AGE = SNAPSHOT + ".age"
MANIFEST = "manifest.json"
FILE_NAMES = (CONF, UNIT, SNAPSHOT, SNAPSHOT_AGE)
SNAPSHOTS = (SNAPSHOT, SNAPSHOT_AGE)
MAX_MANIFEST = 256 * 1024
MAX_DEPTH = 8
ALGORITHM = "hmac-sha256"
SIGNATURE_STATES = ("valid", "invalid", "unsigned", "unknown-key")
_CHAIN_ID = re.compile(r"[0-9a-f]{32}\Z")
_AGE_RECIPIENT = "age1[02-9ac-hj-np-z]{58}"  # bech32 of 32 bytes; the checksum is age's
MAX_RECIPIENTS = 64

U63 = (0.0, float((1 << 63) - 1))  # sizes, revisions, times: non-negative 63-bit integers
Short = Annotated[str, Text(4096)]  # every string field: at most 4 KiB
Sha256 = Annotated[str, Text(64, "[0-9a-f]{64}")]
Urls = Annotated[Tuple[Annotated[str, Text(4095)], ...], Items(0, 64)]
FileNotes = Dict[str, Short]  # per file of FILE_NAMES: why it is missing, how it was rendered


@dataclass(frozen=True)
class FileEntry(Document):
    size: int
    sha256: Sha256

    RANGES = {"size": U63}


@dataclass(frozen=True)
class ManifestMember(Document):
    """A member as etcd's member list named it when the backup was taken (a claim)."""

    id: Short = ""
    name: Short = ""
    peer_urls: Urls = ()
    client_urls: Urls = ()
    is_learner: bool = False


@dataclass(frozen=True)
class ClusterClaim(Document):
    """The cluster's name and id (hex) as the backup's writer saw them: a claim, never proof."""

    name: Optional[Short] = None
    id: Optional[Short] = None


@dataclass(frozen=True)
class Encryption(Document):
    """How the snapshot member is encrypted, and what decrypting it must give."""

    recipients: Annotated[Tuple[Annotated[str, Text(62, _AGE_RECIPIENT)], ...], Items(1, MAX_RECIPIENTS)]  # age1...
    plaintext_size: int
    plaintext_sha256: Sha256

    TAGS = {"format": ("age",)}  # the only format this agent reads (and writes)
    CLOSED = True
    RANGES = {"plaintext_size": U63}


@dataclass(frozen=True)
class Signature(Document):
    alg: Short = ""
    key_id: Short = ""
    mac: Short = ""


@dataclass(frozen=True)
class Manifest(Document):
    """One backup's manifest. ``cluster``/``members`` are None when absent (they prove nothing
    either way). Strict: unknown fields are refused, every field is checked against its type and
    bounds, a refusal is one BackupCorrupt naming the field. ``snapshot`` and ``imported`` are
    free-form facts (their keys grew over versions) kept exactly as read: the signature covers them."""

    files: Dict[str, FileEntry]
    name: Short = ""
    created: Short = ""
    created_unix: Optional[int] = None
    host: Short = ""
    member: Short = ""
    endpoint: Short = ""
    member_id: Short = ""
    cluster: Optional[ClusterClaim] = None
    members: Annotated[Optional[Tuple[ManifestMember, ...]], Items(0, 1024)] = None
    revision: int = 0
    store_revision: Optional[int] = None
    etcd_version: Optional[Short] = None
    agent_version: Short = ""
    db_size: Optional[int] = None
    compression: Short = "none"
    missing: FileNotes = field(default_factory=dict)
    rendered: FileNotes = field(default_factory=dict)
    snapshot: JsonObject = field(default_factory=dict)
    imported: Optional[JsonObject] = None
    encryption: Optional[Encryption] = None
    verified: bool = False
    signature: Optional[Signature] = None
    format_version: int = FORMAT_VERSION

    ERROR = BackupCorrupt
    TAGS = {"format": (FORMAT,)}
    CLOSED = True
    REQUIRED = ("format_version",)
    OMIT_DEFAULT = ("rendered",)  # written only when a file was rendered (format 2)
    RANGES = {"created_unix": U63, "revision": U63, "store_revision": U63, "db_size": U63}

    @property
    def cluster_name(self) -> Optional[str]:
        return self.cluster.name if self.cluster is not None else None

    @property
    def cluster_id(self) -> Optional[str]:
        return self.cluster.id if self.cluster is not None else None

    @property
    def origin(self) -> str:
        """Who took it (``ORIGINS``); inside ``snapshot`` so that agents that predate it still read
        the manifest (their schema is strict at the top level). Absent: an operator's."""
        v = self.snapshot.get("taken_by")
        return v if isinstance(v, str) and v in ORIGINS else "operator"

    @property
    def checkpoint_of(self) -> Optional[str]:
        """The delta chain (its id) the daemon took this backup inside, as a checkpoint that a
        point-in-time restore may start its replay from (``delta.segments.Checkpoint``); None for
        any other backup. A claim: the chain vouching for the snapshot's sha256 is what a restore
        goes by; this decides only how retention counts it (and only when signed)."""
        v = self.snapshot.get("checkpoint")
        cid = v.get("chain_id") if isinstance(v, dict) else None
        return cid if isinstance(cid, str) and _CHAIN_ID.match(cid) and self.origin == "daemon" else None

    @property
    def lean_from(self) -> Optional[int]:
        """The snapshot's size as etcd streamed it, when the daemon defragmented it offline before
        archiving it (a lean checkpoint, ``backup.lean``); None for any other backup (and for every
        manifest written before it)."""
        v = self.snapshot.get("lean")
        n = v.get("from_bytes") if isinstance(v, dict) else None
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    @property
    def snapshot_member(self) -> str:
        """The snapshot's member name: ``etcd_snapshot.db``, or ``etcd_snapshot.db.age`` encrypted."""
        return SNAPSHOT_AGE if self.encryption is not None else SNAPSHOT

    # ------------------------------------------------------------ JSON

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def refused(cls, where: str, problem: str) -> AgentError:
        return BackupCorrupt(f"{where}: {problem}: not a manifest the agent writes")

    @classmethod
    def from_json(cls, d: object, where: str = MANIFEST, *, max_bytes: int = MAX_MANIFEST,
                  max_depth: int = MAX_DEPTH) -> "Manifest":
        """``d``, the manifest's bytes (parsed bounded: size, nesting, no key twice) or its decoded
        JSON, checked field by field; BackupCorrupt with one sentence."""
        if isinstance(d, bytes):
            try:
                d = bounded_json(d, where, max_bytes=max_bytes, max_depth=max_depth)
            except SnapshotFormatError as exc:
                raise BackupCorrupt(f"{exc.message}: not a manifest the agent writes") from None
        return super().from_json(d, where)

    def violation(self) -> Optional[str]:
        """A format version this agent reads, only the files it writes, exactly one snapshot
        listed (the encrypted one when the manifest says so, format 3)."""
        if not 1 <= self.format_version <= ENCRYPTED_FORMAT_VERSION:
            return f"manifest format version {self.format_version} is not supported (1..{ENCRYPTED_FORMAT_VERSION})"
        unexpected = sorted(set(self.files) - set(FILE_NAMES))
        if unexpected:
            return f"lists an unexpected file {unexpected[0][:40]!r}"
        for key, notes in (("missing", self.missing), ("rendered", self.rendered)):
            if set(notes) - set(FILE_NAMES):
                return f"Manifest.{key} must map {', '.join(FILE_NAMES)} to short strings"
        if self.encryption is not None and self.format_version < ENCRYPTED_FORMAT_VERSION:
            return f"an encrypted snapshot in a format {self.format_version} manifest"
        want = self.snapshot_member
        if want not in self.files or len([n for n in SNAPSHOTS if n in self.files]) != 1:
            return f"lists no {want}" + (f" (encryption says the snapshot is {want})" if self.encryption else "")
        return None

    # ------------------------------------------------------------ signature

    def canonical(self) -> bytes:
        """The bytes the signature covers: the JSON without ``signature``, sorted, compact."""
        body = self.to_json()
        body.pop("signature", None)
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    def signed(self, key: bytes) -> "Manifest":
        unsigned = replace(self, signature=None)
        mac = hmac.new(key, unsigned.canonical(), hashlib.sha256).hexdigest()
        return replace(self, signature=Signature(ALGORITHM, key_id(key), mac))

    def signature_state(self, key: Optional[bytes]) -> str:
        """valid | invalid | unsigned | unknown-key (signed, but not with ``key``, or no key here)."""
        sig = self.signature
        if sig is None:
            return "unsigned"
        if key is None or sig.key_id != key_id(key) or sig.alg != ALGORITHM:
            return "unknown-key"
        want = hmac.new(key, self.canonical(), hashlib.sha256).hexdigest()
        return "valid" if hmac.compare_digest(want, sig.mac) else "invalid"
