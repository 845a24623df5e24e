"""A backup dir after a point-in-time restore from the bucket, before the manifest key is back on
this host: the full backup F, the checkpoint C the restore started from, and the partial chain
of F (its segments from C's lease census on; the earlier ones are in the bucket only). F's and
C's manifests are signed with the cluster's key, which this host does not have, so C reads as an
operator's full backup; only its chain says what it is (``catalog.chain_checkpoints``).

Real archives of tests/data's etcd snapshots, real segments written and signed by the segment
writer; no etcd (retention and a restore's choices are made before any etcd is asked)."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import pytest

from etcd_agent.backup import archive, keys
from etcd_agent.backup.checks import SYSTEM_WALL_CLOCK
from etcd_agent.backup.manifest import FileEntry, Manifest
from etcd_agent.backup.service import _record_check, prune_backups
from etcd_agent.chain import chains
from etcd_agent.chain.segments import Checkpoint, LeaseRecord, SegmentHeader, Txn
from etcd_agent.chain.writer import SegmentWriter
from etcd_agent.config import parse_text
from etcd_agent.errors import RefusedError
from etcd_agent.pitr import prepare as pitr
from etcd_agent.pitr.replay import Target
from tests.harness.chains import tree

from .test_chain_segments import put
from .test_pitr_hostile_chains import DATA

KEY = bytes(range(32))  # the cluster's manifest key: the daemon signed with it; this host lacks it
CHAIN = "c4" * 16
T0 = datetime(2019, 8, 7, 13, 0, 0, tzinfo=timezone.utc)


def _snap(name: str) -> bytes:
    with open(os.path.join(DATA, name), "rb") as fh:
        return fh.read()


SNAP_F = _snap("snap-a.db")  # cluster "a", revision 3 (each of them)
SNAP_C = _snap("snap-a-r12.db")  # cluster "a" at revision 12: the checkpoint
SNAP_OP = _snap("snap-a-34.db")
SNAP_R = _snap("snap-a-reboot.db")


def _ms(t: datetime) -> int:
    return int(t.timestamp() * 1000)


def _name(t: datetime) -> str:
    return archive.archive_name(t)


class Bed(NamedTuple):
    cfg: Any
    dir: str
    full: str  # F
    checkpoint: str  # C
    operators: List[str]  # the operator's own backups, oldest first
    segments: List[str]  # the partial chain here
    gone: List[str]  # its segments left in the bucket


def _archive(d: str, when: datetime, snap: bytes, *, snapshot: Dict[str, Any], key: Any, record: bool) -> str:
    def build(infos: Dict[str, archive.FileInfo], facts: Any, ident: Any) -> Manifest:
        return Manifest(files={n: FileEntry(i.size, i.sha256) for n, i in infos.items()}, revision=ident.revision,
                        missing={"etcd.service": "not found"}, verified=True, snapshot=snapshot)

    w = archive.write_archive(d, _name(when), chunks=iter([snap]), files={"etcd.conf": b"ETCD_NAME=m1\n"},
                              build_manifest=build, mtime=int(when.timestamp()), key=key)
    if record:  # its content checked here (a fetch's `remember`, a `backup verify`): its sha256 known
        _record_check(d, w.path, "fetch", SYSTEM_WALL_CLOCK, revision=w.revision,
                      sha256=hashlib.sha256(snap).hexdigest())
    return os.path.basename(w.path)


def _segment(d: str, seq: int, first: int, last: int, at: datetime, prev: str,
             checkpoints: Sequence[Checkpoint] = (), chain: str = CHAIN, base: bytes = SNAP_F,
             end: Optional[datetime] = None) -> Any:
    """Revisions ``first..last`` one a second from ``at``, closed at ``end`` (default: a second
    after the last), signed with the cluster's key."""
    h = SegmentHeader(chain, seq, 3, first, prev, _ms(at), base_sha256=hashlib.sha256(base).hexdigest())
    w = SegmentWriter(d, h, sign_key=KEY)
    t = _ms(at)
    for rev in range(first, last + 1):
        t += 1000
        w.add_txn(Txn(rev, t, (put(rev, b"k%d" % rev, b"v%d" % rev),)))
    w.add_lease(LeaseRecord(0x10, 60, 50, t))
    return w.close(_ms(end) if end else t + 1000, confirmed=True, checkpoints=list(checkpoints))


