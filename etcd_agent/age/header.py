"""The age v1 header and the sizes of the STREAM payload: what can be known of an age file without
its key.

Header (age-encryption.org/v1): the version line, one stanza per recipient (``-> TYPE ARGS...``
then its body in base64 lines of 64 columns, the last one shorter, possibly empty), then the MAC
line ``--- `` + base64 HMAC-SHA-256 of everything before the space. Base64 is the standard
alphabet without padding, canonical encodings only.

Payload: a 16-byte nonce, then the plaintext in 64 KiB chunks, each sealed with a 16-byte tag;
only the final chunk may be short, and it is empty only when the whole plaintext is. So the
ciphertext size fixes the plaintext size exactly.

Every read is bounded: ``MAX_HEADER`` bytes, ``MAX_STANZAS`` stanzas, ``MAX_LINE`` per line.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from etcd_agent.errors import CiphertextCorrupt

VERSION_LINE = b"age-encryption.org/v1"
VERSION_PREFIX = b"age-encryption.org/"
ARMOR_BEGIN = b"-----BEGIN AGE ENCRYPTED FILE-----"
CHUNK = 64 * 1024  # plaintext bytes per STREAM chunk
TAG = 16
ENC_CHUNK = CHUNK + TAG
NONCE_SIZE = 16
FILE_KEY_SIZE = 16
MAC_SIZE = 32
BODY_COLUMNS = 64
# Writer cap: age releases before 1.1 refused headers of more than 20 stanzas, and 20 backup
# recipients is plenty. The reader allows more (other tools add "grease" stanzas).
MAX_RECIPIENTS = 20
MAX_STANZAS = 64
MAX_LINE = 4096  # the longest native stanza argument (a post-quantum share) is ~1.5 KiB of base64
MAX_HEADER = 64 * 1024
X25519_STANZA_SIZE = len(b"-> X25519 ") + 43 + 1 + 43 + 1  # share line + one short body line
HEADER_FIXED_SIZE = len(VERSION_LINE) + 1 + len(b"--- ") + 43 + 1

Buffer = Union[bytes, bytearray, memoryview]


def b64encode(data: bytes) -> bytes:
    return base64.b64encode(data).rstrip(b"=")


def b64decode(text: bytes) -> bytes:
    """Strict unpadded base64: canonical encodings only (ValueError otherwise)."""
    if b"=" in text:
        raise ValueError("padding is not allowed")
    try:
        data = base64.b64decode(text + b"=" * (-len(text) % 4), validate=True)
    except binascii.Error:
        raise ValueError("not valid base64") from None
    if b64encode(data) != text:
        raise ValueError("non-canonical base64")
    return data


def hkdf(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(ikm)


def header_mac(file_key: bytes, mac_input: bytes) -> bytes:
    return hmac.new(hkdf(file_key, b"", b"header"), mac_input, hashlib.sha256).digest()


@dataclass(frozen=True)
class Stanza:
    type: str
    args: Tuple[str, ...]
    body: bytes


@dataclass(frozen=True)
class Header:
    stanzas: Tuple[Stanza, ...]
    mac: bytes
    mac_input: bytes  # the header bytes up to and including "---"
    size: int  # header bytes, final LF included; the payload nonce follows

    def mac_ok(self, file_key: bytes) -> bool:
        return hmac.compare_digest(header_mac(file_key, self.mac_input), self.mac)

    @property
    def types(self) -> Tuple[str, ...]:
        return tuple(s.type for s in self.stanzas)


def stanza_bytes(args: Sequence[str], body: bytes) -> bytes:
    text = b64encode(body)
    lines = [text[i : i + BODY_COLUMNS] for i in range(0, len(text), BODY_COLUMNS)]
    if not lines or len(lines[-1]) == BODY_COLUMNS:
        lines.append(b"")  # a body always ends with a short (possibly empty) line
    return b"-> " + " ".join(args).encode("ascii") + b"\n" + b"".join(line + b"\n" for line in lines)


def header_end(buf: Buffer) -> int:
    """The header's length at the start of ``buf`` (through the MAC line's LF), or -1 when it is
    not all there yet. Only finds the end (the first line starting "---"); ``parse_header`` checks."""
    data = bytes(buf[:MAX_HEADER])
    pos = 0
    while True:
        nl = data.find(b"\n", pos)
        if nl < 0:
            return -1
        if data.startswith(b"---", pos):
            return nl + 1
        pos = nl + 1


def could_be_age(buf: Buffer) -> bool:
    """False as soon as the first bytes cannot start an age v1 file."""
    head = bytes(buf[: len(VERSION_PREFIX)])
    return VERSION_PREFIX.startswith(head) if len(head) < len(VERSION_PREFIX) else head == VERSION_PREFIX


def parse_header(data: bytes) -> Header:
    """The age v1 header at the start of ``data``, bounds-checked; CiphertextCorrupt if malformed."""
    hdr, lines = _header_lines(data)
    stanzas: List[Stanza] = []
    i = 1
    while not lines[i].startswith(b"---"):  # header_end stops at the first such line: it is the last
        if len(stanzas) == MAX_STANZAS:
            raise CiphertextCorrupt(f"the age header has more than {MAX_STANZAS} recipient stanzas")
        stanza, i = _stanza(lines, i)
        stanzas.append(stanza)
    line = lines[i]
    mac = _mac(line)
    if not stanzas:
        raise CiphertextCorrupt("the age header has no recipient stanza")
    header = Header(tuple(stanzas), mac, hdr[: len(hdr) - len(line) - 1 + 3], len(hdr))
    _check_stanza_mix(header)
    return header


def _header_lines(data: bytes) -> Tuple[bytes, List[bytes]]:
    """The header's bytes and its lines (without the LFs), the version line checked."""
    bad = CiphertextCorrupt
    if data[:MAX_LINE].lstrip(b" \t\r\n").startswith(ARMOR_BEGIN):  # age -d allows whitespace around armor
        raise bad("an ASCII-armored age file; the agent reads binary age files only (age -d reads both)")
    end = header_end(data)
    if end < 0:
        if len(data) >= MAX_HEADER:
            raise bad(f"no end of the age header in its first {MAX_HEADER} bytes")
        if not data or not could_be_age(data):
            raise bad("not an age file (it does not start with age-encryption.org/v1)")
        raise bad("the age header is truncated")
    hdr = data[:end]
    lines = hdr.split(b"\n")[:-1]
    for i, line in enumerate(lines):
        if len(line) > MAX_LINE:
            raise bad(f"age header line {i + 1} is {len(line)} bytes long (limit {MAX_LINE})")
    if lines[0] != VERSION_LINE:
        if lines[0].startswith(VERSION_PREFIX):
            raise bad(f"unsupported age format version {lines[0][len(VERSION_PREFIX):][:32]!r} (only v1)")
        raise bad("not an age file (it does not start with age-encryption.org/v1)")
    return hdr, lines


