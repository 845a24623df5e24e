"""A drill's last two checks (``drill.run``): the restored member read through its API, then held
against the snapshot file read offline - two readers that share nothing but the file.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

from etcd_agent.drill.report import DrillFailed, DrillReport
from etcd_agent.errors import BackupCorrupt
from etcd_agent.etcd.snapkeys import KeyspaceDigest, record_of, scan

PAGE = 1000  # keys per Range while walking the restored member


@dataclass(frozen=True)
class Served:
    """What the restored member served: its key count, the key-space digest, the sampled records."""

    keys: int
    digest: str
    sample: Dict[bytes, Any]


def read_member(s: Any, entries: Dict[str, int], want: int, r: DrillReport, sample_keys: int, rng: random.Random,
                check: Callable[[], None]) -> Served:
    """Step 4: the restored member ``s`` at revision ``want`` (the snapshot's): the revision it
    serves, its leases against the snapshot's ``entries``, every key (keys only, paged) into a
    count and an order-free digest, and ``sample_keys`` keys chosen at random read back."""
    got = s.rpc.header(serializable=False).revision
    leases = len(s.rpc.lease_list())
    if got != want:
        raise DrillFailed(f"the restored member serves revision {got}, the snapshot holds {want}")
    if leases != entries.get("lease", 0):
        raise DrillFailed(f"the restored member holds {leases} leases, the snapshot {entries.get('lease', 0)}")
    r.revision, r.leases = got, leases
    r.checked.append(f"revision {got} served, {leases} leases held, as the snapshot has them")
    digest = KeyspaceDigest()
    n = sample_keys
    sample: List[bytes] = []
    start = b"\0"
    while True:
        check()
        page = s.rpc.range(start, b"\0", keys_only=True, limit=PAGE, revision=got)
        for kv in page.kvs:
            digest.add(kv.key, kv.create_revision, kv.mod_revision, kv.version, kv.lease)
            if len(sample) < n:
                sample.append(kv.key)
            else:
                j = rng.randrange(digest.count)
                if j < n:
                    sample[j] = kv.key
        if not page.more or not page.kvs:
            break
        start = page.kvs[-1].key + b"\0"
    values = {}
    for key in sample:
        check()
        got_kv = s.rpc.range(key, revision=got).kvs
        if len(got_kv) != 1:
            raise DrillFailed(f"key {_show(key)} was listed but reads back {len(got_kv)} times at revision {got}")
        kv = got_kv[0]
        values[key] = record_of(key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)
    r.keys, r.sample = digest.count, len(values)
    return Served(digest.count, digest.hexdigest(), values)


def compare(api: Served, r: DrillReport, a: Any, ident: Any, check: Callable[[], None]) -> None:
    """Step 5: what the member served against the snapshot file of the archive ``a`` read offline
    (``etcd/snapkeys``, no etcd involved): the count, the digest and the sampled records."""
    try:
        ks = scan(a.snapshot.read_at, a.snapshot.size, api.sample, check=check)
    except BackupCorrupt as exc:  # a SnapshotFormatError: etcd served what this reader refuses
        raise DrillFailed(f"the snapshot's key bucket is malformed: {exc.message}") from None
    if ks.revision != ident.revision:
        raise DrillFailed(f"the key bucket ends at revision {ks.revision}, the identity read says "
                          f"{ident.revision}")
    if ks.live_keys != api.keys:
        raise DrillFailed(f"the restored member serves {api.keys} keys at revision {r.revision}, the snapshot "
                          f"file holds {ks.live_keys}")
    if ks.digest != api.digest:
        raise DrillFailed(f"the restored member serves the snapshot's {ks.live_keys} keys, but not each at the "
                          f"revision the file holds it (key-space digest {api.digest[:16]}... against "
                          f"{ks.digest[:16]}...)")
    for key, served in api.sample.items():
        held = ks.wanted.get(key)
        if held is None:
            raise DrillFailed(f"sampled key {_show(key)} is served but the snapshot file does not hold it")
        diff = served.differs(held)
        if diff:
            raise DrillFailed(f"sampled key {_show(key)} is served with {diff} in the snapshot file")
    r.digest = ks.digest
    r.checked.append(f"{api.keys} keys served at revision {r.revision}, each at the create/mod revision, "
                     f"version and lease the snapshot file holds it (key-space digest {ks.digest[:16]}..., "
                     f"computed from the member's API and, independently, from the file's {ks.entries} "
                     "key-bucket entries)")
    if api.sample:
        r.checked.append(f"{len(api.sample)} keys sampled at random read back byte for byte as the snapshot "
                         "file holds them")
    else:
        r.not_proven.append("no value read back: [drill] sample_keys = 0")
    sig = ("the writer signed (sha256 in the signed manifest)" if r.signature == "valid"
           else "etcd's own sha256 trailer covers (nothing proves who wrote them)" if ident.has_trailer
           else "this file holds (no signature, no trailer)")
    r.proved = (f"{r.backup} restores: etcd {r.etcd_version} as {r.run_as} served revision {r.revision} with "
                f"{api.keys} keys and {r.leases} leases - exactly the keys the snapshot file holds, each at its "
                f"revision, and {len(api.sample)} sampled values byte for byte; the bytes are the ones {sig}")
    r.not_proven.append("values outside the sample are compared by the revision that wrote them, not byte "
                        "for byte")
    r.not_proven.append("that the live cluster would take this restore: `etcd-agent restore --from "
                        f"{r.backup} --dry-run` runs those pre-checks")


def _show(key: bytes) -> str:
    text = repr(key)
    return text if len(text) <= 80 else text[:77] + "..."
