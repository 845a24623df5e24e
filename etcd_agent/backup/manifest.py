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
from typing import Any, Dict, List, Mapping, Optional, Tuple

from etcd_agent.chain.sign import key_id
from etcd_agent.errors import BackupCorrupt, SnapshotFormatError
from etcd_agent.etcd.snapdb import bounded_json

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
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_CHAIN_ID = re.compile(r"[0-9a-f]{32}\Z")
_AGE_RECIPIENT = re.compile(r"age1[02-9ac-hj-np-z]{58}\Z")  # bech32 of 32 bytes; the checksum is age's
MAX_RECIPIENTS = 64


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class ManifestMember:
    """A member as etcd's member list named it when the backup was taken (a claim)."""

    id: str
    name: str
    peer_urls: Tuple[str, ...]
    client_urls: Tuple[str, ...] = ()
    is_learner: bool = False


@dataclass(frozen=True)
class Encryption:
    """How the snapshot member is encrypted, and what decrypting it must give."""

    recipients: Tuple[str, ...]  # age1... public keys, as written to the header (in order)
    plaintext_size: int
    plaintext_sha256: str
    format: str = "age"

    def to_json(self) -> Dict[str, Any]:
        return {"format": self.format, "recipients": list(self.recipients), "plaintext_size": self.plaintext_size,
                "plaintext_sha256": self.plaintext_sha256}


@dataclass(frozen=True)
class Signature:
    alg: str
    key_id: str
    mac: str


@dataclass(frozen=True)
class Manifest:
    """One backup's manifest. ``cluster_id``/``members`` are None when absent (they prove nothing
    either way)."""

    files: Mapping[str, FileEntry]
    name: str = ""
    created: str = ""
    created_unix: Optional[int] = None
    host: str = ""
    member: str = ""
    endpoint: str = ""
    member_id: str = ""
    cluster_name: Optional[str] = None
    cluster_id: Optional[str] = None
    members: Optional[Tuple[ManifestMember, ...]] = None
    revision: int = 0
    store_revision: Optional[int] = None
    etcd_version: Optional[str] = None
    agent_version: str = ""
    db_size: Optional[int] = None
    compression: str = "none"
    missing: Mapping[str, str] = field(default_factory=dict)
    rendered: Mapping[str, str] = field(default_factory=dict)
    snapshot: Mapping[str, Any] = field(default_factory=dict)
    imported: Optional[Mapping[str, Any]] = None
    encryption: Optional[Encryption] = None
    verified: bool = False
    signature: Optional[Signature] = None
    format_version: int = FORMAT_VERSION

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
    def snapshot_member(self) -> str:
        """The snapshot's member name: ``etcd_snapshot.db``, or ``etcd_snapshot.db.age`` encrypted."""
        return SNAPSHOT_AGE if self.encryption is not None else SNAPSHOT

    # ------------------------------------------------------------ JSON

    def to_json(self) -> Dict[str, Any]:
        """The manifest as written (also the dict shape restore's older code reads)."""
        out: Dict[str, Any] = {
            "format": FORMAT,
            "format_version": self.format_version,
            "name": self.name,
            "created": self.created,
            "host": self.host,
            "member": self.member,
            "endpoint": self.endpoint,
            "member_id": self.member_id,
            "revision": self.revision,
            "agent_version": self.agent_version,
            "compression": self.compression,
            "files": {n: {"size": f.size, "sha256": f.sha256} for n, f in sorted(self.files.items())},
            "missing": dict(self.missing),
            "snapshot": dict(self.snapshot),
            "verified": self.verified,
        }
        if self.created_unix is not None:
            out["created_unix"] = self.created_unix
        if self.cluster_name is not None or self.cluster_id is not None:
            cl: Dict[str, Any] = {}
            if self.cluster_name is not None:
                cl["name"] = self.cluster_name
            if self.cluster_id is not None:
                cl["id"] = self.cluster_id
            out["cluster"] = cl
        if self.members is not None:
            out["members"] = [
                {"id": m.id, "name": m.name, "peer_urls": list(m.peer_urls), "client_urls": list(m.client_urls),
                 "is_learner": m.is_learner}
                for m in self.members
            ]
        for key, value in (("store_revision", self.store_revision), ("etcd_version", self.etcd_version),
                           ("db_size", self.db_size)):
            if value is not None:
                out[key] = value
        if self.rendered:
            out["rendered"] = dict(self.rendered)
        if self.imported is not None:
            out["imported"] = dict(self.imported)
        if self.encryption is not None:
            out["encryption"] = self.encryption.to_json()
        if self.signature is not None:
            out["signature"] = {"alg": self.signature.alg, "key_id": self.signature.key_id, "mac": self.signature.mac}
        return out

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str = MANIFEST, max_bytes: int = MAX_MANIFEST,
                  max_depth: int = MAX_DEPTH) -> "Manifest":
        """Parse ``data`` (bounded: size, nesting, strict schema); BackupCorrupt with one sentence."""
        try:
            obj = bounded_json(data, where, max_bytes=max_bytes, max_depth=max_depth)
        except SnapshotFormatError as exc:
            raise BackupCorrupt(f"{exc.message}: not a manifest the agent writes") from None
        return _parse(obj, where)

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


