"""etcd_agent.age: round trips, interop with the real ``age`` CLI both ways, tampering and
truncation, keyless checks, recipient and identity parsing (every error one sentence, no secret
ever echoed). The CLI is Debian's package ``age`` (packaging/install-deps.sh test installs it)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, List, Tuple

import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from etcd_agent import age as A
from etcd_agent.age import CHUNK, ENC_CHUNK, TAG
from etcd_agent.age.header import b64encode, chunk_nonce, header_mac, hkdf
from etcd_agent.errors import (
    EXIT_REFUSED,
    EXIT_USAGE,
    BackupCorrupt,
    CiphertextCorrupt,
    IdentityRefused,
    RecipientInvalid,
)

AGE = shutil.which("age")
AGE_KEYGEN = shutil.which("age-keygen")
needs_cli = pytest.mark.skipif(AGE is None or AGE_KEYGEN is None, reason="the age CLI is not installed (apt-get install age)")

SIZES = [0, 1, 100, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 5, 1_000_003]


def data_of(n: int) -> bytes:
    """Deterministic bytes that are not all zeros."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(counter.to_bytes(8, "big")).digest()
        counter += 1
    return bytes(out[:n])


def encrypt(recipients: List[str], data: bytes, feed: int = 32 * 1024) -> bytes:
    enc = A.Encryptor(A.parse_recipients(recipients))
    parts = [enc.update(data[i : i + feed]) for i in range(0, len(data), feed)]
    parts.append(enc.finish())
    out = b"".join(parts)
    assert enc.ciphertext_size == len(out) and enc.plaintext_size == len(data)
    return out


def decrypt(keyfile: str, ct: bytes, feed: int = 1 << 20) -> bytes:
    dec = A.Decryptor(A.load_identities(keyfile))
    parts: List[bytes] = []
    for i in range(0, len(ct), feed):
        parts += dec.update(ct[i : i + feed])
    parts.append(dec.finish())
    out = b"".join(parts)
    assert dec.facts.ciphertext_size == len(ct) and dec.facts.plaintext_size == len(out)
    return out


def structure(ct: bytes, feed: int = 50_000) -> A.StructureFacts:
    check = A.StructureCheck()
    for i in range(0, len(ct), feed):
        check.update(ct[i : i + feed])
    return check.finish()


def write_key(path: Path, secret: str, recipient: str, mode: int = 0o600) -> str:
    path.write_text(f"# created: by the tests\n# public key: {recipient}\n{secret}\n")
    os.chmod(path, mode)
    return str(path)


@pytest.fixture()
def key(tmp_path: Path) -> Tuple[str, str]:
    """(identity file, recipient) made by the agent's own code."""
    secret, recipient = A.generate_identity()
    return write_key(tmp_path / "key.txt", secret, recipient), recipient


@pytest.fixture()
def cli_key(tmp_path: Path) -> Tuple[str, str]:
    """(identity file, recipient) made by age-keygen."""
    assert AGE_KEYGEN is not None
    path = tmp_path / "cli-key.txt"
    subprocess.run([AGE_KEYGEN, "-o", str(path)], check=True, capture_output=True)
    os.chmod(path, 0o600)
    recipient = subprocess.run([AGE_KEYGEN, "-y", str(path)], check=True, capture_output=True, text=True).stdout.strip()
    return str(path), recipient


def test_the_age_cli_is_there_on_ci() -> None:
    """CI installs it (packaging/install-deps.sh test): the interop tests must never skip there."""
    if os.environ.get("CI") and (AGE is None or AGE_KEYGEN is None):
        pytest.fail("the age CLI is missing: packaging/install-deps.sh test installs Debian's package age")


def test_error_classes_carry_the_agents_exit_codes() -> None:
    assert issubclass(CiphertextCorrupt, BackupCorrupt)
    assert IdentityRefused("x").exit_code == EXIT_REFUSED and RecipientInvalid("x").exit_code == EXIT_USAGE


# ---------------------------------------------------------------- round trips and sizes


@pytest.mark.parametrize("size, feed", [(s, f) for s in SIZES for f in (1 << 20, 32 * 1024, 7777)
                                        if f != 7777 or s <= 4 * CHUNK])  # small feeds of a big input add nothing
def test_round_trip(key: Tuple[str, str], size: int, feed: int) -> None:
    keyfile, recipient = key
    data = data_of(size)
    ct = encrypt([recipient], data, feed)
    assert len(ct) == A.encrypted_size(size, 1)
    assert decrypt(keyfile, ct, feed) == data


