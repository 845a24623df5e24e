"""Plain delta segments signed with the cluster's manifest key (an HMAC in the footer), and what a
point-in-time restore does with a forged, wrongly signed or unsigned tail, or a wholly unsigned
(legacy) chain. Pure: the bed of test_pitr_hostile_chains with its chain signed, the key beside the
config as a master has it, no etcd; ``pitr.prepare`` is what a restore runs first.

Every refusal counts the bytes it wrote anywhere under the test's dir: 0 is the rule."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Iterator, List, Optional, Tuple

import pytest

from etcd_agent.backup import keys
from etcd_agent.chain.errors import ChainBroken, SegmentForged
from etcd_agent.chain.reader import read_segment, verify_segment
from etcd_agent.chain.segments import (
    PUT,
    REC_FOOTER,
    REC_HEAD,
    U64,
    Event,
    SegmentFooter,
    Txn,
    list_segments,
)
from etcd_agent.chain.writer import SegmentWriter
from etcd_agent.continuous.position import find_resume_point
from etcd_agent.errors import RefusedError
from etcd_agent.pitr import prepare as pitr
from etcd_agent.pitr.replay import Target
from tests.harness.chains import EVIL, append_tail, strip_signatures, tree

from . import test_pitr_hostile_chains as plain
from .test_chain_segments import write_chain

KEY = bytes(range(32))  # the cluster's manifest key, as the daemon's host has it
WRONG = bytes(range(1, 33))  # a key an attacker made up
END = plain.END



@pytest.fixture
def signed_bed(tmp_path: Any) -> Iterator[Tuple[Any, str, List[str]]]:
    gen = plain.bed.__wrapped__(tmp_path)  # type: ignore[attr-defined]
    cfg, d, segs = next(gen)
    for p in segs:  # the same chain again, signed as the daemon signs it
        os.unlink(p)
    cfg = plain.with_key(cfg, tmp_path, KEY)
    write_chain(d, 3, [4, 3, 5], chain_id="5e" * 16, t0=plain.FULL_MS + 1000, base_sha256=plain.SNAP_SHA,
                sign_key=KEY)
    yield cfg, d, list_segments(d)


def edit_footer(path: str, change: Any) -> None:
    """The footer rewritten (its signature kept) and the file's digest made right again."""
    raw = open(path, "rb").read()
    body_end = len(raw) - 32
    (footer_at,) = U64.unpack_from(raw, body_end - 8)
    doc = json.loads(raw[footer_at + REC_HEAD.size : body_end - 8])
    change(doc)
    fbody = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    new = raw[:footer_at] + REC_HEAD.pack(REC_FOOTER, len(fbody)) + fbody + U64.pack(footer_at)
    open(path, "wb").write(new + hashlib.sha256(new).digest())


def refused(cfg: Any, d: str, target: Target, **kw: Any) -> str:
    root = os.path.dirname(d)
    before = tree(root)
    with pytest.raises(RefusedError) as exc:
        pitr.prepare(cfg, "latest", target, **kw)
    after = tree(root)
    msg = exc.value.message
    assert "\n" not in msg and msg.endswith("nothing touched"), msg
    assert after == before, sorted(set(after) ^ set(before))
    return msg


def test_the_daemon_signs_plain_footers_and_the_reader_checks_them(signed_bed: Any) -> None:
    _cfg, _d, segs = signed_bed
    for p in segs:
        assert verify_segment(p, key=KEY).signature == "valid"
        assert verify_segment(p, key=WRONG).signature == "unknown-key"  # another key: cannot tell
        assert verify_segment(p).signature == "unknown-key"  # no key here: cannot tell
    # an older reader sees the footer it knows: the signature is one more key, which it ignores
    info = read_segment(segs[0]).info
    d = info.footer.to_json()
    assert set(d) - {"signature"} == set(dataclasses.replace(info.footer, signature=None).to_json())
    assert SegmentFooter.from_json(dict(d, some_future_field=1), info.path) == info.footer


def test_a_footer_edited_under_its_signature_is_forged(signed_bed: Any) -> None:
    _cfg, _d, segs = signed_bed
    edit_footer(segs[1], lambda f: f.update(end_time_ms=f["end_time_ms"] + 1))
    with pytest.raises(SegmentForged) as exc:
        verify_segment(segs[1], key=KEY)
    assert "signature" in exc.value.problem
    assert verify_segment(segs[1]).signature == "unknown-key"  # without the key it cannot be told


