"""Streaming age encryption and decryption (push style), and the keyless check of a ciphertext.

- ``Encryptor``: ``out.write(enc.update(chunk))`` in the loop, ``out.write(enc.finish())``; memory
  is one 64 KiB chunk whatever the stream's length (the final chunk must be marked as such, so a
  full chunk is sealed only once more data follows).
- ``Decryptor``: ``update(ciphertext)`` returns the plaintext of every chunk completed, each one
  authenticated; ``finish()`` authenticates the final chunk. As with any streaming AEAD, output
  before ``finish()`` is not yet known to be all of it (a cut at a chunk boundary shows only at the
  end): write it under a temporary name and keep it only once ``finish()`` returned.
- ``StructureCheck``: what the bytes show without the key: a well-formed header, its stanzas, and
  a size the chunking can produce, which gives the exact plaintext size; and their sha256.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, cast

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from etcd_agent.age.header import (
    CHUNK,
    ENC_CHUNK,
    FILE_KEY_SIZE,
    MAX_HEADER,
    MAX_RECIPIENTS,
    NONCE_SIZE,
    TAG,
    VERSION_LINE,
    Buffer,
    Header,
    b64encode,
    chunk_nonce,
    chunks_for,
    could_be_age,
    header_end,
    header_mac,
    hkdf,
    parse_header,
    plaintext_size,
)
from etcd_agent.age.keys import Identities, X25519Recipient
from etcd_agent.errors import AgentError, CiphertextCorrupt, IdentityRefused

ReadAt = Callable[[int, int], bytes]


def _buf(data: Buffer) -> bytes:
    """ChaCha20Poly1305 takes any buffer without a copy; cryptography < 44 annotates bytes only."""
    return cast(bytes, data)


# ---------------------------------------------------------------- encryption


class Encryptor:
    """Push-style age encryptor to X25519 recipients; the first output starts with the header."""

    def __init__(self, recipients: Sequence[X25519Recipient]) -> None:
        unique = tuple(dict.fromkeys(recipients))
        if not unique:
            raise ValueError("no recipients to encrypt to")
        if len(unique) > MAX_RECIPIENTS:
            raise ValueError(f"{len(unique)} recipients; at most {MAX_RECIPIENTS} are supported")
        self.recipients = unique
        file_key = os.urandom(FILE_KEY_SIZE)
        head = VERSION_LINE + b"\n" + b"".join(r.wrap(file_key) for r in unique) + b"---"
        header = head + b" " + b64encode(header_mac(file_key, head)) + b"\n"
        nonce = os.urandom(NONCE_SIZE)
        self.header_size = len(header)
        self._aead = ChaCha20Poly1305(hkdf(file_key, nonce, b"payload"))
        self._prefix: Optional[bytes] = header + nonce
        self._pending = bytearray()
        self._counter = 0
        self._finished = False
        self.plaintext_size = 0
        self.ciphertext_size = 0

    def _seal(self, data: Buffer, last: bool) -> bytes:
        sealed = self._aead.encrypt(chunk_nonce(self._counter, last), _buf(data), None)
        self._counter += 1
        return sealed

    def update(self, data: Buffer) -> bytes:
        """The ciphertext of every chunk that ``data`` completes (and more data follows)."""
        if self._finished:
            raise ValueError("Encryptor.update() after finish()")
        out: List[bytes] = []
        if self._prefix is not None:
            out.append(self._prefix)
            self._prefix = None
        with memoryview(data) as mv:
            n = mv.nbytes
            self.plaintext_size += n
            pos = 0
            pending = self._pending
            if pending:
                pos = min(CHUNK - len(pending), n)
                pending += mv[:pos]
                if len(pending) == CHUNK and pos < n:
                    out.append(self._seal(pending, False))
                    pending.clear()
            # a chunk is sealed straight from the caller's buffer only when more data follows it
            while n - pos > CHUNK:
                out.append(self._seal(mv[pos : pos + CHUNK], False))
                pos += CHUNK
            if pos < n:
                pending += mv[pos:]
        result = b"".join(out)
        self.ciphertext_size += len(result)
        return result

    def finish(self) -> bytes:
        """The rest: (the header, if nothing was written yet, and) the final chunk."""
        if self._finished:
            raise ValueError("Encryptor.finish() called twice")
        self._finished = True
        result = (self._prefix or b"") + self._seal(self._pending, True)
        self._prefix = None
        self._pending = bytearray()
        self.ciphertext_size += len(result)
        return result

    def plaintext_reader(self, read_ciphertext_at: ReadAt) -> ReadAt:
        """Random access to the plaintext just written (after ``finish()``), decrypting only the
        chunks a read touches: for the few bbolt pages the writer reads back. ``read_ciphertext_at``
        reads the age file (offset 0 = its first header byte); it is never asked for bytes past
        the file's end, so it may read from inside a larger container such as a tar."""
        if not self._finished:
            raise ValueError("plaintext_reader() needs finish() first")
        return _chunk_reader(self._aead, read_ciphertext_at, self.header_size + NONCE_SIZE, self.plaintext_size)