def test_one_byte_feeds(key: Tuple[str, str]) -> None:
    keyfile, recipient = key
    data = data_of(CHUNK + 3)
    enc = A.Encryptor(A.parse_recipients([recipient]))
    ct = b"".join(enc.update(data[i : i + 1]) for i in range(len(data))) + enc.finish()
    assert decrypt(keyfile, ct, feed=1) == data


def test_memory_is_one_chunk(key: Tuple[str, str]) -> None:
    _, recipient = key
    enc = A.Encryptor(A.parse_recipients([recipient]))
    first = enc.update(data_of(10 * CHUNK + 5))
    # everything but the final (still unsealed) tail went out at once
    assert len(first) == enc.header_size + A.NONCE_SIZE + 10 * ENC_CHUNK
    assert len(enc._pending) == 5


@pytest.mark.parametrize("n", [1, 2, 5, 20])
def test_size_formula(n: int) -> None:
    recipients = [A.generate_identity()[1] for _ in range(n)]
    for size in (0, 1, CHUNK, CHUNK + 1, 5 * CHUNK - 7):
        ct = encrypt(recipients, data_of(size))
        assert len(ct) == 70 + 98 * n + 16 + size + 16 * max(1, -(-size // CHUNK)) == A.encrypted_size(size, n)


def test_every_recipient_can_decrypt(tmp_path: Path) -> None:
    keys = [A.generate_identity() for _ in range(3)]
    data = data_of(2 * CHUNK + 9)
    ct = encrypt([r for _, r in keys], data)
    for i, (secret, recipient) in enumerate(keys):
        assert decrypt(write_key(tmp_path / f"k{i}", secret, recipient), ct) == data
    assert structure(ct).stanza_types == ("X25519",) * 3


def test_plaintext_reader_reads_inside_a_container(key: Tuple[str, str], tmp_path: Path) -> None:
    """The writer reads bbolt pages back from the age member inside the tar: the reader must never
    ask for bytes past the member's end (the tar's padding and next header follow it)."""
    _, recipient = key
    data = data_of(3 * CHUNK + 100)
    enc = A.Encryptor(A.parse_recipients([recipient]))
    ct = enc.update(data) + enc.finish()
    container = b"H" * 512 + ct + b"\0" * 700
    asked: List[Tuple[int, int]] = []

    def read_ct(off: int, n: int) -> bytes:
        asked.append((off, n))
        return container[512 + off : 512 + off + n]

    read_at = enc.plaintext_reader(read_ct)
    for off, n in [(0, 10), (CHUNK - 3, 9), (2 * CHUNK, CHUNK), (3 * CHUNK + 90, 50), (len(data), 5), (0, len(data))]:
        assert read_at(off, n) == data[off : off + n]
    assert max(off + n for off, n in asked) == len(ct)


# ---------------------------------------------------------------- interop with the age CLI


# Interop with the distribution's age, both ways: empty, one byte, either side of one chunk,
# exactly one, two and three chunks (a full final chunk: the case a reader must not mistake for
# "more follows"), a short chunk after full ones, and ~1 MB.
INTEROP_SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 3, 3 * CHUNK, 1_000_003]


@needs_cli
@pytest.mark.parametrize("size", INTEROP_SIZES)
def test_age_cli_decrypts_ours(cli_key: Tuple[str, str], tmp_path: Path, size: int) -> None:
    keyfile, recipient = cli_key
    data = data_of(size)
    path = tmp_path / "ours.age"
    for feed in (1 << 20, CHUNK, 32 * 1024):  # the Encryptor holds back a full chunk until more follows
        path.write_bytes(encrypt([recipient, A.generate_identity()[1]], data, feed))
        out = subprocess.run([str(AGE), "-d", "-i", keyfile, str(path)], check=True, capture_output=True).stdout
        assert hashlib.sha256(out).digest() == hashlib.sha256(data).digest()


@needs_cli
@pytest.mark.parametrize("size", INTEROP_SIZES)
def test_we_decrypt_age_cli(cli_key: Tuple[str, str], size: int) -> None:
    keyfile, recipient = cli_key
    data = data_of(size)
    ct = subprocess.run([str(AGE), "-r", A.generate_identity()[1], "-r", recipient], input=data, check=True,
                        capture_output=True).stdout
    for feed in (1 << 20, ENC_CHUNK, 7777):  # whole, in step with the chunks, and across them
        assert hashlib.sha256(decrypt(keyfile, ct, feed)).digest() == hashlib.sha256(data).digest()
    facts = structure(ct)
    assert facts.plaintext_size == size and facts.x25519_stanzas == 2
    assert facts.sha256 == hashlib.sha256(ct).hexdigest()


@needs_cli
def test_our_identity_file_works_with_age_keygen(key: Tuple[str, str]) -> None:
    keyfile, recipient = key
    out = subprocess.run([str(AGE_KEYGEN), "-y", keyfile], check=True, capture_output=True, text=True).stdout.strip()
    assert out == recipient


@needs_cli
def test_age_cli_rejects_our_tampered_file(cli_key: Tuple[str, str], tmp_path: Path) -> None:
    keyfile, recipient = cli_key
    ct = bytearray(encrypt([recipient], data_of(CHUNK + 10)))
    ct[-5] ^= 1
    path = tmp_path / "bad.age"
    path.write_bytes(bytes(ct))
    assert subprocess.run([str(AGE), "-d", "-i", keyfile, str(path)], capture_output=True).returncode != 0


# ---------------------------------------------------------------- tampering and truncation


def _three_chunks(recipient: str) -> bytes:
    return encrypt([recipient], data_of(3 * CHUNK + 10))


@pytest.mark.parametrize("where", ["first chunk", "middle chunk", "final chunk", "nonce", "last byte"])
def test_tampered_payload_is_detected(key: Tuple[str, str], where: str) -> None:
    keyfile, recipient = key
    ct = bytearray(_three_chunks(recipient))
    payload = A.encrypted_size(0, 1) - TAG  # header + nonce
    offset = {"first chunk": payload + 100, "middle chunk": payload + ENC_CHUNK + 5,
              "final chunk": payload + 3 * ENC_CHUNK + 3, "nonce": payload - 3, "last byte": len(ct) - 1}[where]
    ct[offset] ^= 0x40
    with pytest.raises(CiphertextCorrupt, match="fails authentication"):
        decrypt(keyfile, bytes(ct))
    # the keyless check cannot see this: the structure is intact
    assert structure(bytes(ct)).plaintext_size == 3 * CHUNK + 10


def test_tampered_header_mac(key: Tuple[str, str]) -> None:
    keyfile, recipient = key
    ct = _three_chunks(recipient)
    mac_at = A.parse_header(ct).size - 44  # "--- " + 43 characters + LF
    bad = ct[:mac_at] + (b"A" if ct[mac_at : mac_at + 1] != b"A" else b"B") + ct[mac_at + 1 :]
    with pytest.raises(CiphertextCorrupt, match="MAC"):
        decrypt(keyfile, bad)


def test_swapped_stanzas_are_refused_by_the_mac(key: Tuple[str, str]) -> None:
    """Reordered stanzas still unwrap the file key, but the MAC covers the header: refused."""
    keyfile, recipient = key
    ct = encrypt([recipient, A.generate_identity()[1]], data_of(10))
    size = A.parse_header(ct).size
    lines = ct[:size].split(b"\n")
    swapped = b"\n".join([lines[0], lines[3], lines[4], lines[1], lines[2]] + lines[5:]) + ct[size:]
    with pytest.raises(CiphertextCorrupt, match="header MAC does not match"):
        decrypt(keyfile, swapped)


def test_truncation_at_a_chunk_boundary(key: Tuple[str, str]) -> None:
    keyfile, recipient = key
    ct = _three_chunks(recipient)
    payload = A.encrypted_size(0, 1) - TAG
    with pytest.raises(CiphertextCorrupt, match="fails authentication|truncated"):
        decrypt(keyfile, ct[: payload + 2 * ENC_CHUNK])
    with pytest.raises(CiphertextCorrupt, match="truncated"):  # whole chunks, none of them final
        decrypt(keyfile, ct[: payload + 3 * ENC_CHUNK])
    with pytest.raises(CiphertextCorrupt, match="fails authentication"):
        decrypt(keyfile, ct[:-1])


def test_trailing_data(key: Tuple[str, str]) -> None:
    keyfile, recipient = key
    # after a full-size final chunk extra bytes are seen as such; after a short one they lengthen
    # the final chunk, whose tag then fails: detected either way
    for size, match in ((CHUNK, "follows the final chunk"), (2 * CHUNK + 10, "final chunk 2 .* fails authentication")):
        ct = encrypt([recipient], data_of(size))
        with pytest.raises(CiphertextCorrupt, match=match):
            decrypt(keyfile, ct + b"x")
        with pytest.raises(CiphertextCorrupt, match="follows the final chunk|fails authentication"):
            decrypt(keyfile, ct + bytes(ENC_CHUNK))


def test_what_authenticated_is_released_and_the_error_stays(key: Tuple[str, str]) -> None:
    """Two good chunks and garbage in one update(): the two come out, the error comes with the next
    call, and every call after that raises it again (a failed stream never resumes)."""
    keyfile, recipient = key
    data = data_of(2 * CHUNK)
    ct = encrypt([recipient], data)
    dec = A.Decryptor(A.load_identities(keyfile))
    assert b"".join(dec.update(ct + b"garbage")) == data
    for call in (lambda: dec.update(b""), dec.finish, dec.finish):
        with pytest.raises(CiphertextCorrupt, match="follows the final chunk"):
            call()


def test_truncated_header_and_nonce(key: Tuple[str, str]) -> None:
    keyfile, recipient = key
    ct = _three_chunks(recipient)
    size = A.parse_header(ct).size
    with pytest.raises(CiphertextCorrupt, match="truncated"):
        decrypt(keyfile, ct[: size - 10])
    with pytest.raises(CiphertextCorrupt, match="payload nonce"):
        decrypt(keyfile, ct[: size + 5])
    with pytest.raises(CiphertextCorrupt, match="empty"):
        decrypt(keyfile, b"")


def test_wrong_identity_is_a_refusal_in_one_sentence(key: Tuple[str, str], tmp_path: Path) -> None:
    _, recipient = key
    secret, other = A.generate_identity()
    wrong = write_key(tmp_path / "wrong.txt", secret, other)
    with pytest.raises(IdentityRefused) as exc:
        decrypt(wrong, encrypt([recipient], data_of(100)))
    msg = exc.value.message
    assert "none of the 1 key in identity file" in msg and "wrong.txt" in msg and "the wrong key?" in msg
    assert "\n" not in msg and secret not in msg and exc.value.exit_code == EXIT_REFUSED


def _grease_file(recipient: A.X25519Recipient, data: bytes) -> bytes:
    """An age file with a foreign stanza in front of ours (as rage writes), built from the format's
    primitives: a reader must skip stanzas it does not know."""
    file_key = os.urandom(16)
    head = (b"age-encryption.org/v1\n-> grease-x a+b c\n" + b64encode(os.urandom(20)) + b"\n"
            + recipient.wrap(file_key) + b"---")
    nonce = os.urandom(16)
    aead = ChaCha20Poly1305(hkdf(file_key, nonce, b"payload"))
    sealed = aead.encrypt(chunk_nonce(0, True), data, None)
    return head + b" " + b64encode(header_mac(file_key, head)) + b"\n" + nonce + sealed


def test_foreign_stanzas_are_listed_and_skipped(key: Tuple[str, str]) -> None:
    keyfile, recipient = key
    ct = _grease_file(A.parse_recipient(recipient), data_of(1000))
    assert decrypt(keyfile, ct) == data_of(1000)
    facts = structure(ct)
    assert facts.stanza_types == ("grease-x", "X25519") and facts.x25519_stanzas == 1
    assert facts.plaintext_size == 1000


# ---------------------------------------------------------------- identity files


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o610])
def test_identity_file_open_to_others_is_refused(key: Tuple[str, str], mode: int) -> None:
    keyfile, _ = key
    os.chmod(keyfile, mode)
    with pytest.raises(IdentityRefused) as exc:
        A.load_identities(keyfile)
    assert f"has mode {mode:04o}" in exc.value.message and exc.value.message.endswith(f"run chmod 600 {keyfile}")


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700])  # group and others: no bit at all
def test_identity_file_private_is_accepted(key: Tuple[str, str], mode: int) -> None:
    keyfile, recipient = key
    os.chmod(keyfile, mode)
    ids = A.load_identities(keyfile)
    assert ids.recipients == (recipient,) and "AGE-SECRET-KEY" not in repr(ids)