def test_the_signed_chain_is_accepted_and_the_plan_says_so(signed_bed: Any) -> None:
    cfg, _d, _segs = signed_bed
    p = pitr.prepare(cfg, "latest", Target.newest())
    assert p.plan.complete and p.plan.stop_revision == END
    assert [s.signature for s in p.check.segments] == ["valid"] * 3
    assert "signed with this cluster's manifest key" in p.signatures, p.signatures


@pytest.mark.parametrize("key", [None, WRONG], ids=["unsigned", "wrong-key"])
def test_a_forged_tail_is_refused_naming_its_file(signed_bed: Any, key: Optional[bytes]) -> None:
    cfg, d, _segs = signed_bed
    forged = append_tail(d, key)
    for target in (Target.newest(), Target.to_revision(END + 1)):
        msg = refused(cfg, d, target)
        print(f"\nFIGURE forged tail ({'unsigned' if key is None else 'wrong key'}, {target.describe()}): {msg}")
        assert os.path.basename(forged) in msg and "forged" in msg, msg
    # up to the last signed point is still a restore
    p = pitr.prepare(cfg, "latest", Target.to_revision(END))
    assert p.plan.complete and p.plan.stop_revision == END


def test_an_edited_footer_is_refused_naming_its_file(signed_bed: Any) -> None:
    cfg, d, segs = signed_bed
    edit_footer(segs[2], lambda f: f.update(end_time_ms=f["end_time_ms"] + 1))
    msg = refused(cfg, d, Target.newest())
    assert os.path.basename(segs[2]) in msg and "signature" in msg, msg


def test_an_unsigned_legacy_chain_is_refused_unless_accepted(signed_bed: Any) -> None:
    cfg, d, _segs = signed_bed
    strip_signatures(d)
    msg = refused(cfg, d, Target.newest())
    print(f"\nFIGURE unsigned chain: {msg}")
    assert "not signed" in msg and "--accept-unsigned-chain" in msg, msg
    p = pitr.prepare(cfg, "latest", Target.newest(), accept_unsigned=True)
    assert p.plan.complete and p.plan.stop_revision == END
    assert "not signed" in p.signatures and "--accept-unsigned-chain" in p.signatures, p.signatures


def test_without_the_key_on_this_host_the_plan_says_the_signatures_were_not_checked(signed_bed: Any) -> None:
    cfg, _d, _segs = signed_bed
    os.unlink(keys.key_path(cfg))
    p = pitr.prepare(cfg, "latest", Target.newest())
    assert p.plan.complete and p.plan.stop_revision == END
    assert "could not be checked" in p.signatures, p.signatures


def test_the_daemon_never_resumes_after_a_segment_its_signature_would_vouch_for(signed_bed: Any) -> None:
    """The next segment names the one before by sha256: signing it would vouch for a forged tail."""
    _cfg, d, segs = signed_bed
    assert find_resume_point(d, 3, key=KEY).next_revision == END + 1  # type: ignore[union-attr]
    forged = append_tail(d, None)
    with pytest.raises(ChainBroken) as exc:
        find_resume_point(d, 3, key=KEY)
    assert os.path.basename(forged) in exc.value.reason and "not signed" in exc.value.reason, exc.value.reason
    with pytest.raises(ChainBroken):  # a daemon without the key would write an unsigned tail after signed ones
        find_resume_point(d, 3)
    os.unlink(forged)
    strip_signatures(d)  # a legacy chain: the upgraded daemon starts a signed one instead of signing over it
    with pytest.raises(ChainBroken):
        find_resume_point(d, 3, key=KEY)
    assert find_resume_point(d, 3).next_revision == END + 1  # type: ignore[union-attr]


def test_a_forged_twin_of_a_signed_segment_loses_to_it(signed_bed: Any) -> None:
    """A forged alternative to the chain's first segment (same range, a name that sorts first,
    unsigned): the signed one is followed, the whole chain restored, the twin never applied."""
    cfg, d, segs = signed_bed
    seg = read_segment(segs[0])
    w = SegmentWriter(d, seg.info.header)
    for t in seg.txns[:-1]:
        w.add_txn(t)
    last = seg.txns[-1]
    w.add_txn(Txn(last.revision, last.time_ms, (Event(PUT, EVIL.encode(), b"cluster-admin", last.revision,
                                                      last.revision, 1, 0),)))
    twin = w.close(seg.info.footer.end_time_ms - 1, confirmed=True).path  # an earlier time: sorts first
    assert sorted([twin, segs[0]])[0] == twin
    p = pitr.prepare(cfg, "latest", Target.newest())
    assert p.plan.complete and p.plan.stop_revision == END
    assert [s.path for s in p.check.segments] == segs
