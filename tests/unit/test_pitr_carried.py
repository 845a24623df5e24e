"""``pitr.carried``: a chain check made on one dir's files, carried to the hard links of the same
files in another (a restore from the bucket: checked in the staging dir, restored from the backup
dir), taken only while every file is still the very inode checked (pure: the real full backup and
chain of ``test_pitr_hostile_chains``' bed, the real ``prepare``; no etcd)."""
from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, List, Tuple

from etcd_agent.pitr import carried
from etcd_agent.pitr import prepare as pitr
from etcd_agent.pitr.replay import Target

from .test_pitr_hostile_chains import END, FULL, bed  # noqa: F401 - the fixture

TO = Target.to_revision(END)


def _checked(cfg: Any, d: str) -> carried.CheckedChain:
    before = {os.path.join(d, n): carried.inode(os.path.join(d, n)) for n in os.listdir(d)}
    prep = pitr.prepare(cfg, FULL, TO, accept_unsigned=True)
    c = carried.carry(prep, before, checkpoints=True, accept_unsigned=True)
    assert c is not None
    return c


def _linked(cfg: Any, d: str, tmp_path: Any) -> Tuple[Any, str]:
    """Every file of ``d`` hard-linked into a new backup dir, and a config pointing there."""
    there = str(tmp_path / "linked")
    os.mkdir(there, 0o700)
    for n in os.listdir(d):
        if os.path.isfile(os.path.join(d, n)):
            os.link(os.path.join(d, n), os.path.join(there, n))
    return dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, dir=there)), there


def _take(c: carried.CheckedChain, cfg: Any, said: List[str], *, target: Target = TO,
          checkpoints: bool = True) -> Any:
    return carried.take(c, cfg, FULL, target, checkpoints=checkpoints, accept_unsigned=True, progress=said.append)


def test_the_check_is_carried_to_the_same_files_linked_elsewhere(bed, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    cfg, d, segs = bed
    c = _checked(cfg, d)
    cfg2, there = _linked(cfg, d, tmp_path)
    moved = carried.rerooted(c, d, there)
    said: List[str] = []
    taken = _take(moved, cfg2, said)
    assert taken is not None and taken.private is None and taken.lock is None
    p = taken.prepared
    assert p.entry.path == os.path.join(there, FULL)
    assert [s.path for s in p.plan.segments] == [os.path.join(there, os.path.basename(s)) for s in segs]
    assert all(os.path.dirname(x) == there for x in carried.read_by(p))
    assert p.plan.stop_revision == END and "checked once" in said[0], said
    # not another question: another target, spec, option, or dir
    assert _take(moved, cfg2, said, target=Target.to_revision(END - 1)) is None
    assert _take(moved, cfg2, said, checkpoints=False) is None
    assert _take(moved, cfg, said) is None  # the check's files are not in cfg's dir


def test_a_file_replaced_after_the_check_is_not_taken(bed, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    cfg, d, segs = bed
    cfg2, there = _linked(cfg, d, tmp_path)
    moved = carried.rerooted(_checked(cfg, d), d, there)
    seg = os.path.join(there, os.path.basename(segs[1]))
    shutil.copyfile(seg, seg + ".copy")  # the same bytes, another inode
    os.replace(seg + ".copy", seg)
    said: List[str] = []
    assert _take(moved, cfg2, said) is None
    assert said and os.path.basename(seg) in said[0] and "not the file that was checked" in said[0], said
    os.unlink(os.path.join(there, FULL))  # gone: neither
    said.clear()
    assert _take(moved, cfg2, said) is None and FULL in said[0], said


def test_a_file_the_check_did_not_see_first_is_not_carried(bed) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    cfg, d, segs = bed
    prep = pitr.prepare(cfg, FULL, TO, accept_unsigned=True)
    before = {os.path.join(d, n): carried.inode(os.path.join(d, n)) for n in os.listdir(d)}
    assert carried.carry(prep, {k: v for k, v in before.items() if k != segs[0]}, checkpoints=True,
                         accept_unsigned=True) is None
    before[segs[0]] = (0, 0)  # another file under its name when the check began
    assert carried.carry(prep, before, checkpoints=True, accept_unsigned=True) is None


def test_a_check_not_taken_lets_its_decrypted_copies_and_lock_go(bed, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    from etcd_agent.pitr import workdirs

    cfg, d, _segs = bed
    before = {os.path.join(d, n): carried.inode(os.path.join(d, n)) for n in os.listdir(d)}
    prep = pitr.prepare(cfg, FULL, TO, accept_unsigned=True)
    held = workdirs.lock(cfg)
    private = workdirs.open_staging(cfg)  # where an encrypted chain's check leaves its copies
    c = carried.carry(prep, before, checkpoints=True, accept_unsigned=True, private=private, lock=held)
    assert c is not None and not workdirs.lock_free(cfg)
    said: List[str] = []
    taken = _take(c, cfg, said)
    assert taken is c and os.path.isdir(private) and not workdirs.lock_free(cfg)  # handed on, still kept
    assert _take(c, cfg, said, target=Target.newest()) is None  # another question: let go
    assert not os.path.exists(private) and workdirs.lock_free(cfg)