def test_identity_file_bad_line_names_the_line_not_the_secret(tmp_path: Path) -> None:
    secret, _ = A.generate_identity()
    broken = secret[:-1] + ("Q" if secret[-1] != "Q" else "P")
    path = tmp_path / "k.txt"
    path.write_text(f"# comment\n\n{broken}\n")
    os.chmod(path, 0o600)
    with pytest.raises(IdentityRefused) as exc:
        A.load_identities(str(path))
    assert "line 3" in exc.value.message and "checksum" in exc.value.message and broken not in exc.value.message


def test_identity_file_problems(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    os.chmod(empty, 0o600)
    with pytest.raises(IdentityRefused, match="holds no age identity"):
        A.load_identities(str(empty))
    with pytest.raises(IdentityRefused, match="cannot open"):
        A.load_identities(str(tmp_path / "missing.txt"))
    with pytest.raises(IdentityRefused, match="not a regular file"):
        A.load_identities(str(tmp_path))
    pub = tmp_path / "pub.txt"
    pub.write_text(A.generate_identity()[1] + "\n")
    os.chmod(pub, 0o600)
    with pytest.raises(IdentityRefused, match="public key"):
        A.load_identities(str(pub))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(IdentityRefused, match="not a regular file"):  # never waits on a writer
        A.load_identities(str(fifo))


# ---------------------------------------------------------------- recipient strings


def _flip_last(s: str) -> str:
    return s[:-1] + ("q" if s[-1] != "q" else "p")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda r: _flip_last(r), "bad checksum"),
        (lambda r: r[:-3], "bad checksum"),
        (lambda r: r[:10] + r[10:].upper(), "mixes upper and lower case"),
        (lambda r: r[:8] + "b" + r[9:], "bech32 does not use"),
        (lambda r: "", "is empty"),
        (lambda r: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE user@host", "SSH key"),
        (lambda r: "hello", "not an age recipient"),
        (lambda r: A.bech32_encode("age", bytes(31)), "holds 31 bytes"),
        (lambda r: A.bech32_encode("age", bytes(32)), "low-order point"),
        (lambda r: A.bech32_encode("age1yubikey", bytes(33)), "plugin recipient"),
        (lambda r: A.bech32_encode("age1pq", bytes(40)), "post-quantum"),
    ],
)
def test_bad_recipients(make: Callable[[str], str], match: str) -> None:
    good = A.generate_identity()[1]
    with pytest.raises(RecipientInvalid, match=match) as exc:
        A.parse_recipients([good, make(good)])
    assert exc.value.message.startswith("backup.encrypt_to[1]") and "\n" not in exc.value.message