def make_bed(tmp_path: Any, *, checkpoint_known: bool = True, keep_last: int = 3) -> Bed:
    """F at 13:00 (revision 3); its chain: 4..7 from 13:05 (in the bucket only), 8..12 from 13:19:50
    (C vouched for at revision 12, its lease census at 8), 13..15 from 13:40; C taken at 13:20;
    the operator's backups at 13:10 and 14:00. ``checkpoint_known``: C's snapshot sha256 is
    recorded here (a verify), else only its chain names it."""
    d = str(tmp_path / "backups")
    os.makedirs(d, mode=0o700)
    members = "".join(f'[[member]]\nname = "m{i}"\nhost = "127.0.0.1"\npeer_url = "http://127.0.0.1:{p}"\n'
                      f'client_url = "http://127.0.0.1:{p - 1}"\n' for i, p in ((1, 17380), (2, 17382), (3, 17384)))
    cfg, errors = parse_text(f'[cluster]\nname = "a"\n[backup]\ndir = "{d}"\nkeep_last = {keep_last}\n'
                             f'keep_hourly = 0\nkeep_daily = 0\n[daemon]\nstate_dir = "{tmp_path}/state"\n' + members)
    assert cfg is not None, errors
    etc = tmp_path / "etc"
    os.makedirs(etc, mode=0o700)
    cfg = dataclasses.replace(cfg, path=str(etc / "agent.toml"))  # no manifest key beside it
    daemon = {"taken_by": "daemon"}
    full = _archive(d, T0, SNAP_F, snapshot=daemon, key=KEY, record=True)
    cp = _archive(d, T0 + timedelta(minutes=20), SNAP_C, snapshot={**daemon, "checkpoint": {"chain_id": CHAIN}},
                  key=KEY, record=checkpoint_known)
    ops = [_archive(d, T0 + timedelta(minutes=m), SNAP_OP, snapshot={"taken_by": "operator"}, key=None, record=True)
           for m in (10, 60)]
    vouch = Checkpoint(cp, hashlib.sha256(SNAP_C).hexdigest(), 12, 8)
    s0 = _segment(d, 0, 4, 7, T0 + timedelta(minutes=5), "")
    s1 = _segment(d, 1, 8, 12, T0 + timedelta(minutes=19, seconds=50), s0.sha256, [vouch])
    s2 = _segment(d, 2, 13, 15, T0 + timedelta(minutes=40), s1.sha256)
    os.unlink(s0.path)  # fetched after C: the segments before its lease census stay in the bucket
    return Bed(cfg, d, full, cp, ops, [s1.path, s2.path], [s0.path])


@pytest.fixture
def bed(tmp_path: Any) -> Iterator[Bed]:
    yield make_bed(tmp_path)


# ---------------------------------------------------------------- retention


