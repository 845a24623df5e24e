"""Hostile delta chains handed to a point-in-time restore: each refused in one sentence before
anything is written (pure: a real full backup of tests/data's etcd 3.5.16 snapshot and a chain of
segments beside it in a backup dir, no etcd; ``pitr.prepare`` is what a restore runs first).

Every case counts the bytes the refusal wrote anywhere under the test's dir: 0 is the rule."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import struct
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest

from etcd_agent.backup import archive, keys
from etcd_agent.backup.checks import SYSTEM_WALL_CLOCK
from etcd_agent.backup.manifest import FileEntry, Manifest
from etcd_agent.backup.service import _record_check
from etcd_agent.chain.reader import read_segment
from etcd_agent.chain.segments import SegmentHeader, list_segments, segment_name
from etcd_agent.chain.writer import SegmentWriter
from etcd_agent.config import parse_text
from etcd_agent.errors import RefusedError
from etcd_agent.pitr import prepare as pitr
from etcd_agent.pitr.replay import Target
from tests.harness.chains import tree

from .test_chain_segments import write_chain

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
SNAP = open(os.path.join(DATA, "snap-a.db"), "rb").read()  # members m1..m3, revision 3
SNAP_SHA = hashlib.sha256(SNAP).hexdigest()
FULL = "etcd-2019-08-07-13-00-00.tar"
FULL_MS = 1565182800 * 1000
END = 15  # the chain: revisions 4..7, 8..10, 11..15


def build(infos: Dict[str, archive.FileInfo], facts: Any, ident: Any) -> Manifest:
    return Manifest(files={n: FileEntry(i.size, i.sha256) for n, i in infos.items()}, revision=ident.revision,
                    missing={"etcd.service": "not found"}, verified=True)


@pytest.fixture
def bed(tmp_path: Any) -> Iterator[Tuple[Any, str, List[str]]]:
    d = str(tmp_path / "backups")
    os.makedirs(d, mode=0o700)
    cfg, errors = parse_text(f'[cluster]\nname = "a"\n[backup]\ndir = "{d}"\n[daemon]\nstate_dir = "{tmp_path}/state"\n'
                     + "".join(f'[[member]]\nname = "m{i}"\nhost = "127.0.0.1"\npeer_url = "http://127.0.0.1:{p}"\n'
                               f'client_url = "http://127.0.0.1:{p - 1}"\n'
                               for i, p in ((1, 17380), (2, 17382), (3, 17384))))
    assert cfg is not None, errors
    w = archive.write_archive(d, FULL, chunks=iter([SNAP]), files={"etcd.conf": b"ETCD_NAME=m1\n"},
                              build_manifest=build, mtime=FULL_MS // 1000)
    _record_check(d, w.path, "written", SYSTEM_WALL_CLOCK, revision=w.revision, sha256=SNAP_SHA)
    assert w.revision == 3
    write_chain(d, 3, [4, 3, 5], chain_id="5e" * 16, t0=FULL_MS + 1000, base_sha256=SNAP_SHA)
    yield cfg, d, list_segments(d)


def with_key(cfg: Any, tmp_path: Any, key: bytes) -> Any:
    """``cfg`` with a config path of its own, beside it this host's manifest key ``key``."""
    conf = str(tmp_path / "etc" / "agent.toml")
    os.makedirs(os.path.dirname(conf), mode=0o700)
    cfg = dataclasses.replace(cfg, path=conf)
    with open(keys.key_path(cfg), "w") as fh:
        fh.write(key.hex() + "\n")
    os.chmod(keys.key_path(cfg), 0o600)
    return cfg


def rewrite(path: str, mutate: Callable[[SegmentHeader], SegmentHeader], name: str = "") -> str:
    """The segment written again with its header changed: a valid digest over a forged header."""
    seg = read_segment(path)
    d = os.path.dirname(path)
    os.unlink(path)
    w = SegmentWriter(d, mutate(seg.info.header))
    for t in seg.txns:
        w.add_txn(t)
    for rec in seg.info.lease_records:
        w.add_lease(rec)
    info = w.close(seg.info.footer.end_time_ms, confirmed=seg.info.footer.confirmed)
    if name:
        os.rename(info.path, os.path.join(d, name))
        return os.path.join(d, name)
    return info.path