def test_a_secret_key_given_as_recipient_is_never_echoed() -> None:
    secret, _ = A.generate_identity()
    with pytest.raises(RecipientInvalid, match="SECRET key") as exc:
        A.parse_recipients([secret])
    assert secret not in exc.value.message and secret.lower() not in exc.value.message
    assert secret[16:40] not in exc.value.message.upper()


def test_recipient_list_rules() -> None:
    good = A.generate_identity()[1]
    assert A.parse_recipient(good.upper()) == A.parse_recipient(good)
    assert str(A.parse_recipient(good.upper())) == good
    assert len(A.parse_recipients([good, good, " " + good + "\n"])) == 1
    with pytest.raises(RecipientInvalid, match="lists no recipient"):
        A.parse_recipients([])
    with pytest.raises(RecipientInvalid, match="at most 20"):
        A.parse_recipients([A.generate_identity()[1] for _ in range(21)])
    with pytest.raises(ValueError, match="no recipients"):
        A.Encryptor([])


# ---------------------------------------------------------------- keyless structure checks


def test_check_structure_facts(key: Tuple[str, str]) -> None:
    _, recipient = key
    data = data_of(5 * CHUNK + 1)
    ct = encrypt([recipient, A.generate_identity()[1]], data)

    def read_at(off: int, n: int) -> bytes:
        return ct[off : off + n]

    full = A.check_structure(read_at, len(ct))
    assert full == structure(ct, feed=7)
    assert full.plaintext_size == len(data) and full.chunks == 6 and full.stanza_types == ("X25519", "X25519")
    assert full.header_size == 70 + 2 * 98 and full.sha256 == hashlib.sha256(ct).hexdigest()
    quick = A.check_structure(read_at, len(ct), sha256=False)  # the header only: listing
    assert quick.plaintext_size == len(data) and quick.sha256 is None


