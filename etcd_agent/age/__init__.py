"""age v1 (age-encryption.org/v1) to X25519 recipients, streaming, on ``cryptography``.

What the backups need of the format and nothing more: encrypt a snapshot as it streams into the
archive (``Encryptor``), read back a few of its pages through the same encryptor, decrypt it as it
streams out (``Decryptor``), check a ciphertext without its key (``StructureCheck``), and parse
recipients (``age1...``, the config) and identity files (``AGE-SECRET-KEY-1...``, an operator's).
Files written here are standard binary age files: ``age -d -i key.txt`` decrypts them, and files
the ``age`` tool writes decrypt here (tests/unit/test_age.py checks both ways).

Format facts used: a 16-byte file key is wrapped for each recipient (an ephemeral X25519 share,
HKDF-SHA-256 with salt = share || recipient and info "age-encryption.org/v1/X25519",
ChaCha20-Poly1305 under a zero nonce); the header ends with HMAC-SHA-256 over itself keyed by
HKDF(file key, info "header"); the payload is a 16-byte nonce, then 64 KiB plaintext chunks, each
ChaCha20-Poly1305-sealed under HKDF(file key, salt = nonce, info "payload") with a 12-byte nonce:
an 11-byte big-endian counter, then 0x01 for the final chunk, 0x00 before it.

Sizes, for R recipients and P plaintext bytes: header 70 + 98 R bytes, file
header + 16 + P + 16 x max(1, ceil(P / 65536)).

This package is the agent's only importer of ``cryptography``. Errors are the agent's own: a bad
recipient is ``RecipientInvalid`` (config, exit 2), a missing, open or wrong identity
``IdentityRefused`` (exit 3), a malformed or tampered ciphertext ``CiphertextCorrupt``.
"""
from etcd_agent.age.header import (
    CHUNK,
    ENC_CHUNK,
    MAX_RECIPIENTS,
    NONCE_SIZE,
    TAG,
    encrypted_size,
    parse_header,
    plaintext_size,
)
from etcd_agent.age.keys import (
    Identities,
    X25519Identity,
    X25519Recipient,
    bech32_encode,
    generate_identity,
    load_identities,
    parse_identity,
    parse_recipient,
    parse_recipients,
)
from etcd_agent.age.stream import DecryptFacts, Decryptor, Encryptor, StructureCheck, StructureFacts, check_structure

FORMAT = "age"

__all__ = [
    "CHUNK", "ENC_CHUNK", "FORMAT", "MAX_RECIPIENTS", "NONCE_SIZE", "TAG", "DecryptFacts", "Decryptor", "Encryptor",
    "Identities", "StructureCheck", "StructureFacts", "X25519Identity", "X25519Recipient", "bech32_encode",
    "check_structure", "encrypted_size", "generate_identity", "load_identities", "parse_header", "parse_identity",
    "parse_recipient", "parse_recipients", "plaintext_size",
]