def _chunk_reader(aead: ChaCha20Poly1305, read_ct: ReadAt, payload_at: int, plain_total: int) -> ReadAt:
    chunks = chunks_for(plain_total)
    cache: List[Tuple[int, bytes]] = []

    def chunk(index: int) -> bytes:
        if cache and cache[0][0] == index:
            return cache[0][1]
        last = index == chunks - 1
        size = (plain_total - index * CHUNK if last else CHUNK) + TAG
        ct = read_ct(payload_at + index * ENC_CHUNK, size)
        try:
            plain = aead.decrypt(chunk_nonce(index, last), ct, None)
        except InvalidTag:
            raise CiphertextCorrupt(f"chunk {index} of the age file just written fails authentication "
                                    "(changed on disk while it was written?)") from None
        cache[:] = [(index, plain)]
        return plain

    def read_at(offset: int, n: int) -> bytes:
        if offset < 0 or n < 0:
            raise ValueError("negative offset or length")
        end = min(offset + n, plain_total)
        parts: List[bytes] = []
        while offset < end:
            index, within = divmod(offset, CHUNK)
            piece = chunk(index)[within : within + end - offset]
            parts.append(piece)
            offset += len(piece)
        return b"".join(parts)

    return read_at


# ---------------------------------------------------------------- decryption

# Stanza types of other age recipients, named when a file holds nothing else: a refusal that says
# why beats "the wrong key?" (backups are only ever written to X25519 recipients).
_OTHER_RECIPIENTS = {
    "scrypt": "a passphrase (scrypt)",
    "mlkem768x25519": "post-quantum (ML-KEM-768 + X25519) recipients",
    "ssh-ed25519": "SSH keys",
    "ssh-rsa": "SSH keys",
}


def _unsupported_only(types: Sequence[str]) -> str:
    """What the file is encrypted to, when no stanza is X25519 and one is of a known other kind."""
    if "X25519" in types:
        return ""
    named = sorted({_OTHER_RECIPIENTS[t] for t in types if t in _OTHER_RECIPIENTS})
    return " and ".join(named)


@dataclass(frozen=True)
class DecryptFacts:
    plaintext_size: int
    ciphertext_size: int
    chunks: int
    stanza_types: Tuple[str, ...]


