"""age X25519 keys: recipients (``age1...``, public: in the config) and identities
(``AGE-SECRET-KEY-1...``, secret: only in an operator's 0600 file, never on the masters' disks).

Both are bech32 strings (BIP 173 without its 90-character limit). Parsing is strict (checksum,
prefix, length, a usable curve point) and every error is one sentence that never repeats a
secret key: a secret pasted into ``encrypt_to`` by mistake must not end up in a log.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from etcd_agent.age.header import MAX_RECIPIENTS, Stanza, b64encode, hkdf, stanza_bytes, x25519_share
from etcd_agent.errors import CiphertextCorrupt, IdentityRefused, RecipientInvalid

X25519_LABEL = b"age-encryption.org/v1/X25519"
MAX_IDENTITY_FILE = 64 * 1024

# ---------------------------------------------------------------- bech32

_CHARSET = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"
_VALUES = {c: i for i, c in enumerate(_CHARSET)}
_GENERATOR = (0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3)


def _polymod(values: Sequence[int]) -> int:
    chk = 1
    for v in values:
        top = chk >> 25
        chk = ((chk & 0x1FFFFFF) << 5) ^ v
        for i, g in enumerate(_GENERATOR):
            if (top >> i) & 1:
                chk ^= g
    return chk


def _hrp_expand(hrp: str) -> List[int]:
    return [ord(c) >> 5 for c in hrp] + [0] + [ord(c) & 31 for c in hrp]


def _convert_bits(data: Sequence[int], frombits: int, tobits: int, pad: bool) -> List[int]:
    acc = bits = 0
    out: List[int] = []
    maxv = (1 << tobits) - 1
    for value in data:
        acc = (acc << frombits) | value
        bits += frombits
        while bits >= tobits:
            bits -= tobits
            out.append((acc >> bits) & maxv)
    if pad:
        if bits:
            out.append((acc << (tobits - bits)) & maxv)
    elif bits >= frombits or (acc << (tobits - bits)) & maxv:
        raise ValueError("has leftover padding bits (truncated or mistyped)")
    return out


def bech32_encode(hrp: str, data: bytes) -> str:
    values = _convert_bits(data, 8, 5, True)
    polymod = _polymod(_hrp_expand(hrp) + values + [0] * 6) ^ 1
    checksum = [(polymod >> 5 * (5 - i)) & 31 for i in range(6)]
    return hrp + "1" + "".join(_CHARSET[v] for v in values + checksum)


def bech32_decode(text: str) -> Tuple[str, bytes]:
    """(lower-case prefix, data) of a bech32 string; ValueError saying what is wrong."""
    if text != text.lower() and text != text.upper():
        raise ValueError("mixes upper and lower case")
    s = text.lower()
    sep = s.rfind("1")
    if sep < 1 or len(s) - sep - 1 < 6:
        raise ValueError("is not bech32 (no separator, or too short)")
    hrp, rest = s[:sep], s[sep + 1 :]
    if any(not 33 <= ord(c) <= 126 for c in hrp):
        raise ValueError("has a non-printable character")
    bad = sorted({c for c in rest if c not in _VALUES})
    if bad:
        raise ValueError(f"has character(s) {''.join(bad)!r} that bech32 does not use (no b, i, o or 1 after the separator)")
    values = [_VALUES[c] for c in rest]
    if _polymod(_hrp_expand(hrp) + values) != 1:
        raise ValueError("has a bad checksum (mistyped, truncated or not copied whole)")
    return hrp, bytes(_convert_bits(values[:-6], 5, 8, False))


def _shown(text: str) -> str:
    """A public string shortened for a message (only ever called on non-secrets)."""
    return repr(text if len(text) <= 16 else text[:12] + "..." + text[-4:])


def _public_raw(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


# ---------------------------------------------------------------- recipients


@dataclass(frozen=True)
class X25519Recipient:
    """An X25519 public key; ``str()`` is its canonical ``age1...`` form."""

    public: bytes

    def __str__(self) -> str:
        return bech32_encode("age", self.public)

    def wrap(self, file_key: bytes) -> bytes:
        """One ``-> X25519`` stanza (98 bytes) wrapping ``file_key`` for this recipient."""
        ephemeral = X25519PrivateKey.generate()
        share = _public_raw(ephemeral)
        shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(self.public))
        wrap_key = hkdf(shared, share + self.public, X25519_LABEL)
        body = ChaCha20Poly1305(wrap_key).encrypt(bytes(12), file_key, None)
        return stanza_bytes(("X25519", b64encode(share).decode("ascii")), body)


def parse_recipient(text: str, where: str = "recipient") -> X25519Recipient:
    """An ``age1...`` X25519 recipient, or RecipientInvalid saying in one sentence what is wrong."""
    s = text.strip()
    if not s:
        raise RecipientInvalid(f"{where} is empty")
    if s.upper().startswith("AGE-SECRET-KEY-"):
        # never echoed: this is the very key that must not be on the masters
        raise RecipientInvalid(
            f"{where} is an age SECRET key, not a recipient: remove it from this file (and this host) and give "
            "its public key instead (age-keygen -y KEYFILE prints it: age1...)"
        )
    if s.startswith(("ssh-", "ecdsa-", "sk-")):
        raise RecipientInvalid(f"{where} {_shown(s)} is an SSH key; only age X25519 recipients (age1...) are supported")
    if not s.lower().startswith("age1"):
        raise RecipientInvalid(f"{where} {_shown(s)} is not an age recipient (expected age1...)")
    try:
        hrp, data = bech32_decode(s)
    except ValueError as exc:
        raise RecipientInvalid(f"{where} {_shown(s)} {exc}") from None
    if hrp == "age1pq":
        raise RecipientInvalid(f"{where} {_shown(s)} is a post-quantum recipient; only X25519 recipients (age1...) "
                               "are supported")
    if hrp != "age":
        raise RecipientInvalid(f"{where} {_shown(s)} is a plugin recipient ({hrp}1...); only X25519 recipients "
                               "(age1...) are supported")
    if len(data) != 32:
        raise RecipientInvalid(f"{where} {_shown(s)} holds {len(data)} bytes; an X25519 recipient holds 32")
    try:  # a low-order point gives an all-zero shared secret: refuse it now, not at backup time
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(data))
    except ValueError:
        raise RecipientInvalid(f"{where} {_shown(s)} is not a usable X25519 public key (low-order point)") from None
    return X25519Recipient(data)


def parse_recipients(texts: Sequence[str], where: str = "backup.encrypt_to") -> Tuple[X25519Recipient, ...]:
    """Every entry parsed, duplicates dropped, order kept; 1 to MAX_RECIPIENTS of them."""
    out: List[X25519Recipient] = []
    for i, text in enumerate(texts):
        r = parse_recipient(text, f"{where}[{i}]")
        if r not in out:
            out.append(r)
    if not out:
        raise RecipientInvalid(f"{where} lists no recipient")
    if len(out) > MAX_RECIPIENTS:
        raise RecipientInvalid(f"{where} lists {len(out)} recipients; at most {MAX_RECIPIENTS} are supported")
    return tuple(out)


# ---------------------------------------------------------------- identities


class X25519Identity:
    """An X25519 secret key. Its repr shows only the matching recipient."""

    __slots__ = ("_key", "recipient")

    def __init__(self, key: X25519PrivateKey) -> None:
        self._key = key
        self.recipient = X25519Recipient(_public_raw(key))

    def __repr__(self) -> str:
        return f"X25519Identity(recipient={str(self.recipient)!r})"

    def unwrap(self, stanza: Stanza) -> Optional[bytes]:
        """The file key if ``stanza`` is addressed to this identity, None if it is not ours."""
        if stanza.type != "X25519":
            return None
        share = x25519_share(stanza)
        try:
            shared = self._key.exchange(X25519PublicKey.from_public_bytes(share))
        except ValueError:  # an all-zero shared secret: a low-order share, never made honestly
            raise CiphertextCorrupt("an X25519 stanza carries a low-order public share (a forged file)") from None
        wrap_key = hkdf(shared, share + self.recipient.public, X25519_LABEL)
        try:
            return ChaCha20Poly1305(wrap_key).decrypt(bytes(12), stanza.body, None)
        except InvalidTag:
            return None


@dataclass(frozen=True)
class Identities:
    """The identities of one file, and the file's path (for messages)."""

    path: str
    keys: Tuple[X25519Identity, ...]

    @property
    def recipients(self) -> Tuple[str, ...]:
        return tuple(str(k.recipient) for k in self.keys)


