"""A partial chain (issue 33 item 8): the segments of a full backup's chain from one on, the
earlier ones left in the bucket because a replay from a checkpoint never reads them. ``check_chain``
accepts such a run only from a segment whose signature checks with the manifest key and that names
the full backup's snapshot sha256; without the key, unsigned, another base, or a forged first
segment: the run is not this backup's chain. Pure: segment files on disk, no etcd."""
from __future__ import annotations

import os
from typing import Any, List

import pytest

from etcd_agent.chain.check import BaseBackup, check_chain
from etcd_agent.chain.segments import list_segments

from .test_chain_segments import write_chain
from .test_pitr_signed_chains import KEY, WRONG, edit_footer

SHA = "ab" * 32
BASE = BaseBackup(SHA)


def _partial(tmp_path: Any, sign_key: Any = KEY, base_sha256: str = SHA) -> List[str]:
    """A chain 101..120 in four segments of five revisions, the first two gone: 111..120 here."""
    d = str(tmp_path)
    infos = write_chain(d, 100, [5, 5, 5, 5], base_sha256=base_sha256, sign_key=sign_key)
    for i in infos[:2]:
        os.unlink(i.path)
    return list_segments(d)


def test_a_run_from_a_signed_segment_naming_the_base_is_followed_with_the_key(tmp_path: Any) -> None:
    paths = _partial(tmp_path)
    c = check_chain(paths, 100, base=BASE, key=KEY, begins_at=111)
    assert c.stop is None, c.stop
    assert [s.start_revision for s in c.segments] == [111, 116] and c.end_revision == 120
    assert c.begins_at == 111
    assert [s.signature for s in c.segments] == ["valid", "valid"]
    # without ``begins_at`` it is what it is: a chain missing its first segments
    whole = check_chain(paths, 100, base=BASE, key=KEY)
    assert whole.stop is not None and whole.stop.kind == "gap" and not whole.segments


@pytest.mark.parametrize("case", ["no key", "wrong key", "unsigned", "another base", "no base sha"])
def test_a_run_whose_first_segment_proves_nothing_is_not_followed(tmp_path: Any, case: str) -> None:
    paths = _partial(tmp_path, sign_key=None if case == "unsigned" else KEY,
                     base_sha256="cd" * 32 if case == "another base" else SHA)
    key = {"no key": None, "wrong key": WRONG}.get(case, KEY)
    base = BaseBackup("") if case == "no base sha" else BASE
    c = check_chain(paths, 100, base=base, key=key, begins_at=111)
    assert not c.segments, (case, c.segments)
    if case == "another base":  # another full backup's chain, by the base its header names
        assert c.stop is None and [why for _p, why in c.passed] == [
            f"segment 2 of chain {'ab' * 4}, which names the full backup with snapshot sha256 {'cd' * 6}... "
            "(revision 100): another full backup's chain"], c.passed
        return
    assert c.stop is not None and c.stop.at_revision == 111, (case, c.stop)
    assert "earlier segments" in c.stop.reason, c.stop.reason


def test_a_forged_first_segment_of_the_run_stops_it_as_forged(tmp_path: Any) -> None:
    paths = _partial(tmp_path)
    edit_footer(paths[0], lambda f: f.update(end_time_ms=f["end_time_ms"] + 1))
    c = check_chain(paths, 100, base=BASE, key=KEY, begins_at=111)
    assert not c.segments and c.stop is not None and c.stop.kind == "forged", c.stop


def test_the_outline_of_a_run_reads_headers_and_footers_only(tmp_path: Any) -> None:
    """Where a replay may start is chosen from the outline (no bytes verified, so no signature):
    it follows the run by the base its header names; the verified check decides."""
    paths = _partial(tmp_path)
    c = check_chain(paths, 100, verify=False, base=BASE, begins_at=111)
    assert c.stop is None and [s.start_revision for s in c.segments] == [111, 116]
    other = check_chain(paths, 100, verify=False, base=BaseBackup("cd" * 32), begins_at=111)
    assert not other.segments


def test_a_replay_from_a_checkpoint_inside_a_partial_chain_finds_the_chain_s_base(tmp_path: Any) -> None:
    """The replay looks for the chain of the snapshot it starts from (a checkpoint at 112): with
    no first segment here, by the base the others name - not a chain "based at 112" that folds
    nothing and stops short of the target."""
    from etcd_agent.pitr.replay import find_base

    paths = _partial(tmp_path)
    assert find_base(paths, 112) == 100


def test_a_segment_s_footer_is_read_from_its_last_bytes_alone(tmp_path: Any) -> None:
    """What a restore from the bucket reads of a segment it may not fetch: one ranged read of its
    last ``TAIL_BYTES`` (all of a smaller file) holds its whole footer; bytes that are not a
    segment's tail are refused, never taken for a footer."""
    from etcd_agent.chain.errors import SegmentCorrupt
    from etcd_agent.chain.reader import TAIL_BYTES, footer_from_tail, read_summary

    for p in _partial(tmp_path):
        raw = open(p, "rb").read()
        tail = raw[-TAIL_BYTES:]
        assert footer_from_tail(p, tail, len(raw)) == read_summary(p)[1]
        with pytest.raises(SegmentCorrupt):
            footer_from_tail(p, tail[:-1] + b"\0", len(raw) + 1)  # not where the trailer says
    with pytest.raises(SegmentCorrupt):
        footer_from_tail("x", b"\0" * 100, 100)


def test_the_prune_plan_keeps_a_partial_chain_with_its_own_full_backup_only(tmp_path: Any) -> None:
    """A partial chain has no first segment to match a full backup by: it goes with the backup
    whose snapshot sha256 its earliest segment names, never with another one at its revision (an
    etcd 3.4 restore keeps the revision), and is orphaned when that backup is gone."""
    from etcd_agent.chain import chains

    _partial(tmp_path)
    scan = chains.scan(str(tmp_path))
    [part] = scan.chains
    assert part.begins_at == 111 and part.named_base == SHA and part.first is None, part
    mine, other = BaseBackup(SHA), BaseBackup("cd" * 32)

    def keep(*fulls: chains.FullRef) -> bool:
        [d] = chains.plan_prune(scan, fulls)
        return d.keep

    assert keep(chains.FullRef("mine.tar", 100, True, base=mine))
    assert not keep(chains.FullRef("mine.tar", 100, False, reason="pruned", base=mine))
    assert not keep(chains.FullRef("mine.tar", 100, False, reason="pruned", base=mine),
                    chains.FullRef("other.tar", 100, True, base=other))
    assert keep(chains.FullRef("other.tar", 100, False, reason="pruned", base=other),
                chains.FullRef("mine.tar", 100, True, base=mine))
    [d] = chains.plan_prune(scan, [chains.FullRef("other.tar", 100, True, base=other)])
    assert not d.keep and d.reason.startswith("orphaned"), d
