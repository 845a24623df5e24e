"""Encrypted delta segments (``.seg.age``): a v1 segment in age, behind a clear seal.

With ``[backup] encrypt_to`` the watcher writes every segment through age to those recipients
as it goes (no plaintext byte reaches the disk) and seals it when it closes. Layout::

    magic     8 bytes  b"ETCDDSEA"
    seal      u32 length + UTF-8 JSON (``Seal``), then zero bytes up to offset 8192
    age file  from offset 8192 to the end: the v1 segment (``segments``), age-encrypted

so ``tail -c +8193 F.seg.age | age -d -i key.txt > F.seg`` gives the plain segment, which the
agent (and anyone with the layout in docs/delta-segments.md) reads like any other.

The seal repeats, in the clear, what a listing and a chain check need - the inner segment's
header and footer - with the sizes and sha256 of the age file and of the plaintext, the
recipients, and an HMAC-SHA256 over all of it with the cluster's manifest key when the daemon
has one. The next segment's ``prev_sha256`` is the sha256 of this whole file (what
``sha256sum`` prints), as for plain segments, so:

- without the key (``verify_sealed``) a chain is followed and checked as far as bytes allow:
  every link's hash, the age file's sha256 and size, its header (bounded) and a size its
  chunking can produce, giving the exact plaintext size the seal must state;
- with the key (``open_sealed``) each chunk authenticates as it is decrypted into the caller's
  private staging dir (created only once the header has opened: a wrong key writes nothing),
  the plaintext is read as a v1 segment with every check, and its header, footer, size and
  sha256 must be exactly what the seal says. The seal's HMAC is checked when this host has the
  key: a seal that fails it is damage, never data.

Anything wrong is ``SegmentCorrupt`` (a chain stops there), a wrong identity ``IdentityRefused``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Iterator, List, Optional, Sequence, Tuple

from etcd_agent import safejson
from etcd_agent.chain.errors import NotASegment, ReplayError, SegmentCorrupt, SegmentForged, unopenable
from etcd_agent.chain.segments import (
    MAX_SEGMENT,
    SEALED_EXT,
    SHA256_HEX,
    SIGNATURE,
    U32,
    SealFacts,
    SegmentFooter,
    SegmentHeader,
    SegmentInfo,
    SegmentRecord,
    json_bytes,
)
from etcd_agent.chain.sign import key_id
from etcd_agent.fs import regular_fd
from etcd_agent.typedjson import Items, JsonObject, Text

if TYPE_CHECKING:  # pragma: no cover - the age code (and `cryptography`) only when encrypting
    from etcd_agent.age import Encryptor, Identities, X25519Recipient

SEAL_MAGIC = b"ETCDDSEA"
SEAL_BLOCK = 8192  # the age file starts here
SEAL_FORMAT = "etcd-agent-delta-sealed"
SEAL_VERSION = 1
# age's overhead on the largest segment: a header of 20 recipients (~2 KiB), the nonce, a tag a chunk
AGE_OVERHEAD_MAX = 64 * 1024 + 16 + (MAX_SEGMENT // (64 * 1024) + 1) * 16
READ = 1 << 20
SIZE = (0, (1 << 63) - 1)


class StagingFailed(ReplayError):
    """The private staging dir could not take a decrypted segment (disk full ...): the restore
    stops; a chain is never cut short for it."""


RECIPIENT = Text(99, r"age1.+")  # an age X25519 public key (``age1...``) of a sane length


@dataclass(frozen=True)
class Seal(SegmentRecord):
    """The clear part of an encrypted segment: a claim until checked (see the module doc)."""

    WHAT = "seal"
    TAGS = {"format": (SEAL_FORMAT,), "format_version": (SEAL_VERSION,)}
    CLOSED = True
    RANGES = {"plain_size": SIZE, "age_size": SIZE}

    header: SegmentHeader
    footer: SegmentFooter
    plain_size: int
    plain_sha256: Annotated[str, Text(64, SHA256_HEX)]
    age_size: int
    age_sha256: Annotated[str, Text(64, SHA256_HEX)]
    recipients: Annotated[Tuple[Annotated[str, RECIPIENT], ...], Items(1, 64)]
    signature: Annotated[Optional[Tuple[str, str]], SIGNATURE] = None  # (key id, hex mac)

    def body(self) -> JsonObject:
        """What the signature covers: the seal without it."""
        return self.unsigned().to_json()

    def unsigned(self) -> "Seal":
        return dataclasses.replace(self, signature=None)

    def to_bytes(self) -> bytes:
        return json_bytes(self.to_json())

    def signed(self, key: bytes) -> "Seal":
        mac = hmac.new(key, json_bytes(self.body()), hashlib.sha256).hexdigest()
        return dataclasses.replace(self, signature=(key_id(key), mac))

    def signature_state(self, key: Optional[bytes]) -> str:
        """valid | unsigned | unknown-key (signed, not with ``key``, or no key here) | invalid."""
        if self.signature is None:
            return "unsigned"
        if key is None or self.signature[0] != key_id(key):
            return "unknown-key"
        want = hmac.new(key, json_bytes(self.body()), hashlib.sha256).hexdigest()
        return "valid" if hmac.compare_digest(want, self.signature[1]) else "invalid"


# ---------------------------------------------------------------- writing


class SealingSink:
    """Where a ``SegmentWriter`` with recipients sends its bytes: through age into ``fh``, behind
    a seal block reserved at the start (filled in by ``seal``)."""

    def __init__(self, fh: Any, recipients: Sequence["X25519Recipient"], key: Optional[bytes]) -> None:
        from etcd_agent.age import Encryptor

        self._fh = fh
        self._enc: "Encryptor" = Encryptor(recipients)
        self.recipients = tuple(str(r) for r in self._enc.recipients)
        self._key = key
        self._age_sha = hashlib.sha256()
        self.age_size = 0
        fh.write(b"\0" * SEAL_BLOCK)

    def write(self, data: bytes) -> None:
        out = self._enc.update(data)
        if out:
            self._age_sha.update(out)
            self._fh.write(out)
            self.age_size += len(out)

    def seal(self, header: SegmentHeader, footer: SegmentFooter, plain_size: int, plain_sha256: str) -> Seal:
        """The last chunk written, the seal put in front: the file is whole once ``fh`` is flushed."""
        tail = self._enc.finish()
        self._age_sha.update(tail)
        self._fh.write(tail)
        self.age_size += len(tail)
        seal = Seal(header, footer, plain_size, plain_sha256, self.age_size, self._age_sha.hexdigest(),
                    self.recipients)
        if self._key is not None:
            seal = seal.signed(self._key)
        self._fh.flush()
        self._fh.seek(0)
        self._fh.write(seal_block(seal))
        self._fh.flush()
        return seal


def seal_block(seal: Seal) -> bytes:
    raw = seal.to_bytes()
    if len(SEAL_MAGIC) + U32.size + len(raw) > SEAL_BLOCK:  # 20 recipients take ~1.3 KiB
        raise ValueError(f"the seal is {len(raw)} bytes, more than fits in {SEAL_BLOCK}")
    block = SEAL_MAGIC + U32.pack(len(raw)) + raw
    return block + b"\0" * (SEAL_BLOCK - len(block))


# ---------------------------------------------------------------- reading


def _open(path: str) -> Tuple[int, int]:
    try:
        fd = regular_fd(path)
    except OSError as exc:
        raise unopenable(path, exc, "open") from None
    try:
        return fd, os.fstat(fd).st_size
    except OSError as exc:
        os.close(fd)
        raise SegmentCorrupt(path, f"cannot read: {exc.strerror or exc}") from None


def _seal_of(path: str, block: bytes, size: int) -> Seal:
    if block[:8] != SEAL_MAGIC:  # first: junk shorter than a seal is still junk, not a truncated segment
        raise NotASegment(path, "not an encrypted delta segment (bad magic)")
    if len(block) < SEAL_BLOCK or size < SEAL_BLOCK:
        raise SegmentCorrupt(path, f"truncated: {size} bytes, shorter than an encrypted segment's {SEAL_BLOCK}-byte "
                                   "seal")
    (n,) = U32.unpack_from(block, 8)
    if n > SEAL_BLOCK - 12:
        raise SegmentCorrupt(path, f"seal length {n} out of bounds")
    if any(block[12 + n:]):
        raise SegmentCorrupt(path, "bytes after the seal inside its block")
    try:
        raw = safejson.loads(block[12 : 12 + n], max_bytes=SEAL_BLOCK)
    except ValueError as exc:
        raise SegmentCorrupt(path, f"bad seal: {exc}") from None
    seal = Seal.from_json(raw, path)
    if SEAL_BLOCK + seal.age_size != size:
        raise SegmentCorrupt(path, f"{size} bytes where its seal says {SEAL_BLOCK + seal.age_size}: truncated or "
                                   "appended to")
    if seal.plain_size > MAX_SEGMENT:
        raise SegmentCorrupt(path, f"declares {seal.plain_size} bytes, more than the {MAX_SEGMENT}-byte limit")
    if seal.age_size > MAX_SEGMENT + AGE_OVERHEAD_MAX:
        raise SegmentCorrupt(path, f"declares {seal.age_size} bytes of age file, more than a {MAX_SEGMENT}-byte "
                                   "segment encrypts to")
    return seal


def read_seal(path: str) -> Seal:
    """Only the seal (one bounded read; sizes checked against the file, nothing else)."""
    fd, size = _open(path)
    try:
        block = os.pread(fd, SEAL_BLOCK, 0)
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return _seal_of(path, block, size)


def _age_bytes(path: str, fd: int, size: int) -> Iterator[bytes]:
    """The age file after the seal block, 1 MiB at a time (memory flat whatever its size)."""
    at = SEAL_BLOCK
    while at < size:
        chunk = os.pread(fd, min(READ, size - at), at)
        if not chunk:
            raise SegmentCorrupt(path, f"truncated while read: {at} of {size} bytes")
        at += len(chunk)
        yield chunk


def _facts(seal: Seal, path: str, signature: str, opened: bool) -> SealFacts:
    return SealFacts(path, seal.recipients, seal.plain_size, seal.plain_sha256, signature, opened)


def _signature(path: str, seal: Seal, key: Optional[bytes]) -> str:
    state = seal.signature_state(key)
    if state == "invalid":
        raise SegmentForged(path, "its seal does not match its signature (manifest key): changed after it was written")
    return state


def verify_sealed(path: str, *, key: Optional[bytes] = None) -> SegmentInfo:
    """Check an encrypted segment without its key: seal, sizes, age structure, sha256 (see the
    module doc). The events stay unread: the info has no lease records."""
    from etcd_agent.age import StructureCheck
    from etcd_agent.errors import CiphertextCorrupt

    fd, size = _open(path)
    whole = hashlib.sha256()
    try:
        block = os.pread(fd, SEAL_BLOCK, 0)
        seal = _seal_of(path, block, size)
        whole.update(block)
        check = StructureCheck(sha256=True, what="its age file")
        for chunk in _age_bytes(path, fd, size):
            check.update(chunk)
            whole.update(chunk)
        facts = check.finish()
    except CiphertextCorrupt as exc:
        raise SegmentCorrupt(path, exc.message) from None
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if facts.sha256 != seal.age_sha256:
        raise SegmentCorrupt(path, "its age file's sha256 is not the one its seal states: damaged or replaced")
    if facts.plaintext_size != seal.plain_size:
        raise SegmentCorrupt(path, f"its age file holds {facts.plaintext_size} plaintext bytes, its seal says "
                                   f"{seal.plain_size}")
    if facts.x25519_stanzas != len(facts.stanza_types) or len(facts.stanza_types) != len(seal.recipients):
        raise SegmentCorrupt(path, f"its age header has {len(facts.stanza_types)} recipient stanza(s) "
                                   f"({', '.join(sorted(set(facts.stanza_types)))}), its seal names "
                                   f"{len(seal.recipients)} X25519 recipient(s)")
    sig = _signature(path, seal, key)
    return SegmentInfo(path, size, whole.hexdigest(), seal.header, seal.footer, (), _facts(seal, path, sig, False))


def open_sealed(path: str, identities: "Identities", staging_dir: str, *, key: Optional[bytes] = None) -> SegmentInfo:
    """Decrypt an encrypted segment into ``staging_dir`` (the caller's, 0700) and check all of it.

    Returns the info of the plaintext copy (``path`` there, ``sealed.opened``), whose ``sha256``
    and ``size`` are still the encrypted file's (what the chain links by). A wrong identity is
    IdentityRefused before a byte is written; damage anywhere is SegmentCorrupt and removes the copy.
    """
    from etcd_agent.age import Decryptor
    from etcd_agent.chain.reader import verify_segment
    from etcd_agent.errors import CiphertextCorrupt

    name = os.path.basename(path)
    if not name.endswith(SEALED_EXT):
        raise SegmentCorrupt(path, "not an encrypted segment name (.seg.age)")
    out_path = os.path.join(staging_dir, name[: -len(SEALED_EXT)])
    fd, size = _open(path)
    out_fd = -1
    ok = False
    try:
        block = os.pread(fd, SEAL_BLOCK, 0)
        seal = _seal_of(path, block, size)
        sig = _signature(path, seal, key)
        whole = hashlib.sha256(block)
        age_sha = hashlib.sha256()
        plain_sha = hashlib.sha256()
        dec = Decryptor(identities, what=f"{name}, encrypted segment")
        plain = 0

        def emit(parts: List[bytes]) -> None:
            nonlocal out_fd, plain
            for part in parts:
                plain += len(part)
                if plain > seal.plain_size:
                    raise SegmentCorrupt(path, f"decrypts to more than the {seal.plain_size} bytes its seal states")
                plain_sha.update(part)
                try:  # the staging dir failing (disk full) is not the segment's fault: never a chain stop
                    if out_fd < 0:  # the header opened: only now is there anything to write
                        out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                                         0o600)
                    view = memoryview(part)
                    while view:
                        view = view[os.write(out_fd, view):]
                except OSError as exc:
                    raise StagingFailed(f"cannot write the decrypted copy of {name} to {staging_dir}: "
                                        f"{exc.strerror or exc}") from None

        for chunk in _age_bytes(path, fd, size):
            whole.update(chunk)
            age_sha.update(chunk)
            emit(dec.update(chunk))
        emit([dec.finish()])
        if out_fd < 0:
            raise SegmentCorrupt(path, "decrypts to nothing")
        os.close(out_fd)
        out_fd = -1
        if age_sha.hexdigest() != seal.age_sha256:
            raise SegmentCorrupt(path, "its age file's sha256 is not the one its seal states: damaged or replaced")
        if (plain, plain_sha.hexdigest()) != (seal.plain_size, seal.plain_sha256):
            raise SegmentCorrupt(path, f"decrypts to {plain} bytes that are not the plaintext its seal states "
                                       f"({seal.plain_size} bytes, sha256 {seal.plain_sha256[:12]})")
        inner = verify_segment(out_path)
        if inner.header != seal.header or inner.footer != seal.footer:
            raise SegmentCorrupt(path, "the segment inside does not have the header and footer its seal states "
                                       "(the seal was changed, or belongs to another segment)")
        ok = True
    except CiphertextCorrupt as exc:
        raise SegmentCorrupt(path, exc.message) from None
    except SegmentCorrupt as exc:
        if exc.path == out_path:  # the plaintext failed a check: say which file it came from
            raise SegmentCorrupt(path, f"decrypted, {exc.problem}") from None
        raise
    except OSError as exc:
        raise SegmentCorrupt(path, f"cannot read or stage it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
        if out_fd >= 0:
            os.close(out_fd)
        if not ok:
            try:
                os.unlink(out_path)
            except FileNotFoundError:
                pass
    return SegmentInfo(out_path, size, whole.hexdigest(), inner.header, inner.footer, inner.lease_records,
                       _facts(seal, path, sig, True))
