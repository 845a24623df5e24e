"""Whose chain a segment is, and which full backup a point-in-time restore takes: decided by the
segments' content (the base sha256 their headers name, the bytes they hold), never by a file's
name (pure: real full backups of tests/data's etcd snapshots - two of cluster "a" at revision 3,
made by etcd 3.5.16 and by 3.4.23, so two snapshots at one revision with different bytes - and
chains written by the segment writer beside them; ``pitr.prepare`` is what a restore runs first).

Issue 35: a consistent forged chain (every link right) naming another full backup is never
replayed onto this one; two chains at one revision: the plan names the one it replays and why.
Issue 38: ``--from latest`` takes the full backup whose chain reaches the target, naming the one
it passed over; a junk file named like the next segment is not a gap."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any, Iterator, List

import pytest

from etcd_agent.backup import archive
from etcd_agent.backup.checks import SYSTEM_WALL_CLOCK
from etcd_agent.backup.service import _record_check
from etcd_agent.chain import chains
from etcd_agent.chain.segments import SegmentHeader, list_segments, segment_name
from etcd_agent.errors import RefusedError
from etcd_agent.pitr import prepare as pitr
from etcd_agent.pitr.replay import Target
from tests.harness.chains import tree

from . import test_pitr_hostile_chains as plain
from .test_chain_segments import write_chain
from .test_pitr_hostile_chains import DATA, END, FULL, FULL_MS, SNAP, SNAP_SHA, build, rewrite

SNAP34 = open(os.path.join(DATA, "snap-a-34.db"), "rb").read()  # cluster "a" again, revision 3, other bytes
SNAP34_SHA = hashlib.sha256(SNAP34).hexdigest()
ELSEWHERE_SHA = "e1" * 32  # a full backup that is not in this dir
KEY = bytes(range(32))


@pytest.fixture
def bed(tmp_path: Any) -> Iterator[Any]:
    """test_pitr_hostile_chains' bed: FULL (revision 3) and its chain 4..15, three segments."""
    yield from plain.bed.__wrapped__(tmp_path)  # type: ignore[attr-defined]