def test_check_structure_sizes(key: Tuple[str, str]) -> None:
    _, recipient = key
    ct = encrypt([recipient], data_of(2 * CHUNK + 50))
    # a shorter final chunk still fits the chunking (only the key tells): one byte less plaintext
    assert structure(ct[:-1]).plaintext_size == 2 * CHUNK + 49
    with pytest.raises(CiphertextCorrupt, match="does not fit the 64 KiB chunking"):  # cut into a tag
        structure(ct[: len(ct) - 50 - 1])
    full = encrypt([recipient], data_of(2 * CHUNK))
    with pytest.raises(CiphertextCorrupt, match="does not fit"):  # an empty final chunk after full ones
        structure(full + bytes(TAG))
    with pytest.raises(CiphertextCorrupt, match="shorter than one chunk tag"):
        structure(ct[: A.parse_header(ct).size + 16 + 3])
    with pytest.raises(CiphertextCorrupt, match="ends at byte"):
        A.check_structure(lambda off, n: ct[off : min(off + n, 1000)], len(ct))


HDR = b"age-encryption.org/v1\n"
STANZA = b"-> X25519 " + b64encode(bytes(range(32))) + b"\n" + b64encode(bytes(32)) + b"\n"
MAC = b"--- " + b64encode(bytes(32)) + b"\n"