def _mac(line: bytes) -> bytes:
    if not line.startswith(b"--- "):
        raise CiphertextCorrupt("malformed age header MAC line")
    try:
        mac = b64decode(line[4:])
    except ValueError as exc:
        raise CiphertextCorrupt(f"malformed age header MAC ({exc})") from None
    if len(mac) != MAC_SIZE:
        raise CiphertextCorrupt(f"the age header MAC is {len(mac)} bytes, not {MAC_SIZE}")
    return mac


def _stanza(lines: List[bytes], i: int) -> Tuple[Stanza, int]:
    """The recipient stanza starting at ``lines[i]``, and the index of the line after it."""
    line = lines[i]
    if not line.startswith(b"->"):
        raise CiphertextCorrupt(f"unexpected line {i + 1} in the age header")
    parts = line.split(b" ")
    if parts[0] != b"->" or len(parts) < 2 or any(not p or any(c < 33 or c > 126 for c in p) for p in parts[1:]):
        raise CiphertextCorrupt(f"malformed recipient stanza on age header line {i + 1}")
    args = tuple(p.decode("ascii") for p in parts[1:])
    body = bytearray()
    while True:
        # the MAC line never decodes as base64 ("-" and " " are not in the alphabet), so the
        # body loop always stops before running off the end of ``lines``
        i += 1
        line = lines[i]
        if len(line) > BODY_COLUMNS:
            raise CiphertextCorrupt(f"age header line {i + 1}: stanza body line longer than {BODY_COLUMNS} columns")
        try:
            body += b64decode(line)
        except ValueError as exc:
            if line.startswith((b"->", b"---")):
                raise CiphertextCorrupt(f"age header line {i}: stanza body does not end with a short line") from None
            raise CiphertextCorrupt(f"age header line {i + 1}: malformed stanza body ({exc})") from None
        if len(line) < BODY_COLUMNS:
            return Stanza(args[0], args[1:], bytes(body)), i + 1


def x25519_share(stanza: Stanza) -> bytes:
    """The ephemeral share of an X25519 stanza, its shape checked (CiphertextCorrupt)."""
    if len(stanza.args) != 1:
        raise CiphertextCorrupt(f"an X25519 stanza has {len(stanza.args)} arguments after its type, not 1")
    try:
        share = b64decode(stanza.args[0].encode("ascii"))
    except ValueError as exc:
        raise CiphertextCorrupt(f"an X25519 stanza's share is malformed ({exc})") from None
    if len(share) != 32:
        raise CiphertextCorrupt(f"an X25519 stanza's share is {len(share)} bytes, not 32")
    if len(stanza.body) != 32:
        raise CiphertextCorrupt(f"an X25519 stanza's body is {len(stanza.body)} bytes, not 32")
    return share


def _check_stanza_mix(header: Header) -> None:
    types = header.types
    if "scrypt" in types and len(types) > 1:
        raise CiphertextCorrupt("an scrypt (passphrase) stanza must be the only one in the age header")
    for s in header.stanzas:
        if s.type == "X25519":
            x25519_share(s)


# ---------------------------------------------------------------- sizes


def chunks_for(plain: int) -> int:
    return max(1, -(-plain // CHUNK))


def encrypted_size(plain: int, recipients: int = 1) -> int:
    """Exact size of what ``Encryptor`` writes for ``plain`` bytes and ``recipients`` X25519 recipients."""
    return HEADER_FIXED_SIZE + X25519_STANZA_SIZE * recipients + NONCE_SIZE + plain + TAG * chunks_for(plain)


def plaintext_size(payload: int) -> Tuple[int, int]:
    """(plaintext bytes, chunks) of a payload of ``payload`` bytes after the nonce; CiphertextCorrupt
    when no plaintext length gives that size (cut inside a tag, an empty final chunk after others)."""
    if payload < TAG:
        raise CiphertextCorrupt(f"the age payload is {payload} bytes, shorter than one chunk tag ({TAG})")
    chunks = -(-payload // ENC_CHUNK)
    last = payload - (chunks - 1) * ENC_CHUNK
    if last < TAG or (last == TAG and chunks > 1):
        raise CiphertextCorrupt(
            f"the age payload of {payload} bytes does not fit the 64 KiB chunking "
            f"(a final chunk of {last} bytes): truncated or padded"
        )
    return payload - TAG * chunks, chunks


def chunk_nonce(counter: int, last: bool) -> bytes:
    return counter.to_bytes(11, "big") + (b"\x01" if last else b"\x00")
