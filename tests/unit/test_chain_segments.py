"""The segment format: writer, bounded reader, chain check, fuzz (pure: no etcd)."""
import os
import random
import stat
import time

import pytest

from etcd_agent.chain.check import check_chain
from etcd_agent.chain.errors import DeltaError, SegmentCorrupt
from etcd_agent.chain.reader import read_segment, read_summary
from etcd_agent.chain.segments import DELETE, PUT, Event, LeaseRecord, SegmentHeader, Txn, list_segments, parse_name
from etcd_agent.chain.writer import SegmentWriter, remove_stale_temps

T0 = 1_700_000_000_000


def put(rev, key, value=b"v", create=None, version=1, lease=0):
    return Event(PUT, key, value, rev, create or rev, version, lease)


def delete(rev, key):
    return Event(DELETE, key, b"", rev, 0, 0, 0)


def write_chain(directory, base, sizes, chain_id="ab" * 16, t0=T0, base_sha256="", recipients=(), sign_key=None,
                value_size=None):
    """A chain of segments after ``base``: sizes[i] revisions in segment i (0: idle segment);
    with ``recipients`` encrypted (``.seg.age``); ``value_size``: every put's value that long."""
    infos = []
    rev = base + 1
    prev = ""
    t = t0
    for seq, n in enumerate(sizes):
        h = SegmentHeader(chain_id, seq, base, rev, prev, t, base_sha256=base_sha256)
        w = SegmentWriter(directory, h, recipients=recipients, sign_key=sign_key)
        for _ in range(n):
            t += 10
            evs = (put(rev, b"k%d" % (rev % 7), b"x" * (rev % 50 if value_size is None else value_size)),)
            if rev % 5 == 0:
                evs = evs + (delete(rev, b"gone%d" % rev), put(rev, b"t%d" % rev, lease=0x10))
            w.add_txn(Txn(rev, t, evs))
            rev += 1
        w.add_lease(LeaseRecord(0x10, 60, 50, t))
        t += 100
        info = w.close(t, confirmed=True)
        infos.append(info)
        prev = info.sha256
    return infos


def test_roundtrip_and_file_mode(tmp_path):
    old = os.umask(0)
    try:
        infos = write_chain(str(tmp_path), 100, [5, 0, 3])
    finally:
        os.umask(old)
    for info in infos:
        assert stat.S_IMODE(os.stat(info.path).st_mode) == 0o600
    seg = read_segment(infos[0].path)
    assert [t.revision for t in seg.txns] == [101, 102, 103, 104, 105]
    assert seg.txns[4].events[1] == Event(DELETE, b"gone105", b"", 105, 0, 0, 0)
    assert seg.info.lease_records == (LeaseRecord(0x10, 60, 50, seg.txns[-1].time_ms),)
    assert seg.info.sha256 == infos[0].sha256
    # idle segment: empty revision range, visible in the name
    assert parse_name(os.path.basename(infos[1].path)) == (106, 105)
    assert read_segment(infos[1].path).txns == ()
    header, footer = read_summary(infos[2].path)
    assert (header.start_revision, footer.end_revision, footer.txns) == (106, 108, 3)
    assert [os.path.basename(p) for p in list_segments(str(tmp_path))] == [os.path.basename(i.path) for i in infos]
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]  # no temp file left


def test_writer_keeps_revisions_contiguous(tmp_path):
    w = SegmentWriter(str(tmp_path), SegmentHeader("cd" * 16, 0, 10, 11, "", T0))
    w.add_txn(Txn(11, T0, (put(11, b"a"),)))
    with pytest.raises(DeltaError):
        w.add_txn(Txn(13, T0, (put(13, b"a"),)))
    with pytest.raises(DeltaError):
        w.add_txn(Txn(12, T0, ()))
    w.abort()
    assert os.listdir(tmp_path) == []


def test_time_never_goes_backwards(tmp_path):
    w = SegmentWriter(str(tmp_path), SegmentHeader("cd" * 16, 0, 10, 11, "", T0))
    w.add_txn(Txn(11, T0 + 500, (put(11, b"a"),)))
    w.add_txn(Txn(12, T0 + 100, (put(12, b"a"),)))  # wall clock stepped back
    info = w.close(T0, confirmed=False)
    seg = read_segment(info.path)
    assert [t.time_ms for t in seg.txns] == [T0 + 500, T0 + 500]
    assert seg.info.footer.end_time_ms == T0 + 500


def test_check_chain_good(tmp_path):
    infos = write_chain(str(tmp_path), 100, [4, 0, 0, 6, 2])
    chk = check_chain(list_segments(str(tmp_path)), 100)
    assert chk.stop is None
    assert [i.path for i in chk.segments] == [i.path for i in infos]
    assert chk.end_revision == 112