def full(d: str, name: str, snap: bytes, when_ms: int, *, record: bool = True, key: Any = None) -> None:
    w = archive.write_archive(d, name, chunks=iter([snap]), files={"etcd.conf": b"ETCD_NAME=m1\n"},
                              build_manifest=build, mtime=when_ms // 1000, key=key)
    assert w.revision == 3
    if record:
        _record_check(d, w.path, "written", SYSTEM_WALL_CLOCK, revision=w.revision,
                      sha256=hashlib.sha256(snap).hexdigest())


def naming(base_sha: str) -> Any:
    return lambda h: dataclasses.replace(h, base_sha256=base_sha)


def relink(segs: List[str], first: int, mutate: Any) -> List[str]:
    """Segments ``first``.. written again by the segment writer, ``mutate`` applied to the first of
    them and every later one linked to the new bytes: a chain whose every link checks."""
    out = list(segs[:first])
    for i, p in enumerate(segs[first:]):
        prev = out[-1] if out else None
        prev_sha = hashlib.sha256(open(prev, "rb").read()).hexdigest() if prev else ""

        def m(h: SegmentHeader, i: int = i, prev_sha: str = prev_sha) -> SegmentHeader:
            h = mutate(h) if i == 0 or mutate is ALL else h
            return dataclasses.replace(h, prev_sha256=prev_sha) if prev_sha else h
        out.append(rewrite(p, m))
    return out


def ALL(h: SegmentHeader) -> SegmentHeader:  # noqa: N802 - a marker: every segment rewritten
    return dataclasses.replace(h, base_sha256=ELSEWHERE_SHA)


def prep(cfg: Any, spec: str, target: Target) -> Any:
    """``pitr.prepare`` of these unsigned chains (their signatures: test_pitr_signed_chains): whose chain
    it is, not that nobody signed it, is what these tests judge."""
    return pitr.prepare(cfg, spec, target, accept_unsigned=True)


def refused(cfg: Any, d: str, spec: str, target: Target) -> str:
    root = os.path.dirname(d)
    before = tree(root)
    with pytest.raises(RefusedError) as exc:
        prep(cfg, spec, target)
    assert tree(root) == before
    msg = exc.value.message
    assert "\n" not in msg and msg.endswith("nothing touched"), msg
    return msg


# ---------------------------------------------------------------- issue 35 (a)


def test_a_consistent_chain_naming_another_full_backup_is_passed_over_by_name(bed: Any) -> None:
    cfg, d, segs = bed
    forged = relink(segs, 0, ALL)
    assert [os.path.basename(p) for p in forged] == [os.path.basename(p) for p in segs]
    msg = refused(cfg, d, FULL, Target.to_revision(END))
    print(f"\nFIGURE every segment naming another base: {msg}")
    full_base = pitr.resolve_full(cfg, FULL, Target.newest())[0].base
    assert chains.scan(d).for_full(3, full_base) is None  # `backup list`: ORPHANED, the same judgement
    assert os.path.basename(segs[0]) in msg and "another full backup" in msg, msg


def test_one_segment_naming_another_full_backup_stops_the_chain_there(bed: Any) -> None:
    cfg, d, segs = bed
    relink(segs, 1, naming(ELSEWHERE_SHA))  # seq 1 names another base; seq 2 links to it
    msg = refused(cfg, d, FULL, Target.to_revision(END))
    print(f"\nFIGURE one segment naming another base: {msg}")
    assert os.path.basename(segs[1]) in msg and "another full backup" in msg, msg
    p = prep(cfg, FULL, Target.to_revision(7))  # before it: the good prefix
    assert p.plan.complete and [s.path for s in p.check.segments] == segs[:1]
    (listed,) = chains.scan(d).chains  # `backup list`, retention and the daemon see the same stop
    assert listed.stop is not None and listed.stop.at_revision == 8 and listed.end_revision == 7


def test_restore_knows_the_backup_by_its_signed_manifest_as_backup_list_does(tmp_path: Any, bed: Any) -> None:
    """A backup whose snapshot sha256 only its signed manifest states (no check recorded): `backup
    list` (with the key) calls a chain naming another base ORPHANED; restore must judge it alike."""
    cfg, d, segs = bed
    cfg = plain.with_key(cfg, tmp_path, KEY)
    signed = "etcd-2019-08-07-12-00-00.tar"
    os.unlink(os.path.join(d, FULL))
    full(d, signed, SNAP, FULL_MS - 3600_000, record=False, key=KEY)
    relink(segs, 0, ALL)
    sc = chains.scan(d)
    from etcd_agent.backup.catalog import list_backups

    e = next(x for x in list_backups(d, key=KEY) if x.name == signed)
    assert e.snapshot_sha256 == SNAP_SHA and sc.for_full(3, e.base) is None  # what `backup list` calls ORPHANED
    msg = refused(cfg, d, signed, Target.to_revision(END))
    assert os.path.basename(segs[0]) in msg, msg


# ---------------------------------------------------------------- issue 35 (b)


FULL2 = "etcd-2019-08-07-14-00-00.tar"
FULL2_MS = FULL_MS + 3600_000


def test_two_chains_at_one_revision_the_plan_names_the_one_it_replays_and_why(bed: Any) -> None:
    cfg, d, segs = bed
    full(d, FULL2, SNAP34, FULL2_MS)
    theirs = write_chain(d, 3, [2, 6], chain_id="6f" * 16, t0=FULL2_MS + 1000, base_sha256=SNAP34_SHA)
    p = prep(cfg, FULL, Target.to_revision(10))
    assert [s.path for s in p.check.segments] == segs
    said = " ".join(p.choice)
    print(f"\nFIGURE two chains at revision 3, --from {FULL}: {said}")
    assert "5e5e5e5e" in said and "6f6f6f6f" in said and os.path.basename(theirs[0].path) in said, said
    assert SNAP_SHA[:12] in said, said  # why: the sha256 its first segment names is this backup's
    q = prep(cfg, FULL2, Target.to_revision(10))
    assert [s.path for s in q.check.segments] == [i.path for i in theirs]
    assert "6f6f6f6f" in " ".join(q.choice) and "5e5e5e5e" in " ".join(q.choice)


def test_a_chainless_backup_beside_another_ones_chain_loses_nothing(bed: Any) -> None:
    """The daemon's chain opens with an idle segment (no write yet): its next segment starts at
    the base + 1 too. Restoring the other backup at that revision, which no chain continues, is
    complete at its own revision: the other chain's segments are passed over, not a loss."""
    cfg, d, segs = bed
    for s in segs:
        os.unlink(s)
    write_chain(d, 3, [0, 4, 3], chain_id="5e" * 16, t0=FULL_MS + 1000, base_sha256=SNAP_SHA)
    full(d, FULL2, SNAP34, FULL2_MS)
    p = prep(cfg, FULL2, Target.newest())
    assert p.plan.complete and p.check.stop is None and p.plan.stop_revision == 3, p.plan.because
    said = " ".join(p.choice)
    print(f"\nFIGURE --from a chainless backup beside another's chain: {said}")
    assert said.count("another full backup's chain") == 2, said


# ---------------------------------------------------------------- issue 38 (c)


def test_latest_takes_the_backup_whose_chain_reaches_the_target_naming_the_newer_one(bed: Any) -> None:
    """An operator's backup a second later at the same revision (no write since), with no chain: the daemon's chain
    continues FULL and holds every revision after it."""
    cfg, d, _segs = bed
    full(d, "etcd-2019-08-07-13-00-01.tar", SNAP34, FULL_MS + 1000)
    for target in (Target.newest(), Target.to_revision(END), Target.to_time(pitr.ms_to_datetime(FULL_MS + 1200))):
        p = prep(cfg, "latest", target)
        said = " ".join(p.choice)
        print(f"\nFIGURE --from latest --to {target.describe()}: {p.entry.name}: {said}")
        assert p.entry.name == FULL and p.plan.complete and p.plan.stop_revision > 3, said
        assert "etcd-2019-08-07-13-00-01.tar" in said and FULL in said, said


def test_latest_still_takes_a_newer_backup_whose_history_is_newer(bed: Any) -> None:
    """A backup taken after the chain's last segment closed (the cluster restored since: etcd 3.4
    keeps the revision) is the newest history; the older chain is not taken for it."""
    cfg, d, _segs = bed
    full(d, FULL2, SNAP34, FULL2_MS)
    p = prep(cfg, "latest", Target.newest())
    assert p.entry.name == FULL2 and p.plan.stop_revision == 3


# ---------------------------------------------------------------- issue 38 (d)


@pytest.mark.parametrize("start", [END + 1, END + 4])
def test_a_junk_file_named_like_a_segment_is_no_gap(bed: Any, start: int) -> None:
    cfg, d, segs = bed
    junk = os.path.join(d, segment_name(start, start + 3, FULL_MS + 5000))
    with open(junk, "wb") as fh:
        fh.write(b"not a segment at all\n" * 10)
    p = prep(cfg, FULL, Target.newest())
    assert p.plan.complete and p.check.stop is None and p.plan.stop_revision == END, p.plan.because
    said = " ".join(p.choice)
    print(f"\nFIGURE junk named like a segment at {start}: {said}")
    assert os.path.basename(junk) in said and "not a delta segment" in said, said
    assert list_segments(d)[-1] == junk


def test_a_backup_of_unknown_sha256_is_judged_by_its_snapshot_before_any_replay(tmp_path: Any, bed: Any) -> None:
    """No check recorded, no signed manifest: the catalogue cannot tell the backup's sha256 and
    matches the chain by time; the replay reads the snapshot's bytes and refuses a chain naming
    another one before it starts anything."""
    from etcd_agent.pitr.replayrun import replay
    from etcd_agent.scratch.member import ScratchOptions

    cfg, d, segs = bed
    unknown = "etcd-2019-08-07-12-00-00.tar"
    os.unlink(os.path.join(d, FULL))
    full(d, unknown, SNAP, FULL_MS - 3600_000, record=False)
    forged = relink(segs, 0, ALL)
    p = prep(cfg, unknown, Target.to_revision(END))
    assert "not known here" in " ".join(p.choice)  # the plan says it matched by time
    out = str(tmp_path / "out.db")
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(RefusedError) as exc:  # exit 3: nothing touched
        replay(p.entry.path, forged, p.target, output=out, options=ScratchOptions(parent_dir=str(work)), check=p.check)
    print(f"\nFIGURE unknown sha256, chain naming another: {exc.value.message}")
    assert os.path.basename(forged[0]) in exc.value.message and "another backup's chain" in exc.value.message
    assert not os.path.exists(out) and os.listdir(work) == []


def test_a_chain_stopping_at_its_first_segment_names_the_backups_time_not_a_question_mark(bed: Any) -> None:
    """Issue 38: `--to-time` said "last good point ... at ?" when nothing of the chain was good:
    the last good point is then the full backup itself, taken at a known time."""
    cfg, d, segs = bed
    raw = bytearray(open(segs[0], "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(segs[0], "wb").write(bytes(raw))
    msg = refused(cfg, d, FULL, Target.to_time(pitr.ms_to_datetime(FULL_MS + 1300)))
    assert "its last good point is revision 3 at 2019-08-07T13:00:00.000+00:00" in msg, msg


# ---------------------------------------------------------------- a full backup swapped after its check


SNAP12 = open(os.path.join(DATA, "snap-a-r12.db"), "rb").read()  # cluster "a" again, revision 12
SNAP12_SHA = hashlib.sha256(SNAP12).hexdigest()


@pytest.mark.parametrize("manifest", ["its-own", "the-old-one"])
def test_a_full_backup_swapped_for_one_of_another_revision_is_refused_by_content(
        tmp_path: Any, bed: Any, manifest: str) -> None:
    """The restore prepared FULL (revision 3, the chain's base); before the replay reads it the file
    is replaced by another backup of the cluster at revision 12 under the same name, with a
    manifest of its own (consistent) or FULL's (claiming the old bytes). The snapshot is no longer
    the one the chain's first segment names: refused in one sentence naming both sha256, before
    any etcd starts, nothing written. (Its revision is not the chain's base, and the replay once
    compared only at the base: it folded revisions 13..15 onto the other backup's data.)"""
    cfg, d, segs = bed
    cfg = dataclasses.replace(cfg, etcd=dataclasses.replace(  # what a replay runs, were it let start
        cfg.etcd, binary="/opt/etcd/3.5.16/etcd", etcdctl="/opt/etcd/3.5.16/etcdctl",
        etcdutl="/opt/etcd/3.5.16/etcdutl"))
    p = prep(cfg, FULL, Target.to_revision(END))
    assert p.start is None and p.check.base_revision == 3 and p.plan.stop_revision == END
    path = os.path.join(d, FULL)
    if manifest == "its-own":
        os.unlink(path)
        w = archive.write_archive(d, FULL, chunks=iter([SNAP12]), files={"etcd.conf": b"ETCD_NAME=m1\n"},
                                  build_manifest=plain.build, mtime=FULL_MS // 1000)
        assert w.revision == 12
    else:  # the snapshot member's bytes replaced in place, FULL's manifest left as it was
        import io
        import tarfile
        with tarfile.open(path) as t:
            members = [(m, t.extractfile(m).read()) for m in t.getmembers()]  # type: ignore[union-attr]
        with tarfile.open(path + ".new", "w", format=tarfile.USTAR_FORMAT) as t:
            for m, data in members:
                if m.name == "etcd_snapshot.db":
                    data = SNAP12
                    m.size = len(data)
                t.addfile(m, io.BytesIO(data))
        os.rename(path + ".new", path)
    root = os.path.dirname(d)
    before = tree(root)
    with pytest.raises(RefusedError) as exc:
        pitr.replay_kept(cfg, p)
    msg = exc.value.message
    print(f"\nFIGURE full backup swapped ({manifest} manifest): {msg}")
    if manifest == "its-own":  # the content decides: both digests named
        assert "\n" not in msg and msg.endswith("nothing touched"), msg
        assert SNAP_SHA[:16] in msg and SNAP12_SHA[:16] in msg, msg
    else:  # the reader refuses bytes its manifest does not describe, before the content is compared
        assert FULL in msg and "the manifest says" in msg, msg
    after = tree(root)
    work = os.path.join(d, ".pitr")  # the replays' work dir, made before the replay read anything: left empty
    assert {k: v for k, v in after.items() if k != work and k != d} == {k: v for k, v in before.items() if k != d}
    assert not os.path.exists(work) or os.listdir(work) == [], os.listdir(work)