class Decryptor:
    """Push-style age decryptor with the keys of one identity file (see the module doc).

    IdentityRefused when no key opens the header (a wrong key: nothing was decrypted);
    CiphertextCorrupt for a malformed, truncated or tampered file."""

    def __init__(self, identities: Identities, what: str = "the age file") -> None:
        if not identities.keys:
            raise ValueError("no identity to decrypt with")
        self._ids = identities
        self._what = what
        self._buf = bytearray()
        self.header: Optional[Header] = None
        self._file_key: Optional[bytes] = None
        self._aead: Optional[ChaCha20Poly1305] = None
        self._counter = 0
        self._done = False
        self._failure: Optional[AgentError] = None  # raised again by every later call (see update)
        self._facts: Optional[DecryptFacts] = None
        self._plain = 0
        self._cipher = 0

    def _open_header(self) -> bool:
        end = header_end(self._buf)
        if end < 0:
            if len(self._buf) >= MAX_HEADER or not could_be_age(self._buf):
                parse_header(bytes(self._buf))  # raises the precise CiphertextCorrupt
            return False
        header = parse_header(bytes(self._buf[:end]))
        file_key: Optional[bytes] = None
        for stanza in header.stanzas:
            for identity in self._ids.keys:
                file_key = identity.unwrap(stanza)
                if file_key is not None:
                    break
            if file_key is not None:
                break
        if file_key is None:
            unsupported = _unsupported_only(header.types)
            if unsupported:
                raise IdentityRefused(f"{self._what}: it is encrypted to {unsupported} only, which the agent does not "
                                      "decrypt (it takes X25519 identities, AGE-SECRET-KEY-1...): nothing was decrypted")
            n = len(self._ids.keys)
            raise IdentityRefused(
                f"{self._what}: none of the {n} key{'' if n == 1 else 's'} in identity file {self._ids.path} "
                f"opens it ({len(header.stanzas)} recipient stanza(s): {', '.join(sorted(set(header.types)))}): "
                "the wrong key? nothing was decrypted"
            )
        if len(file_key) != FILE_KEY_SIZE or not header.mac_ok(file_key):
            raise CiphertextCorrupt(f"{self._what}: the age header MAC does not match: the header was changed "
                                    "after it was written")
        self.header = header
        self._file_key = file_key
        del self._buf[:end]
        self._cipher += end
        return True

    def update(self, data: Buffer) -> List[bytes]:
        """The plaintext of every chunk ``data`` completes (each authenticated), one bytes per chunk.

        A chunk that authenticated is released even when the bytes after it in the same ``data``
        are bad: the error is then raised by the next call (``update`` or ``finish``). What a
        caller saw is exactly what authenticated, however the stream was sliced (the age testkit
        checks that prefix). Once an error is raised, every later call raises it again."""
        if self._facts is not None:
            raise ValueError("Decryptor.update() after finish()")
        self._raise_failure()
        out: List[bytes] = []
        try:
            self._update(data, out)
        except (CiphertextCorrupt, IdentityRefused) as exc:
            self._failure = exc
            if not out:
                raise
        self._plain += sum(len(p) for p in out)
        return out

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _update(self, data: Buffer, out: List[bytes]) -> None:
        if self._aead is None:
            self._buf += data
            if self.header is None and not self._open_header():
                return
            if len(self._buf) < NONCE_SIZE:
                return
            assert self._file_key is not None
            self._aead = ChaCha20Poly1305(hkdf(self._file_key, bytes(self._buf[:NONCE_SIZE]), b"payload"))
            self._file_key = None
            self._cipher += NONCE_SIZE
            data = bytes(self._buf[NONCE_SIZE:])
            self._buf = bytearray()
        with memoryview(data) as mv:
            n = mv.nbytes
            pos = 0
            if self._buf:  # top the buffered partial chunk up to a whole one first
                pos = min(ENC_CHUNK - len(self._buf), n)
                self._buf += mv[:pos]
                if len(self._buf) == ENC_CHUNK:
                    out.append(self._open(self._buf))
                    self._buf.clear()
            while n - pos >= ENC_CHUNK:  # then whole chunks straight from the caller's buffer
                out.append(self._open(mv[pos : pos + ENC_CHUNK]))
                pos += ENC_CHUNK
            if pos < n:
                if self._done:
                    raise CiphertextCorrupt(f"{self._what}: data follows the final chunk (bytes appended?)")
                self._buf += mv[pos:]

    def _open(self, chunk: Buffer, tail: bool = False) -> bytes:
        """One chunk: a whole one is tried as non-final, then as final (a final chunk may be full);
        the short ``tail`` at the end only as final."""
        if self._done:
            raise CiphertextCorrupt(f"{self._what}: data follows the final chunk (bytes appended?)")
        assert self._aead is not None
        self._cipher += memoryview(chunk).nbytes
        try:
            if tail:
                raise InvalidTag
            plain = self._aead.decrypt(chunk_nonce(self._counter, False), _buf(chunk), None)
        except InvalidTag:
            try:
                plain = self._aead.decrypt(chunk_nonce(self._counter, True), _buf(chunk), None)
            except InvalidTag:
                raise CiphertextCorrupt(
                    f"{self._what}: {'final ' if tail else ''}chunk {self._counter} (payload byte "
                    f"{self._counter * ENC_CHUNK}) fails authentication: corrupt, truncated or tampered with"
                ) from None
            if not plain and self._counter > 0:
                raise CiphertextCorrupt(f"{self._what}: ends with an empty final chunk (not a valid age file)") from None
            self._done = True
        self._counter += 1
        return plain

    def finish(self) -> bytes:
        """The final chunk's plaintext, once it authenticates; CiphertextCorrupt if cut short."""
        if self._facts is not None:
            raise ValueError("Decryptor.finish() called twice")
        self._raise_failure()
        what = self._what
        if self.header is None:
            if not self._buf:
                raise CiphertextCorrupt(f"{what}: empty, not an age file")
            parse_header(bytes(self._buf))  # raises: incomplete or malformed
        if self._aead is None:
            raise CiphertextCorrupt(f"{what}: truncated: it ends before its payload nonce")
        tail = b""
        if not self._done:
            if not self._buf:
                raise CiphertextCorrupt(f"{what}: truncated: it ends without a final chunk")
            if len(self._buf) < TAG:
                raise CiphertextCorrupt(f"{what}: truncated inside its last chunk")
            tail = self._open(self._buf, tail=True)
            self._buf.clear()
        self._plain += len(tail)
        assert self.header is not None
        self._facts = DecryptFacts(self._plain, self._cipher, self._counter, self.header.types)
        return tail

    @property
    def facts(self) -> DecryptFacts:
        if self._facts is None:
            raise ValueError("Decryptor.facts before finish()")
        return self._facts