@pytest.mark.parametrize("known", ["checkpoint-sha-known", "checkpoint-sha-unknown", "another-snapshot-there"])
def test_prune_gives_a_fetched_checkpoint_no_slot_of_the_operators(tmp_path: Any, known: str) -> None:
    """keep_last = 3 and three real full backups (F and the operator's two): prune deletes none of
    them, and keeps C with its chain. Counted as an operator's backup, C took a slot, pushed F out
    and F's chain with it (C then kept, a checkpoint with no chain to start a replay in). A file
    under C's name whose snapshot is not known to be C's, or is known to be another, is kept too,
    in no slot, saying so."""
    b = make_bed(tmp_path, checkpoint_known=known != "checkpoint-sha-unknown")
    if known == "another-snapshot-there":
        _record_check(b.dir, os.path.join(b.dir, b.checkpoint), "verify", SYSTEM_WALL_CLOCK, revision=12,
                      sha256="d" * 64)
    (part,) = chains.scan(b.dir).chains
    assert part.begins_at == 8 and [c.name for c in part.checkpoints] == [b.checkpoint], part
    before = set(os.listdir(b.dir))
    decisions = prune_backups(b.cfg, dry_run=False)
    why = {d.name: (d.keep, d.reason) for d in decisions}
    print("\nFIGURE prune with a fetched checkpoint, no manifest key:\n  "
          + "\n  ".join(f"{n}: {'keep' if k else 'DELETE'} ({r})" for n, (k, r) in why.items()))
    assert set(os.listdir(b.dir)) == before, sorted(before - set(os.listdir(b.dir)))
    for name in [b.full] + b.operators:
        assert why[name][0] and "one of the last 3" in why[name][1], (name, why[name])
    assert why[b.checkpoint][0] and "checkpoint" in why[b.checkpoint][1], why[b.checkpoint]
    assert "one of the last" not in why[b.checkpoint][1], why[b.checkpoint]
    if known == "another-snapshot-there":
        assert "another one (sha256 dddddddddddddddd...)" in why[b.checkpoint][1], why[b.checkpoint]
    (chain,) = [d for d in decisions if d.name.startswith("delta chain")]
    assert chain.keep and b.full in chain.reason, chain


def test_the_operators_backups_still_push_out_their_own_oldest(tmp_path: Any) -> None:
    """The slots are the operator's again once C is counted apart: with keep_last = 2 the oldest
    real full backup is the one to go (with its chain, and C whose chain goes)."""
    b = make_bed(tmp_path, keep_last=2)
    decisions = {d.name: d for d in prune_backups(b.cfg, dry_run=True)}
    assert not decisions[b.full].keep, decisions[b.full]
    assert all(decisions[n].keep for n in b.operators), decisions
    assert not decisions[b.checkpoint].keep and "pruned or gone" in decisions[b.checkpoint].reason, \
        decisions[b.checkpoint]
    assert set(os.listdir(b.dir)) >= {b.full, b.checkpoint, *b.operators}  # a dry run: nothing removed


# ---------------------------------------------------------------- a restore's refusal


def _hinted(hints: List[str]) -> List[Tuple[str, Optional[int]]]:
    """The restores the hints name: (--from, --to-revision or None: the same target)."""
    out = []
    for h in hints:
        m = re.search(r"--from (\S+)(?: --to-revision (\d+))?", h)
        assert m is not None, h
        out.append((m.group(1), int(m.group(2)) if m.group(2) else None))
    return out


def test_a_refusal_offers_only_restores_it_would_accept(bed: Bed) -> None:
    """Refused for want of the manifest key, a restore names what to run instead. C (revision 12,
    after where the chain here stops without the key) is a checkpoint: offered as a backup "to
    start from", the restore named is refused again (``--from C``: no chain of its own here to
    follow), or would restore a checkpoint as if it were an operator's backup."""
    b, cfg = bed, bed.cfg
    target = Target.to_revision(14)
    before = tree(b.dir)
    with pytest.raises(RefusedError) as exc:
        pitr.prepare(cfg, b.full, target)
    assert tree(b.dir) == before
    hints = exc.value.details
    print(f"\nFIGURE no key: {exc.value.message}\n  hints: " + "\n  ".join(hints))
    assert hints, exc.value
    assert not any(b.checkpoint in h for h in hints), hints
    for name, rev in _hinted(hints):
        p = pitr.prepare(cfg, name, Target.to_revision(rev) if rev is not None else target)
        assert p.entry.name == name and p.plan.complete, (name, rev, p.plan)


