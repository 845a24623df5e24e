"""etcd_agent.age against the age format's own conformance suite: every vector of the C2SP CCTV
age testkit (tests/data/age-testkit, upstream commit in its README).

Two groups, counted apart:

- X25519 vectors (binary files, X25519 identities only): the outcome must be the one the kit
  expects. ``success``: the whole payload, its sha256 the kit's. ``no match``: a refusal
  (IdentityRefused) and nothing decrypted. ``HMAC failure`` / ``header failure``: CiphertextCorrupt
  before any plaintext. ``payload failure``: CiphertextCorrupt after the header authenticated,
  and the plaintext released before it exactly the kit's prefix. Each is fed whole and in
  pieces that do not line up with the 64 KiB chunks, since the agent decrypts as it streams.
- Vectors of features the agent deliberately does not support: ASCII armor (backups are binary),
  scrypt passphrases (backups are encrypted to X25519 recipients; a passphrase would have to be
  typed or stored on the masters) and post-quantum ML-KEM-768 + X25519 identities (not in the
  agent's key format; AGE-SECRET-KEY-PQ-1...). Whatever the kit expects of a full
  implementation, here each must be refused with one of the agent's errors and nothing
  decrypted, and where the kit expects success (the file is sound) the error must name the
  feature, so an operator knows it is not a damaged backup.
"""
from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from etcd_agent import age as A
from etcd_agent.errors import AgentError, CiphertextCorrupt, IdentityRefused

KIT = Path(__file__).resolve().parent.parent / "data" / "age-testkit"
NOT_VECTORS = {"README.md", "LICENSE"}
KNOWN_KEYS = {"expect", "payload", "identity", "passphrase", "armored", "compressed", "file key", "comment"}
MAX_VECTOR = 64 << 20  # the largest decompresses to a few MB; a bound all the same
PIECE = 7_001  # not a divisor of the 64 KiB + 16 chunk: chunks complete mid-piece

# The kit at the vendored commit. An update that changes these is a change to read, not to wave by.
TOTAL, X25519_VECTORS, UNSUPPORTED_VECTORS = 143, 67, 76


@dataclass(frozen=True)
class Vector:
    name: str
    expect: str
    payload: Optional[str]  # sha256 hex of the plaintext released, whether or not it then fails
    identities: Tuple[str, ...]
    passphrase: bool
    armored: bool
    compressed: bool
    body: bytes  # the age file, still compressed when ``compressed``

    @property
    def pq(self) -> bool:
        return any(i.startswith("AGE-SECRET-KEY-PQ-") for i in self.identities)

    @property
    def supported(self) -> bool:
        return not (self.armored or self.passphrase or self.pq)

    def age_file(self) -> bytes:
        if not self.compressed:
            return self.body
        z = zlib.decompressobj()
        out = z.decompress(self.body, MAX_VECTOR)
        assert z.eof and not z.unconsumed_tail, f"{self.name}: does not decompress within {MAX_VECTOR} bytes"
        return out


def load(name: str) -> Vector:
    raw = (KIT / name).read_bytes()
    head, sep, body = raw.partition(b"\n\n")
    assert sep, f"{name}: no blank line after the vector's header"
    fields: Dict[str, List[str]] = {}
    for line in head.decode("utf-8").split("\n"):
        key, _, value = line.partition(": ")
        fields.setdefault(key, []).append(value)
    unknown = set(fields) - KNOWN_KEYS
    assert not unknown, f"{name}: header keys {sorted(unknown)} the kit's README did not define when vendored"
    return Vector(name, fields["expect"][0], fields.get("payload", [None])[0], tuple(fields.get("identity", ())),
                  "passphrase" in fields, fields.get("armored") == ["yes"], fields.get("compressed") == ["zlib"],
                  body)


VECTORS = [load(n) for n in sorted(os.listdir(KIT)) if n not in NOT_VECTORS]
SUPPORTED = [v for v in VECTORS if v.supported]
UNSUPPORTED = [v for v in VECTORS if not v.supported]


def identity_file(tmp_path: Path, keys: Tuple[str, ...]) -> str:
    path = tmp_path / "identity.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("".join(k + "\n" for k in keys))
    return str(path)


@dataclass
class Outcome:
    released: bytes  # every plaintext byte the Decryptor handed out
    error: Optional[AgentError]
    header_open: bool  # the header authenticated (Decryptor.header is set only then)