# ---------------------------------------------------------------- strict parsing

_TOP = {
    "format", "format_version", "name", "created", "created_unix", "host", "member", "endpoint", "member_id",
    "cluster", "members", "revision", "store_revision", "etcd_version", "agent_version", "db_size", "compression",
    "files", "missing", "snapshot", "verified", "rendered", "imported", "signature", "encryption",
}


class _Fields:
    """Typed access to one JSON object, every wrong type a BackupCorrupt naming the field."""

    def __init__(self, obj: Mapping[str, Any], where: str, path: str = "") -> None:
        self.obj, self.where, self.path = obj, where, path

    def bad(self, key: str, want: str) -> BackupCorrupt:
        return BackupCorrupt(
            f"{self.where}: field {self.path}{key} is not {want}: not a manifest the agent writes"
        )

    def text(self, key: str, default: Optional[str] = "", limit: int = 4096) -> Optional[str]:
        v = self.obj.get(key, default)
        if v is None and default is None:
            return None
        if not isinstance(v, str) or len(v) > limit:
            raise self.bad(key, "a short string")
        return v

    def num(self, key: str, default: Optional[int] = None) -> Optional[int]:
        v = self.obj.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
            raise self.bad(key, "a non-negative integer")
        return v

    def sub(self, key: str) -> Optional[Mapping[str, Any]]:
        v = self.obj.get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self.bad(key, "an object")
        return v

    def str_map(self, key: str) -> Dict[str, str]:
        v = self.sub(key) or {}
        out: Dict[str, str] = {}
        for k, x in v.items():
            if k not in FILE_NAMES or not isinstance(x, str) or len(x) > 4096:
                raise self.bad(key, f"a map of {', '.join(FILE_NAMES)} to short strings")
            out[k] = x
        return out


def _parse(obj: Mapping[str, Any], where: str) -> Manifest:
    f = _Fields(obj, where)
    version = _format_version(obj, f, where)
    files = _files(f, where)
    encryption = _encryption(f.sub("encryption"), where)
    _check_snapshot_listed(files, encryption, version, where)
    cluster = f.sub("cluster")
    cf = _Fields(cluster or {}, where, "cluster.")
    members = _members(obj, f, where)
    snapshot = f.sub("snapshot") or {}
    imported = f.sub("imported")
    signature = _signature(f.sub("signature"), where)
    return Manifest(
        files=files,
        name=f.text("name") or "",
        created=f.text("created") or "",
        created_unix=f.num("created_unix"),
        host=f.text("host") or "",
        member=f.text("member") or "",
        endpoint=f.text("endpoint") or "",
        member_id=f.text("member_id") or "",
        cluster_name=cf.text("name", None),
        cluster_id=cf.text("id", None),
        members=members,
        revision=f.num("revision", 0) or 0,
        store_revision=f.num("store_revision"),
        etcd_version=f.text("etcd_version", None),
        agent_version=f.text("agent_version") or "",
        db_size=f.num("db_size"),
        compression=f.text("compression", "none") or "none",
        missing=f.str_map("missing"),
        rendered=f.str_map("rendered"),
        snapshot=dict(snapshot),
        imported=dict(imported) if imported is not None else None,
        encryption=encryption,
        verified=_bool(obj, "verified", f),
        signature=signature,
        format_version=version,
    )


def _format_version(obj: Mapping[str, Any], f: _Fields, where: str) -> int:
    """One of ours (format, no unknown field) and a format version this agent reads."""
    if obj.get("format") != FORMAT:
        raise BackupCorrupt(f"{where}: not an {FORMAT} manifest (format {str(obj.get('format'))[:40]!r})")
    unknown = sorted(set(obj) - _TOP)
    if unknown:
        raise BackupCorrupt(f"{where}: unknown field {unknown[0][:40]!r}: not a manifest this agent writes")
    version = f.num("format_version")
    if version is None or not 1 <= version <= ENCRYPTED_FORMAT_VERSION:
        raise BackupCorrupt(f"{where}: manifest format version {version!r} is not supported "
                            f"(1..{ENCRYPTED_FORMAT_VERSION})")
    return version