def test_a_refusal_offers_a_newer_full_backup_only_when_its_chain_reaches_the_target(bed: Bed) -> None:
    """A newer full backup G (revision 12) with a whole chain of its own, 13..14: offered for
    revision 14, which its chain reaches, not for revision 16, which it does not."""
    g_time = T0 + timedelta(minutes=50)
    g = _archive(bed.dir, g_time, SNAP_C, snapshot={"taken_by": "daemon"}, key=KEY, record=True)
    h = SegmentHeader("9a" * 16, 0, 12, 13, "", _ms(g_time), base_sha256=hashlib.sha256(SNAP_C).hexdigest())
    w = SegmentWriter(bed.dir, h, sign_key=KEY)
    for rev in (13, 14):
        w.add_txn(Txn(rev, _ms(g_time) + rev * 1000, (put(rev, b"g%d" % rev, b"v"),)))
    w.close(_ms(g_time) + 20_000, confirmed=True)
    for rev, offered in ((14, True), (16, False)):
        with pytest.raises(RefusedError) as exc:
            pitr.prepare(bed.cfg, bed.full, Target.to_revision(rev))
        hints = exc.value.details
        assert any(f"--from {g}" in x for x in hints) == offered, (rev, hints)
        for name, to in _hinted(hints):
            p = pitr.prepare(bed.cfg, name, Target.to_revision(to if to is not None else rev))
            assert p.entry.name == name and p.plan.complete, (name, to, p.plan)


# ---------------------------------------------------------------- time targets and the partial chain


def _with_key(cfg: Any) -> None:
    with open(keys.key_path(cfg), "w") as fh:
        fh.write(KEY.hex() + "\n")
    os.chmod(keys.key_path(cfg), 0o600)


def _older_whole_chain(b: Bed) -> str:
    """F0 at 12:00 (another snapshot, revision 3) and its whole chain: 4..6 from 12:00:10, 7..8
    from 13:06 (closed 13:08): it covers 13:07, which F's partial chain here does not."""
    f0_time = T0 - timedelta(hours=1)
    f0 = _archive(b.dir, f0_time, SNAP_R, snapshot={"taken_by": "daemon"}, key=KEY, record=True)
    a = _segment(b.dir, 0, 4, 6, f0_time + timedelta(seconds=10), "", chain="f0" * 16, base=SNAP_R)
    _segment(b.dir, 1, 7, 8, T0 + timedelta(minutes=6), a.sha256, chain="f0" * 16, base=SNAP_R,
             end=T0 + timedelta(minutes=8))
    return f0


def test_latest_for_a_time_before_the_partial_chain_takes_a_backup_that_reaches_it(bed: Bed) -> None:
    """13:07 is after F (13:00) but before anything F's partial chain here can replay to (a replay
    starts from C, served by the segment closed at 13:19:56): `latest` must take F0, whose whole
    chain covers 13:07, never F, as it does for a revision before the partial chain's floor."""
    _with_key(bed.cfg)
    f0 = _older_whole_chain(bed)
    at = Target.to_time(T0 + timedelta(minutes=7))
    p = pitr.prepare(bed.cfg, "latest", at)
    print("\nFIGURE --from latest --to-time 13:07:\n  " + "\n  ".join(p.choice))
    assert p.entry.name == f0 and p.plan.complete and p.plan.stop_revision == 8, (p.entry.name, p.plan)
    assert any(f"passed over {bed.full}" in ln and "does not reach" in ln for ln in p.choice), p.choice
    by_rev = pitr.prepare(bed.cfg, "latest", Target.to_revision(7))  # the revision rule, as it was
    assert by_rev.entry.name == f0, by_rev.entry.name


def test_a_time_before_the_partial_chain_with_no_backup_reaching_it_is_refused_saying_what_is_here(bed: Bed) -> None:
    _with_key(bed.cfg)
    before = tree(bed.dir)
    with pytest.raises(RefusedError) as exc:
        pitr.prepare(bed.cfg, "latest", Target.to_time(T0 + timedelta(minutes=7)))
    assert tree(bed.dir) == before
    msg = exc.value.message
    print(f"\nFIGURE --from latest --to-time 13:07, nothing reaches it: {msg}")
    assert "\n" not in msg and msg.endswith("nothing touched"), msg
    assert "2019-08-07T13:19:56" in msg and bed.checkpoint in msg, msg  # from when what is here reaches
    # after the floor it is reached from C
    p = pitr.prepare(bed.cfg, "latest", Target.to_time(T0 + timedelta(minutes=30)))
    assert p.entry.name == bed.full and p.start is not None and p.start.name == bed.checkpoint, p
    assert p.plan.complete and p.plan.stop_revision == 12, p.plan
