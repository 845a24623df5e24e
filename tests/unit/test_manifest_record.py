"""``manifest.json`` as a typed document: the bytes written and the bytes the HMAC covers are
exactly those the agent wrote before (manifests already on disk, signed, under tests/data/manifests
still verify and are written back byte for byte), and a wrong or missing field is one BackupCorrupt
naming the field."""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict

import pytest

from etcd_agent.backup.manifest import ClusterClaim, Encryption, FileEntry, Manifest, ManifestMember
from etcd_agent.errors import BackupCorrupt

KEY = b"k" * 32
DATA = os.path.join(os.path.dirname(__file__), "..", "data", "manifests")


def old(name: str) -> bytes:
    with open(os.path.join(DATA, name), "rb") as fh:
        return fh.read()


@pytest.mark.parametrize("name", ["signed-v2.json", "signed-v3-encrypted.json"])
def test_a_signed_manifest_on_disk_still_verifies_and_is_written_back_byte_for_byte(name: str) -> None:
    raw = old(name)
    m = Manifest.from_json(raw)
    assert m.signature_state(KEY) == "valid" and m.signature_state(b"x" * 32) == "unknown-key"
    assert m.to_bytes() == raw
    assert m.signed(KEY) == m  # signing again gives the same MAC: the canonical bytes are the same


def test_the_writer_writes_the_bytes_it_wrote_before() -> None:
    # the manifest of signed-v2.json as the backup service builds one
    m = Manifest(
        files={"etcd_snapshot.db": FileEntry(20512, "a" * 64), "etcd.conf": FileEntry(310, "b" * 64)},
        name="etcd-2026-12-07-12-00-00.tar.gz", created="2026-12-07T12:00:00+00:00", created_unix=1796644800,
        host="master1", member="m1", endpoint="https://10.0.0.1:2379", member_id="8e9e05c52164694d",
        cluster=ClusterClaim("k8s", "cdf818194e3a8c32"),
        members=(ManifestMember("8e9e05c52164694d", "m1", ("https://10.0.0.1:2380",), ("https://10.0.0.1:2379",)),
                 ManifestMember("2e0a5e0f1ab7a62b", "m2", ("https://10.0.0.2:2380",), (), True)),
        revision=1234, store_revision=1240, etcd_version="3.5.16", agent_version="0.9.0", db_size=20512,
        compression="gzip", missing={"etcd.service": "no unit file on this host"},
        rendered={"etcd.conf": "rendered from the config"},
        snapshot={"page_size": 4096, "pages": 5, "txid": 17, "checks": ["etcd sha256 trailer", "bbolt meta pages"],
                  "status": None, "taken_by": "daemon", "checkpoint": {"chain_id": "0" * 32}},
        verified=True)
    assert m.signed(KEY).to_bytes() == old("signed-v2.json")
    assert (m.cluster_name, m.cluster_id, m.origin, m.checkpoint_of) == ("k8s", "cdf818194e3a8c32", "daemon", "0" * 32)
    enc = Manifest(files={"etcd_snapshot.db.age": FileEntry(300, "1" * 64)}, name="e", revision=3, format_version=3,
                   encryption=Encryption(("age1" + "q" * 58,), 20512, "0" * 64),
                   imported={"source": "runbook.tar.gz", "encrypted_to": ["age1" + "p" * 58]},
                   snapshot={"status": {"hash": 1, "revision": 3, "totalKey": 9, "totalSize": 20512, "version": "3.5.0"}})
    assert enc.signed(KEY).to_bytes() == old("signed-v3-encrypted.json")


def test_an_unsigned_format_1_manifest_still_reads() -> None:
    doc = {"format": "etcd-agent-backup", "format_version": 1, "revision": 3,
           "files": {"etcd_snapshot.db": {"size": 1, "sha256": "b" * 64}}}
    m = Manifest.from_json(json.dumps(doc).encode())
    assert m.signature_state(KEY) == "unsigned" and m.cluster_name is None and m.members is None
    assert m.files == {"etcd_snapshot.db": FileEntry(1, "b" * 64)}


def v2() -> Dict[str, Any]:
    return dict(json.loads(old("signed-v2.json")))


def with_(path: str, value: Any) -> bytes:
    doc = copy.deepcopy(v2())
    *outer, last = path.split(".")
    d = doc
    for k in outer:
        d = d[k]
    if value is KeyError:
        del d[last]
    else:
        d[last] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize("path,value,field", [
    ("revision", "1234", "Manifest.revision"),
    ("revision", -1, "Manifest.revision"),
    ("name", 7, "Manifest.name"),
    ("verified", "yes", "Manifest.verified"),
    ("cluster", "k8s", "Manifest.cluster"),
    ("cluster.id", 7, "ClusterClaim.id"),
    ("members", "m1", "Manifest.members"),
    ("members", [{"id": "1f", "name": "m1", "peer_urls": "http://x"}], "ManifestMember.peer_urls"),
    ("files.etcd_snapshot.db", KeyError, "lists no etcd_snapshot.db"),
    ("format_version", KeyError, "Manifest lacks its field 'format_version'"),
    ("snapshot", [], "Manifest.snapshot"),
    ("signature.mac", 7, "Signature.mac"),
    ("missing", {"secrets.txt": "x"}, "Manifest.missing"),
    ("evil", 1, "evil"),
])
def test_a_wrong_or_missing_field_is_one_backup_corrupt_naming_it(path: str, value: Any, field: str) -> None:
    if path == "files.etcd_snapshot.db":  # the key holds a dot
        doc = v2()
        del doc["files"]["etcd_snapshot.db"]
        body = json.dumps(doc).encode()
    else:
        body = with_(path, value)
    with pytest.raises(BackupCorrupt) as exc:
        Manifest.from_json(body, where="b.tar: manifest.json")
    assert exc.value.message.startswith("b.tar: manifest.json: ") and field in exc.value.message, exc.value.message
    assert "\n" not in exc.value.message