def _files(f: _Fields, where: str) -> Dict[str, FileEntry]:
    files_obj = f.sub("files") or {}
    files: Dict[str, FileEntry] = {}
    for n, entry in files_obj.items():
        if n not in FILE_NAMES or not isinstance(entry, dict):
            raise BackupCorrupt(f"{where}: lists an unexpected file {n[:40]!r}")
        ef = _Fields(entry, where, f"files.{n}.")
        size, sha = ef.num("size"), ef.text("sha256", None)
        if size is None or sha is None or not _HEX64.match(sha):
            raise BackupCorrupt(f"{where}: entry for {n} lacks a size and sha256")
        files[n] = FileEntry(size, sha)
    return files


def _check_snapshot_listed(files: Mapping[str, FileEntry], encryption: Optional[Encryption], version: int,
                           where: str) -> None:
    """Exactly one snapshot is listed: the encrypted one when the manifest says so (format 2+)."""
    if encryption is not None and version < ENCRYPTED_FORMAT_VERSION:
        raise BackupCorrupt(f"{where}: an encrypted snapshot in a format {version} manifest: not one the agent writes")
    want = SNAPSHOT_AGE if encryption is not None else SNAPSHOT
    if want not in files or len([n for n in SNAPSHOTS if n in files]) != 1:
        raise BackupCorrupt(f"{where}: lists no {want}" + (f" (encryption says the snapshot is {want})"
                                                             if encryption is not None else ""))


def _members(obj: Mapping[str, Any], f: _Fields, where: str) -> Optional[Tuple[ManifestMember, ...]]:
    raw_members = obj.get("members")
    if raw_members is None:
        return None
    if not isinstance(raw_members, list) or len(raw_members) > 1024:
        raise f.bad("members", "a list")
    out: List[ManifestMember] = []
    for i, m in enumerate(raw_members):
        if not isinstance(m, dict):
            raise f.bad(f"members[{i}]", "an object")
        mf = _Fields(m, where, f"members[{i}].")
        out.append(ManifestMember(
            id=mf.text("id") or "", name=mf.text("name") or "",
            peer_urls=_strs(m, "peer_urls", mf), client_urls=_strs(m, "client_urls", mf),
            is_learner=_bool(m, "is_learner", mf),
        ))
    return tuple(out)


def _signature(sig_obj: Optional[Mapping[str, Any]], where: str) -> Optional[Signature]:
    if sig_obj is None:
        return None
    sf = _Fields(sig_obj, where, "signature.")
    return Signature(sf.text("alg") or "", sf.text("key_id") or "", sf.text("mac") or "")


def _encryption(obj: Optional[Mapping[str, Any]], where: str) -> Optional[Encryption]:
    if obj is None:
        return None
    ef = _Fields(obj, where, "encryption.")
    unknown = sorted(set(obj) - {"format", "recipients", "plaintext_size", "plaintext_sha256"})
    if unknown:
        raise BackupCorrupt(f"{where}: unknown field encryption.{unknown[0][:40]!r}: not a manifest this agent writes")
    if obj.get("format") != "age":
        raise BackupCorrupt(f"{where}: encryption format {str(obj.get('format'))[:40]!r} is not one this agent reads "
                            "(age)")
    raw = obj.get("recipients")
    if (not isinstance(raw, list) or not 1 <= len(raw) <= MAX_RECIPIENTS
            or not all(isinstance(r, str) and _AGE_RECIPIENT.match(r) for r in raw)):
        raise ef.bad("recipients", f"a list of 1 to {MAX_RECIPIENTS} age recipients (age1...)")
    size, sha = ef.num("plaintext_size"), ef.text("plaintext_sha256", None)
    if size is None or sha is None or not _HEX64.match(sha):
        raise BackupCorrupt(f"{where}: encryption lacks the plaintext's size and sha256")
    return Encryption(tuple(raw), size, sha)


def _strs(obj: Mapping[str, Any], key: str, f: _Fields) -> Tuple[str, ...]:
    v = obj.get(key) or []
    if not isinstance(v, list) or len(v) > 64 or not all(isinstance(s, str) and len(s) < 4096 for s in v):
        raise f.bad(key, "a list of strings")
    return tuple(v)


def _bool(obj: Mapping[str, Any], key: str, f: _Fields) -> bool:
    v = obj.get(key, False)
    if not isinstance(v, bool):
        raise f.bad(key, "true or false")
    return v