# ---------------------------------------------------------------- keyless checks


@dataclass(frozen=True)
class StructureFacts:
    """What an age file shows without its key."""

    size: int  # ciphertext bytes
    header_size: int
    stanza_types: Tuple[str, ...]  # one per stanza, in order (X25519 stanzas name no recipient)
    chunks: int
    plaintext_size: int  # exact: the chunking fixes it
    sha256: Optional[str]  # of the whole ciphertext, when hashed

    @property
    def x25519_stanzas(self) -> int:
        return self.stanza_types.count("X25519")


class StructureCheck:
    """Feed it an age file's bytes in order; ``finish()`` checks the header (bounded), the stanza
    shapes and that the total fits the STREAM chunking. Chunk tags and the header MAC need the key
    (``Decryptor``). ``sha256``: hash every byte too."""

    def __init__(self, *, sha256: bool = True, what: str = "the age file") -> None:
        self._digest = hashlib.sha256() if sha256 else None
        self._head = bytearray()
        self.header: Optional[Header] = None
        self.size = 0
        self._what = what

    def update(self, data: Buffer) -> None:
        n = memoryview(data).nbytes
        if not n:
            return
        self.size += n
        if self._digest is not None:
            self._digest.update(data)
        if self.header is None:
            self._head += bytes(data[: MAX_HEADER - len(self._head)])
            end = header_end(self._head)
            if end >= 0:
                self.header = self._parse(bytes(self._head[:end]))
                self._head = bytearray()
            elif len(self._head) >= MAX_HEADER or not could_be_age(self._head):
                self._parse(bytes(self._head))  # raises

    def _parse(self, data: bytes) -> Header:
        try:
            return parse_header(data)
        except CiphertextCorrupt as exc:
            raise CiphertextCorrupt(f"{self._what}: {exc.message}") from None

    def finish(self) -> StructureFacts:
        if self.header is None:
            self._parse(bytes(self._head))  # raises: empty, truncated or malformed
        assert self.header is not None
        payload = self.size - self.header.size - NONCE_SIZE
        if payload < 0:
            raise CiphertextCorrupt(f"{self._what}: ends inside its payload nonce")
        try:
            plain, chunks = plaintext_size(payload)
        except CiphertextCorrupt as exc:
            raise CiphertextCorrupt(f"{self._what}: {exc.message}") from None
        return StructureFacts(self.size, self.header.size, self.header.types, chunks, plain,
                              self._digest.hexdigest() if self._digest is not None else None)


def check_structure(read_at: ReadAt, size: int, *, sha256: bool = True, what: str = "the age file") -> StructureFacts:
    """``StructureCheck`` over the ``size`` bytes ``read_at`` reads, 1 MiB at a time; without
    ``sha256`` only the header is read and ``size`` is taken as the container states it."""
    check = StructureCheck(sha256=sha256, what=what)
    if not sha256:
        check.update(read_at(0, min(size, MAX_HEADER)))
        check.size = size
        return check.finish()
    off = 0
    while off < size:
        block = read_at(off, min(16 * ENC_CHUNK, size - off))
        if not block:
            raise CiphertextCorrupt(f"{what}: ends at byte {off}, before its stated {size} bytes")
        check.update(block)
        off += len(block)
    return check.finish()