def parse_identity(text: str, where: str = "identity") -> X25519Identity:
    """An ``AGE-SECRET-KEY-1...`` identity; IdentityRefused never containing the key material."""
    s = text.strip()
    if s.lower().startswith("age1"):
        raise IdentityRefused(f"{where} is a public key (a recipient), not a secret key (AGE-SECRET-KEY-1...)")
    if s.upper().startswith("AGE-SECRET-KEY-PQ-"):
        raise IdentityRefused(f"{where} is a post-quantum (ML-KEM-768 + X25519) identity; only X25519 identities "
                              "(AGE-SECRET-KEY-1...) are supported")
    if s.upper().startswith("AGE-PLUGIN-"):
        raise IdentityRefused(f"{where} is a plugin identity; only X25519 identities (AGE-SECRET-KEY-1...) are supported")
    if not s.upper().startswith("AGE-SECRET-KEY-1"):
        raise IdentityRefused(f"{where} is not an age identity (expected AGE-SECRET-KEY-1...)")
    try:
        hrp, data = bech32_decode(s)
    except ValueError as exc:
        why = "has characters that bech32 does not use" if "character" in str(exc) else str(exc)  # echoes none
        raise IdentityRefused(f"{where} is not a valid age identity: it {why}") from None
    if hrp != "age-secret-key-" or len(data) != 32:
        raise IdentityRefused(f"{where} is not an X25519 age identity (wrong prefix or length)")
    return X25519Identity(X25519PrivateKey.from_private_bytes(data))


def generate_identity() -> Tuple[str, str]:
    """(secret ``AGE-SECRET-KEY-1...``, recipient ``age1...``), as age-keygen prints them."""
    key = X25519PrivateKey.generate()
    return bech32_encode("age-secret-key-", key.private_bytes_raw()).upper(), str(X25519Recipient(_public_raw(key)))


def load_identities(path: str) -> Identities:
    """The identities of an age-keygen style file (one key a line; blank lines and ``#`` comments
    skipped). It must be a regular file that only its owner may read or write (0600, 0400):
    anything looser is refused with the chmod to run."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise IdentityRefused(f"identity file {path}: cannot open it ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IdentityRefused(f"identity file {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise IdentityRefused(
                f"identity file {path} has mode {mode:04o}, but it holds a secret key that only its owner may "
                f"read: run chmod 600 {path}"
            )
        if st.st_size > MAX_IDENTITY_FILE:
            raise IdentityRefused(f"identity file {path} is {st.st_size} bytes, too large for an age key file")
        raw = os.read(fd, MAX_IDENTITY_FILE + 1)
    finally:
        os.close(fd)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise IdentityRefused(f"identity file {path} is not a text file") from None
    out: List[X25519Identity] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(parse_identity(line, f"identity file {path} line {n}"))
    if not out:
        raise IdentityRefused(f"identity file {path} holds no age identity (AGE-SECRET-KEY-1...)")
    return Identities(path, tuple(out))