def redigest(path: str, data: bytes) -> None:
    """``data`` with a correct trailing sha256: a reader must not rely on the digest alone."""
    body = data[:-32]
    with open(path, "wb") as fh:
        fh.write(body + hashlib.sha256(body).digest())


def bit_flip(d: str, segs: List[str]) -> None:
    raw = bytearray(open(segs[1], "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(segs[1], "wb").write(bytes(raw))


def truncate_at_record(d: str, segs: List[str]) -> None:
    raw = open(segs[1], "rb").read()
    hlen = struct.unpack(">I", raw[8:12])[0]
    first = 12 + hlen
    rlen = struct.unpack(">I", raw[first + 1:first + 5])[0]
    open(segs[1], "wb").write(raw[:first + 5 + rlen])


def other_cluster(d: str, segs: List[str]) -> None:
    other = os.path.join(d, "..", "other")
    os.makedirs(other)
    theirs = write_chain(other, 3, [4, 3, 5], chain_id="0f" * 16, t0=FULL_MS + 1000)
    os.unlink(segs[1])
    shutil.copy(theirs[1].path, d)
    shutil.rmtree(other)


def reordered(d: str, segs: List[str]) -> None:
    a, b = open(segs[1], "rb").read(), open(segs[2], "rb").read()
    open(segs[1], "wb").write(b)
    open(segs[2], "wb").write(a)


def duplicated(d: str, segs: List[str]) -> None:
    shutil.copy(segs[1], segs[2])


def forged_prev(d: str, segs: List[str]) -> None:
    rewrite(segs[2], lambda h: SegmentHeader(h.chain_id, h.seq, h.base_revision, h.start_revision, "0" * 64,
                                             h.start_time_ms, h.cluster_id, h.member_id, h.endpoint, h.base_sha256))


def eight_gib(d: str, segs: List[str]) -> None:
    raw = bytearray(open(segs[1], "rb").read())
    hlen = struct.unpack(">I", raw[8:12])[0]
    first = 12 + hlen
    raw[first + 1:first + 5] = struct.pack(">I", 0xFFFFFFF0)  # u32: ~4 GiB; with the value's own, past 8
    redigest(segs[1], bytes(raw))


def future_by_name(d: str, segs: List[str]) -> None:
    seg = read_segment(segs[2]).info
    ahead = int((time.time() + 30 * 86400) * 1000)
    os.rename(segs[2], os.path.join(d, segment_name(seg.start_revision, seg.end_revision, ahead)))


def future_by_mtime(d: str, segs: List[str]) -> None:
    ahead = time.time() + 30 * 86400
    os.utime(segs[2], (ahead, ahead))


def sparse_8_gib(d: str, segs: List[str]) -> None:
    """A hole: segment 2 extended to 8 GiB without a block written (a broken disk, a bad copy)."""
    os.truncate(segs[1], 8 << 30)


CASES = [bit_flip, truncate_at_record, other_cluster, reordered, duplicated, forged_prev, eight_gib,
         future_by_name, future_by_mtime, sparse_8_gib]


def test_the_chain_as_written_is_accepted(bed: Any) -> None:
    cfg, _d, _segs = bed
    p = pitr.prepare(cfg, "latest", Target.to_revision(END), accept_unsigned=True)  # (signatures: test_pitr_signed_chains)
    assert p.plan.complete and p.plan.stop_revision == END


@pytest.mark.parametrize("damage", CASES, ids=[c.__name__ for c in CASES])
def test_a_hostile_chain_is_refused_in_one_sentence_writing_nothing(bed: Any, damage: Any) -> None:
    cfg, d, segs = bed
    damage(d, segs)
    root = os.path.dirname(d)
    before = tree(root)
    with pytest.raises(RefusedError) as exc:  # (an unsigned chain: refused for its damage, not for that)
        pitr.prepare(cfg, "latest", Target.to_revision(END), accept_unsigned=True)
    after = tree(root)
    written = sum(s for p, (s, _m) in after.items() if before.get(p) != (s, _m))
    msg = exc.value.message
    print(f"\nFIGURE hostile chain {damage.__name__}: refused ({written} bytes written): {msg}")
    assert "\n" not in msg and msg.endswith("nothing touched"), msg
    assert after == before and written == 0
