"""An encrypted snapshot member (``etcd_snapshot.db.age``), as the bounded reader meets it.

With an identity it is decrypted as it streams out of the tar into the reader's private 0600
staging dir, under a temporary name until the last chunk has authenticated and the plaintext
passed every check a plain snapshot gets (etcd's sha256 trailer, the bbolt meta pages before a
byte is written, the size); only then does it get its name, ``etcd_snapshot.db``. A wrong key is
refused at the header, before anything is written.

Without one it is checked as far as its bytes allow: the age header (bounded), its stanzas, a
total size the 64 KiB chunking can produce (so the exact plaintext size), the ciphertext's sha256;
``compare`` holds those against the manifest, and says what only the key could have shown.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from etcd_agent.backup.manifest import SNAPSHOT, SNAPSHOT_AGE, Manifest
from etcd_agent.backup.snapcheck import StreamCheck, check_size
from etcd_agent.backup.tarstream import CHUNK, Stream
from etcd_agent.errors import BackupCorrupt, IdentityRefused

if TYPE_CHECKING:  # pragma: no cover - the age code (and `cryptography`) only for an encrypted member
    from etcd_agent.age import Identities, StructureFacts

# the header of an age file for 64 recipients and the tags of every chunk of the largest snapshot
OVERHEAD_MAX = 64 * 1024 + (64 << 30) // (64 * 1024) * 16


@dataclass(frozen=True)
class Sealed:
    """What the reader learnt of an encrypted snapshot member."""

    size: int  # ciphertext bytes
    sha256: Optional[str]  # of the ciphertext (None: not hashed, e.g. listing)
    plaintext_size: int  # from the chunking (exact)
    stanzas: Tuple[str, ...]  # the header's stanza types, in order
    recipients: Tuple[str, ...]  # the manifest's list (a claim; () without a manifest)
    identity_file: Optional[str] = None  # the identity file that opened it; None: not decrypted

    @property
    def decrypted(self) -> bool:
        return self.identity_file is not None

    def describe(self) -> str:
        """``age, to age1qyq…3k8f, age1…`` (public keys shortened), for plans and listings."""
        if not self.recipients:
            return f"age, {self.stanzas.count('X25519')} X25519 recipient stanza(s) (no manifest names them)"
        return f"age, to {len(self.recipients)} recipient(s): {shown_recipients(self.recipients)}"


def shown_recipients(recipients: Sequence[str]) -> str:
    """``age1qyq…3k8f, age1…``: public keys shortened for plans, listings and refusals."""
    return ", ".join(r[:12] + "..." + r[-4:] for r in recipients)


def locked(path_hint: str, manifest: Optional[Manifest]) -> IdentityRefused:
    """The refusal of an operation that needs the snapshot itself when no identity was given."""
    to = ""
    if manifest is not None and manifest.encryption is not None:
        to = " to " + shown_recipients(manifest.encryption.recipients)
    return IdentityRefused(f"{path_hint}: its snapshot is encrypted (age{to}): pass --identity FILE with the secret "
                           "key of one of its recipients; nothing touched")


def decrypt_member(st: Stream, size: int, identities: "Identities", stage: str) -> Tuple[str, StreamCheck, Sealed]:
    """Decrypt ``size`` bytes of ``st`` into ``stage/etcd_snapshot.db``; (path, the plaintext's
    check, what the ciphertext showed). Raises IdentityRefused (wrong key) or BackupCorrupt."""
    from etcd_agent.age import NONCE_SIZE, Decryptor, plaintext_size

    final = os.path.join(stage, SNAPSHOT)
    tmp = os.path.join(stage, f".{SNAPSHOT}.decrypting")
    dec = Decryptor(identities, what=SNAPSHOT_AGE)
    ct_sha = hashlib.sha256()
    check: Optional[StreamCheck] = None
    held: List[bytes] = []
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        left = size
        while left:
            chunk = st.read(min(CHUNK, left))
            if not chunk:
                raise BackupCorrupt(f"truncated: member {SNAPSHOT_AGE!r} declares {size} bytes, about "
                                    f"{size - left} could be read before the archive ran out")
            left -= len(chunk)
            ct_sha.update(chunk)
            parts = dec.update(chunk)  # IdentityRefused here, at the header, if no key opens it
            if check is None and dec.header is not None:
                plain, _ = plaintext_size(size - dec.header.size - NONCE_SIZE)
                check_size(plain, SNAPSHOT)
                check = StreamCheck(declared=plain, what=SNAPSHOT)
            for part in parts:
                assert check is not None
                check.update(part)  # raises on a bad meta page after the first pages
                if not check.meta_ok:
                    held.append(part)  # nothing is written before the meta pages are proven
                    continue
                for p in held + [part]:
                    out.write(p)
                held = []
        tail = dec.finish()  # the final chunk authenticates, or the file was cut or changed
        assert check is not None
        check.update(tail)
        for p in held + [tail]:
            out.write(p)
        check.finish()
        out.flush()
        os.fsync(out.fileno())
    os.rename(tmp, final)  # a name only once every chunk authenticated and the snapshot checked out
    facts = dec.facts
    assert dec.header is not None
    return final, check, Sealed(size, ct_sha.hexdigest(), facts.plaintext_size, facts.stanza_types, (),
                                identities.path)


def check_member(st: Stream, size: int, *, hash_it: bool, archive_path: str, offset: int) -> Sealed:
    """The keyless checks of ``size`` bytes of ``st``: streamed (and hashed) through, or, in a plain
    tar when not hashing (listing), only the header read in place and the rest skipped."""
    from etcd_agent.age import StructureCheck, check_structure

    if st.compression == "none" and not hash_it:
        fd = os.open(archive_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            facts = check_structure(lambda off, n: os.pread(fd, max(0, min(n, size - off)), offset + off), size,
                                    sha256=False, what=SNAPSHOT_AGE)
        finally:
            os.close(fd)
        got = st.skip(size)
        if got < size:
            raise BackupCorrupt(f"truncated: member {SNAPSHOT_AGE!r} declares {size} bytes, only {got} present")
    else:
        sc = StructureCheck(sha256=True, what=SNAPSHOT_AGE)
        left = size
        while left:
            chunk = st.read(min(CHUNK, left))
            if not chunk:
                raise BackupCorrupt(f"truncated: member {SNAPSHOT_AGE!r} declares {size} bytes, about "
                                    f"{size - left} could be read before the archive ran out")
            left -= len(chunk)
            sc.update(chunk)
        facts = sc.finish()
    return _sealed(facts, size)


def _sealed(facts: "StructureFacts", size: int) -> Sealed:
    check_size(facts.plaintext_size, f"{SNAPSHOT_AGE} (by its size)")
    return Sealed(size, facts.sha256, facts.plaintext_size, facts.stanza_types, ())


def compare(sealed: Sealed, m: Optional[Manifest], plain_sha: Optional[str],
            checked: List[str], not_checked: List[str]) -> Sealed:
    """The member against the manifest (ciphertext size and sha256; the plaintext's size and, once
    decrypted, its sha256; one X25519 stanza per recipient); the lines saying what was shown.
    Returns ``sealed`` with the manifest's recipients."""
    n = SNAPSHOT_AGE
    x25519 = sealed.stanzas.count("X25519")
    enc = m.encryption if m is not None else None
    if m is not None:
        if enc is None:
            raise BackupCorrupt(f"{n} is in the archive, but the manifest says the snapshot is not encrypted")
        want = m.files[n]
        if sealed.size != want.size:
            raise BackupCorrupt(f"{n}: {sealed.size} bytes, the manifest says {want.size}")
        if sealed.sha256 is not None and sealed.sha256 != want.sha256:
            raise BackupCorrupt(f"{n}: sha256 mismatch (manifest {want.sha256[:16]}..., archive {sealed.sha256[:16]}...)")
        if sealed.plaintext_size != enc.plaintext_size:
            raise BackupCorrupt(f"{n}: its size gives {sealed.plaintext_size} bytes of plaintext, the manifest says "
                                f"{enc.plaintext_size}")
        if x25519 != len(enc.recipients):
            raise BackupCorrupt(f"{n}: {x25519} X25519 recipient stanza(s), the manifest lists "
                                f"{len(enc.recipients)} recipient(s)")
        if plain_sha is not None and plain_sha != enc.plaintext_sha256:
            raise BackupCorrupt(f"{SNAPSHOT} (decrypted): sha256 mismatch (manifest {enc.plaintext_sha256[:16]}..., "
                                f"decrypted {plain_sha[:16]}...)")
        sealed = Sealed(sealed.size, sealed.sha256, sealed.plaintext_size, sealed.stanzas, enc.recipients,
                        sealed.identity_file)
    stanzas = f"{x25519} X25519 recipient stanza(s)" + (f" of {len(sealed.stanzas)}" if x25519 != len(sealed.stanzas)
                                                         else "")
    manifest_says = " as the manifest says" if enc is not None else ""
    checked.append(f"{n}: age v1 header well-formed, {stanzas}{' = the recipients the manifest lists' if enc else ''}; "
                   f"{sealed.size} bytes fit the 64 KiB chunking: exactly {sealed.plaintext_size} bytes of "
                   f"plaintext{manifest_says}")
    if sealed.sha256 is not None and enc is not None:
        checked.append(f"{n}: {sealed.size} bytes, sha256 of the ciphertext matches the manifest")
    elif sealed.sha256 is None:
        not_checked.append(f"{n}: not hashed this time (listing): its sha256 not compared")
    if sealed.decrypted:
        checked.append(f"{n}: decrypted with {sealed.identity_file}: every chunk and the header MAC authenticated")
        if plain_sha is not None and enc is not None:
            checked.append(f"{SNAPSHOT} (decrypted): sha256 matches the manifest's plaintext sha256")
    else:
        not_checked.append(f"{SNAPSHOT}: encrypted and not decrypted (no --identity): the chunks' authentication, "
                           "etcd's sha256 trailer, the bbolt pages, its revision and whose snapshot it is (its "
                           "members) need the key")
    return sealed