def test_check_chain_gap(tmp_path):
    infos = write_chain(str(tmp_path), 100, [4, 3, 5])
    os.unlink(infos[1].path)
    chk = check_chain(list_segments(str(tmp_path)), 100)
    assert [i.path for i in chk.segments] == [infos[0].path]
    assert chk.stop.kind == "gap" and chk.stop.at_revision == 105 and chk.stop.last_good_revision == 104
    assert "105..107" in chk.stop.reason
    assert chk.lost == (infos[2].path,)


def test_check_chain_corrupt_middle(tmp_path):
    infos = write_chain(str(tmp_path), 100, [4, 3, 5])
    with open(infos[1].path, "r+b") as fh:
        fh.seek(120)
        b = fh.read(1)
        fh.seek(120)
        fh.write(bytes([b[0] ^ 0x40]))
    chk = check_chain(list_segments(str(tmp_path)), 100)
    assert len(chk.segments) == 1
    assert chk.stop.kind == "corrupt" and chk.stop.at_revision == 105 and chk.stop.path == infos[1].path
    assert "digest" in chk.stop.reason
    assert set(chk.lost) == {infos[1].path, infos[2].path}


def test_check_chain_link_mismatch_and_other_chains(tmp_path):
    a = tmp_path / "a"
    b = tmp_path / "b"
    a.mkdir()
    b.mkdir()
    infos_a = write_chain(str(a), 100, [4, 3])
    infos_b = write_chain(str(b), 100, [4, 3], chain_id="cd" * 16, t0=T0 + 5000)
    # a's second segment replaced by b's second: same revisions, wrong chain/link
    os.unlink(infos_a[1].path)
    os.rename(infos_b[1].path, os.path.join(str(a), os.path.basename(infos_b[1].path)))
    chk = check_chain(list_segments(str(a)), 100)
    assert len(chk.segments) == 1 and chk.stop.kind == "mismatch" and chk.stop.at_revision == 105
    # a chain of another full backup in the same dir is ignored, not an error
    c = write_chain(str(a), 500, [2])
    chk = check_chain(list_segments(str(a)), 500)
    assert chk.stop is None and [i.path for i in chk.segments] == [c[0].path]


def test_duplicate_start_picks_the_linked_one(tmp_path):
    infos = write_chain(str(tmp_path), 100, [4, 3])
    # a damaged copy with the same start revision beside the good one
    bad = os.path.join(str(tmp_path), "etcd-delta-0000000000000105-0000000000000109-20200101T000000Z.seg")
    with open(infos[1].path, "rb") as fh:
        data = bytearray(fh.read())
    data[-40] ^= 1
    with open(bad, "wb") as fh:
        fh.write(bytes(data))
    chk = check_chain(list_segments(str(tmp_path)), 100)
    assert chk.stop is None and [i.path for i in chk.segments] == [i.path for i in infos]


def test_stale_temps_are_ours_only(tmp_path):
    from etcd_agent.backup.archive import PARTIAL_RE

    w = SegmentWriter(str(tmp_path), SegmentHeader("ef" * 16, 0, 1, 2, "", T0))
    name = os.path.basename(w.tmp)
    assert not PARTIAL_RE.match(name)  # the backup's cleanup never deletes an open segment
    (tmp_path / ".etcd-x.partial").write_bytes(b"")
    (tmp_path / "other").write_bytes(b"")
    w._fh.close()
    w._fh = None
    assert remove_stale_temps(str(tmp_path)) == [name]
    assert sorted(os.listdir(tmp_path)) == [".etcd-x.partial", "other"]


def _mutations(data, rng, n):
    for _ in range(n):
        b = bytearray(data)
        op = rng.randrange(4)
        if op == 0:
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            del b[rng.randrange(len(b)) :]
        elif op == 2:
            i = rng.randrange(len(b))
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        else:
            i = rng.randrange(len(b))
            del b[i : i + rng.randint(1, 64)]
        yield bytes(b)


def test_fuzz_reader_raises_only_segment_corrupt(tmp_path):
    infos = write_chain(str(tmp_path), 100, [30])
    with open(infos[0].path, "rb") as fh:
        data = fh.read()
    rng = random.Random(1234)
    target = str(tmp_path / "fuzz.seg")
    start = time.monotonic()
    n = 0
    for mutated in _mutations(data, rng, 1500):
        if mutated == data:
            continue
        with open(target, "wb") as fh:
            fh.write(mutated)
        with pytest.raises(SegmentCorrupt):
            read_segment(target)
        n += 1
    assert n > 1400
    assert time.monotonic() - start < 20