@pytest.mark.parametrize(
    "header, match",
    [
        (b"", "empty|not an age file"),
        (b"hello world\n--- x\n", "not an age file"),
        (b"age-encryption.org/v2\n" + STANZA + MAC, "unsupported age format version"),
        (HDR + MAC, "no recipient stanza"),
        (HDR + STANZA, "truncated"),
        (HDR + b"-> \n\n" + MAC, "malformed recipient stanza"),
        (HDR + b"->X25519 abc\n\n" + MAC, "malformed recipient stanza"),
        (HDR + b"-> X25519  two-spaces\n\n" + MAC, "malformed recipient stanza"),
        (HDR + b"-> X25519 " + b"a" * 5000 + b"\n\n" + MAC, "bytes long"),
        (HDR + STANZA * 65 + MAC, "more than 64 recipient stanzas"),
        (HDR + b"-> grease\n" + b"A" * 64 + b"\n" + MAC, "does not end with a short line"),
        (HDR + b"-> grease\n" + b"A" * 65 + b"\n" + MAC, "longer than 64 columns"),
        (HDR + b"-> grease\nAB=\n" + MAC, "padding"),
        (HDR + b"-> grease\nAB\n" + MAC, "non-canonical"),
        (HDR + b"garbage\n" + MAC, "unexpected line"),
        (HDR + STANZA + b"---" + b64encode(bytes(32)) + b"\n", "malformed age header MAC line"),
        (HDR + STANZA + b"--- " + b64encode(bytes(31)) + b"\n", "not 32"),
        (HDR + b"-> X25519 " + b64encode(bytes(31)) + b"\n" + b64encode(bytes(32)) + b"\n" + MAC, "share is 31 bytes"),
        (HDR + b"-> X25519 a b\n" + b64encode(bytes(32)) + b"\n" + MAC, "2 arguments"),
        (HDR + b"-> X25519 " + b64encode(bytes(32)) + b"\n" + b64encode(bytes(16)) + b"\n" + MAC, "body is 16 bytes"),
        (HDR + b"-> scrypt c2FsdHNhbHRzYWx0c2FsdA 18\n" + b64encode(bytes(32)) + b"\n" + STANZA + MAC, "scrypt"),
        (b"-----BEGIN AGE ENCRYPTED FILE-----\nYWdl\n-----END AGE ENCRYPTED FILE-----\n", "ASCII-armored"),
        (HDR + b"-> grease\n" + b"A" * 60 + b"\n" + b"x" * 65536, "no end of the age header"),
    ],
)
def test_malformed_headers(header: bytes, match: str) -> None:
    with pytest.raises(CiphertextCorrupt, match=match):
        structure(header + bytes(16 + 16) if header else b"")


def test_stanza_bound_is_inclusive() -> None:
    facts = structure(HDR + STANZA * 64 + MAC + bytes(32))
    assert facts.x25519_stanzas == 64 and facts.plaintext_size == 0


def test_api_misuse() -> None:
    enc = A.Encryptor(A.parse_recipients([A.generate_identity()[1]]))
    with pytest.raises(ValueError, match="needs finish"):
        enc.plaintext_reader(lambda off, n: b"")
    enc.finish()
    with pytest.raises(ValueError, match="after finish"):
        enc.update(b"x")
    with pytest.raises(ValueError, match="twice"):
        enc.finish()