def run(keyfile: str, data: bytes, piece: int) -> Outcome:
    dec = A.Decryptor(A.load_identities(keyfile))
    released: List[bytes] = []
    try:
        for i in range(0, max(len(data), 1), piece):
            released += dec.update(data[i : i + piece])
        released.append(dec.finish())
    except (CiphertextCorrupt, IdentityRefused) as exc:
        return Outcome(b"".join(released), exc, dec.header is not None)
    return Outcome(b"".join(released), None, True)


def test_the_kit_is_all_there() -> None:
    assert (KIT / "LICENSE").is_file() and "1e3d2860d46e94e777e1b17c7a6f2436387e3ecc" in (KIT / "README.md").read_text()
    assert (len(VECTORS), len(SUPPORTED), len(UNSUPPORTED)) == (TOTAL, X25519_VECTORS, UNSUPPORTED_VECTORS)
    assert {v.expect for v in VECTORS} == {"success", "no match", "HMAC failure", "header failure",
                                          "payload failure", "armor failure"}
    assert not any(v.expect == "armor failure" for v in SUPPORTED)


@pytest.mark.parametrize("piece", [1 << 30, PIECE], ids=["whole", "pieces"])
@pytest.mark.parametrize("v", SUPPORTED, ids=lambda v: v.name)
def test_x25519_vector(v: Vector, piece: int, tmp_path: Path) -> None:
    data = v.age_file()
    got = run(identity_file(tmp_path, v.identities or (A.generate_identity()[0],)), data, piece)  # "empty": none
    digest = hashlib.sha256(got.released).hexdigest()
    if v.expect == "success":
        assert got.error is None, f"{v.name}: {got.error}"
        assert digest == v.payload
        # the keyless check (backup verify without --identity) agrees on every sound file
        facts = A.check_structure(lambda off, n: data[off : off + n], len(data))
        assert facts.plaintext_size == len(got.released)
        return
    assert got.error is not None, f"{v.name}: expected {v.expect}, decrypted {len(got.released)} bytes"
    msg = got.error.message
    if v.expect == "payload failure":
        assert isinstance(got.error, CiphertextCorrupt) and got.header_open, msg
        assert digest == v.payload, f"{v.name}: released {len(got.released)} bytes, not the kit's prefix"
        return
    assert got.released == b"", f"{v.name}: plaintext released before a {v.expect}"
    if v.expect == "no match":
        assert isinstance(got.error, IdentityRefused) and "nothing was decrypted" in msg, msg
    elif v.expect == "HMAC failure":
        assert isinstance(got.error, CiphertextCorrupt) and "MAC does not match" in msg, msg
    else:
        assert v.expect == "header failure"
        assert isinstance(got.error, CiphertextCorrupt), msg
        # the kit counts the payload nonce as the end of the header; the Decryptor authenticates
        # the header (and sets it) before it reads the nonce
        assert not got.header_open or "payload nonce" in msg, msg


def refusals(v: Vector, tmp_path: Path) -> List[str]:
    """The agent's refusals of an unsupported vector, as messages: a post-quantum identity is
    refused already when its file is loaded; decrypting with the vector's X25519 identities (or a
    stranger's, when it names none) must fail too, without releasing a byte."""
    messages = []
    if v.pq:
        (tmp_path / "pq").mkdir()
        with pytest.raises(IdentityRefused, match="post-quantum") as refused:
            A.load_identities(identity_file(tmp_path / "pq", v.identities))
        assert "AGE-SECRET-KEY-PQ" not in refused.value.message.upper()  # a secret is never echoed
        messages.append(refused.value.message)
    x25519 = tuple(i for i in v.identities if i.startswith("AGE-SECRET-KEY-1"))
    got = run(identity_file(tmp_path, x25519 or (A.generate_identity()[0],)), v.age_file(), 1 << 30)
    assert got.error is not None, f"{v.name}: an unsupported feature was accepted"
    assert got.released == b"" and not got.header_open
    return messages + [got.error.message]


@pytest.mark.parametrize("v", UNSUPPORTED, ids=lambda v: v.name)
def test_unsupported_vector_is_refused(v: Vector, tmp_path: Path) -> None:
    messages = refusals(v, tmp_path)
    if v.expect == "success":  # a sound file: a refusal must say which feature, not "corrupt"
        feature = "armor" if v.armored else "post-quantum" if v.pq else "passphrase"
        assert any(feature in m.lower() for m in messages), messages