def test_fuzz_structure_behind_a_valid_digest(tmp_path):
    """A forged file with a correct digest must still be parsed within bounds: either it is a
    well-formed segment or SegmentCorrupt - never another exception, never a huge allocation."""
    import hashlib

    infos = write_chain(str(tmp_path), 100, [30])
    with open(infos[0].path, "rb") as fh:
        data = fh.read()
    body = data[:-32]
    rng = random.Random(99)
    target = str(tmp_path / "forged.seg")
    ok = bad = 0
    for mutated in _mutations(body, rng, 1500):
        forged = mutated + hashlib.sha256(mutated).digest()
        with open(target, "wb") as fh:
            fh.write(forged)
        try:
            read_segment(target)
            ok += 1
        except SegmentCorrupt:
            bad += 1
    assert bad > 1000


def test_size_limit(tmp_path):
    infos = write_chain(str(tmp_path), 100, [3])
    with pytest.raises(SegmentCorrupt, match="limit"):
        read_segment(infos[0].path, max_bytes=100)
    with pytest.raises(SegmentCorrupt, match="cannot open"):
        read_segment(str(tmp_path / "missing.seg"))


SHA_BEFORE, SHA_AFTER = "a" * 64, "b" * 64


def test_two_chains_at_one_base_revision_each_continues_its_own_backup(tmp_path):
    """etcd 3.4 restores keep the snapshot's revision: the backup taken after a restore has the
    revision of the one restored from. Its chain is its own, never the chain of before."""
    from etcd_agent.chain import chains
    from etcd_agent.chain.check import BaseBackup
    from etcd_agent.continuous.position import find_resume_point

    d = str(tmp_path)
    before = write_chain(d, 29, [5, 3], chain_id="11" * 16, t0=T0, base_sha256=SHA_BEFORE)
    after = write_chain(d, 29, [2], chain_id="22" * 16, t0=T0 + 60_000, base_sha256=SHA_AFTER)
    paths = list_segments(d)
    new = BaseBackup(SHA_AFTER, T0 + 59_000)
    old = BaseBackup(SHA_BEFORE, T0 - 1000)
    got = check_chain(paths, 29, base=new)
    assert [i.path for i in got.segments] == [after[0].path] and got.stop is None
    got = check_chain(paths, 29, base=old)
    assert [i.path for i in got.segments] == [b.path for b in before] and got.stop is None
    # a watcher continuing the backup of after the restore never resumes the chain of before
    pos = find_resume_point(d, 29, new)
    assert pos is not None and pos.chain_id == "22" * 16 and pos.next_revision == 32 and pos.base_sha256 == SHA_AFTER
    assert find_resume_point(d, 29, BaseBackup("c" * 64, T0 + 120_000)) is None
    scan = chains.scan(d)
    assert len(scan.chains) == 2
    assert scan.for_full(29, new).chain_id == "22" * 16
    assert scan.for_full(29, old).chain_id == "11" * 16
    # the prune plan keeps each chain with its own backup only
    plan = chains.plan_prune(scan, [chains.FullRef("after.tar", 29, True, base=new),
                                    chains.FullRef("before.tar", 29, False, reason="pruned", base=old)])
    by = {tuple(sorted(x.paths)): x for x in plan}
    assert by[tuple(sorted(b.path for b in before))].keep is False
    assert by[(after[0].path,)].keep is True


def test_a_chain_without_a_base_hash_continues_only_a_backup_taken_before_it(tmp_path):
    """Chains written before headers named their backup: judged by time."""
    from etcd_agent.chain.check import BaseBackup
    from etcd_agent.continuous.position import find_resume_point

    d = str(tmp_path)
    write_chain(d, 29, [4], chain_id="33" * 16, t0=T0)
    assert find_resume_point(d, 29, BaseBackup(SHA_BEFORE, T0 - 5000)) is not None  # the backup it was started from
    assert find_resume_point(d, 29, BaseBackup(SHA_AFTER, T0 + 5000)) is None  # one taken after it started
    assert find_resume_point(d, 29, None) is not None  # no backup named: by revision, as before


def test_base_sha256_in_the_header_is_checked(tmp_path):
    from etcd_agent.chain.segments import SegmentHeader as H

    h = H("cd" * 16, 0, 10, 11, "", T0, base_sha256=SHA_AFTER)
    assert H.from_json(h.to_json(), "x.seg").base_sha256 == SHA_AFTER
    assert "base_sha256" not in H("cd" * 16, 0, 10, 11, "", T0).to_json()  # older readers see what they know
    bad = dict(h.to_json(), base_sha256="../../etc")
    with pytest.raises(SegmentCorrupt, match="base_sha256"):
        H.from_json(bad, "x.seg")


CP = "etcd-2026-12-05-10-00-00.tar"


def with_footer(path, footer_json):
    """The segment with its footer record replaced by ``footer_json`` (bytes) and a correct digest:
    what a writer that is not ours, or damage behind a recomputed digest, hands a reader."""
    import hashlib

    from etcd_agent.chain.segments import DIGEST, REC_FOOTER, REC_HEAD, U64

    with open(path, "rb") as fh:
        data = fh.read()
    (footer_at,) = U64.unpack_from(data, len(data) - DIGEST - 8)
    body = data[:footer_at] + REC_HEAD.pack(REC_FOOTER, len(footer_json)) + footer_json + U64.pack(footer_at)
    with open(path, "wb") as fh:
        fh.write(body + hashlib.sha256(body).digest())


def test_a_footer_vouches_for_checkpoints_and_older_readers_see_the_footer_they_know(tmp_path):
    import json

    from etcd_agent.chain.segments import Checkpoint, SegmentFooter

    d = str(tmp_path)
    w = SegmentWriter(d, SegmentHeader("ab" * 16, 0, 100, 101, "", T0))
    for rev in range(101, 106):
        w.add_txn(Txn(rev, T0 + rev, (put(rev, b"k"),)))
    cp = Checkpoint(CP, "c" * 64, 104, 102)
    info = w.close(T0 + 200, confirmed=True, checkpoints=[cp])
    assert read_segment(info.path).info.footer.checkpoints == (cp,)
    assert read_summary(info.path)[1].checkpoints == (cp,)
    raw = info.footer.to_json()
    assert raw["checkpoints"] == [{"name": CP, "sha256": "c" * 64, "revision": 104, "leases_from": 102}]
    # a footer without one is written exactly as before (older readers, older files)
    assert "checkpoints" not in SegmentFooter(5, 1, 1, 1, 0, True).to_json()
    # an older reader's footer parse takes the fields it knows and ignores the new one
    assert SegmentFooter.from_json({k: v for k, v in raw.items() if k != "checkpoints"}, "x.seg").checkpoints == ()
    assert json.loads(json.dumps(raw))["checkpoints"][0]["revision"] == 104


@pytest.mark.parametrize("checkpoints, why", [
    ([{"name": CP, "sha256": "c" * 64, "revision": 106, "leases_from": 101}], "past the segment's end"),
    ([{"name": CP, "sha256": "c" * 64, "revision": 100, "leases_from": 100}], "at or before the chain's base"),
    ([{"name": "../../etc/shadow", "sha256": "c" * 64, "revision": 104, "leases_from": 101}], "Checkpoint.name is malformed"),
    ([{"name": CP + "/x", "sha256": "c" * 64, "revision": 104, "leases_from": 101}], "Checkpoint.name is malformed"),
    ([{"name": CP, "sha256": "C" * 64, "revision": 104, "leases_from": 101}], "Checkpoint.sha256 is malformed"),
    ([{"name": CP, "sha256": "c" * 64, "revision": True, "leases_from": 101}], "revision must be an integer"),
    ([{"name": CP, "sha256": "c" * 64, "revision": 104, "leases_from": 101, "extra": 1}], "Checkpoint has unknown field(s) extra"),
    ([{"name": CP, "sha256": "c" * 64, "revision": 104}], "Checkpoint lacks its field 'leases_from'"),
    ([{"name": CP, "sha256": "c" * 64, "revision": 104, "leases_from": 105}], "revision out of range"),
    ([{"name": CP, "sha256": "c" * 64, "revision": 104, "leases_from": 99}], "at or before the chain's base"),
    ([{"name": CP, "sha256": "c" * 64, "revision": 104, "leases_from": 101}] * 9, "checkpoints must hold 1 to 8 items, not 9"),
    ([], "checkpoints must hold 1 to 8 items, not 0"),
    ({"name": CP}, "checkpoints must be a list, not an object"),
])
def test_a_hostile_checkpoint_in_a_footer_is_damage(tmp_path, checkpoints, why):
    """A footer that vouches for what our writer never would: refused as damage (the chain stops
    there), in one sentence naming the file, before any checkpoint could be used."""
    import json

    d = str(tmp_path)
    w = SegmentWriter(d, SegmentHeader("ab" * 16, 0, 100, 101, "", T0))
    for rev in range(101, 106):
        w.add_txn(Txn(rev, T0 + rev, (put(rev, b"k"),)))
    info = w.close(T0 + 200, confirmed=True)
    footer = dict(info.footer.to_json(), checkpoints=checkpoints)
    with_footer(info.path, json.dumps(footer).encode())
    with pytest.raises(SegmentCorrupt) as exc:
        read_segment(info.path)
    assert why in exc.value.message and info.path in exc.value.message, exc.value.message
    assert "\n" not in exc.value.message
    stop = check_chain([info.path], 100).stop
    assert stop is not None and stop.kind == "corrupt" and why in stop.reason, stop
