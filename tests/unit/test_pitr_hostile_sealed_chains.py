"""Hostile encrypted delta chains (``.seg.age``) handed to a point-in-time restore: each refused
in one sentence, nothing written beyond the replay's dirs (``<backup dir>/.pitr``: its lock, and
the private staging dir of decrypted segments, which is gone after the refusal). Pure: the bed
of test_pitr_hostile_chains with its chain encrypted, no etcd; ``open_pitr_source`` is what
`restore --to-*` runs first, here with the replay it never reaches cut off.

Every case counts the bytes the refusal left anywhere under the test's dir outside ``.pitr``:
0 is the rule; and ``.pitr`` holds no decrypted byte after it."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Any, Iterator, List, Tuple

import pytest

from etcd_agent import age
from etcd_agent.backup import keys
from etcd_agent.chain.seal import SEAL_BLOCK, SEAL_MAGIC, Seal, read_seal, seal_block
from etcd_agent.chain.segments import U32, list_segments
from etcd_agent.errors import IdentityRefused, RefusedError
from etcd_agent.pitr import prepare as pitr
from etcd_agent.pitr import workdirs
from etcd_agent.pitr.replay import Target
from etcd_agent.restore.orchestrator.source import open_pitr_source
from tests.harness.chains import tree

from . import test_pitr_hostile_chains as plain
from .test_chain_segments import write_chain

KEY = bytes(range(32))  # the cluster's manifest key, as the daemon's host has it
END = plain.END


@pytest.fixture
def sealed_bed(tmp_path: Any) -> Iterator[Tuple[Any, str, List[str], Any, str]]:
    gen = plain.bed.__wrapped__(tmp_path)  # type: ignore[attr-defined]
    cfg, d, segs = next(gen)
    for p in segs:  # the same chain again, encrypted and signed (more revisions: several age chunks)
        os.unlink(p)
    secret, public = age.generate_identity()
    id_path = str(tmp_path / "id.txt")
    with open(id_path, "w") as fh:
        fh.write(secret + "\n")
    os.chmod(id_path, 0o600)
    conf = str(tmp_path / "etc" / "agent.toml")
    os.makedirs(os.path.dirname(conf), mode=0o700)
    with open(keys.key_path(dataclasses.replace(cfg, path=conf)), "w") as fh:
        fh.write(KEY.hex() + "\n")
    cfg = dataclasses.replace(cfg, path=conf)
    write_chain(d, 3, [4, 3, 5], chain_id="5e" * 16, t0=plain.FULL_MS + 1000, base_sha256=plain.SNAP_SHA,
                recipients=[age.parse_recipient(public)], sign_key=KEY, value_size=30000)
    yield cfg, d, list_segments(d), age.load_identities(id_path), id_path


def run(cfg: Any, identities: Any) -> Any:
    """What `restore --from latest --to-revision END` does before its replay, with the replay cut off."""
    def no_replay(*a: Any, **k: Any) -> Any:
        raise AssertionError("the chain was accepted")
    real = pitr.replay_kept
    pitr.replay_kept = no_replay  # type: ignore[assignment]
    try:
        return open_pitr_source(cfg, "latest", Target.to_revision(END), os.path.join(cfg.backup.dir, ".stage"), identities=identities)
    finally:
        pitr.replay_kept = real  # type: ignore[assignment]


def rewrite_seal(path: str, change: Any) -> None:
    seal = read_seal(path)
    raw = open(path, "rb").read()
    new = change(seal)
    open(path, "wb").write(seal_block(new) + raw[SEAL_BLOCK:])


def bit_flip(cfg: Any, segs: List[str], ids: Any) -> None:
    raw = bytearray(open(segs[1], "rb").read())
    raw[SEAL_BLOCK + (len(raw) - SEAL_BLOCK) // 2] ^= 0x10
    open(segs[1], "wb").write(bytes(raw))


def cut_at_chunk_boundary(cfg: Any, segs: List[str], ids: Any) -> None:
    """The age file cut right after a whole chunk, and the seal made to agree (sizes, sha256):
    the keyless check cannot tell; the key finds the stream ends without its final chunk."""
    raw = open(segs[2], "rb").read()
    age_part = raw[SEAL_BLOCK:]
    header_len = age_part.index(b"\n---") + 1
    header_len = age_part.index(b"\n", header_len) + 1
    cut = age_part[: header_len + 16 + 2 * age.ENC_CHUNK]
    plain_size = 2 * age.CHUNK
    seal = read_seal(segs[2])
    forged = Seal(seal.header, seal.footer, plain_size, seal.plain_sha256, len(cut), hashlib.sha256(cut).hexdigest(),
                  seal.recipients).signed(KEY)  # even signed with the cluster's key
    open(segs[2], "wb").write(seal_block(forged) + cut)


def other_cluster(cfg: Any, segs: List[str], ids: Any) -> None:
    other = os.path.join(cfg.backup.dir, "..", "other")
    os.makedirs(other)
    rcpt = age.parse_recipient(ids.recipients[0])
    theirs = write_chain(other, 3, [4, 3, 5], chain_id="0f" * 16, t0=plain.FULL_MS + 1000, recipients=[rcpt],
                         sign_key=KEY)
    os.unlink(segs[1])
    shutil.copy(theirs[1].path, cfg.backup.dir)
    shutil.rmtree(other)


def ten_thousand_recipients(cfg: Any, segs: List[str], ids: Any) -> None:
    """The age header of segment 2 with its stanza repeated 10,000 times (~1 MB of header)."""
    raw = open(segs[1], "rb").read()
    age_part = raw[SEAL_BLOCK:]
    first = age_part.index(b"\n") + 1
    end = age_part.index(b"\n---")
    stanza = age_part[first : end + 1]
    bomb = age_part[:first] + stanza * 10000 + age_part[end + 1 :]
    seal = read_seal(segs[1])
    forged = dataclasses.replace(seal, age_size=len(bomb), age_sha256=hashlib.sha256(bomb).hexdigest(),
                                 signature=None)
    open(segs[1], "wb").write(seal_block(forged) + bomb)


def seal_edited(cfg: Any, segs: List[str], ids: Any) -> None:
    """The seal's end time moved back and its signature kept: the HMAC no longer matches."""
    rewrite_seal(segs[1], lambda s: dataclasses.replace(
        s, footer=dataclasses.replace(s.footer, end_time_ms=s.footer.end_time_ms - 1)))


def seal_swapped(cfg: Any, segs: List[str], ids: Any) -> None:
    """Segment 2's signed seal in front of segment 3's ciphertext (and the other way round)."""
    a, b = open(segs[1], "rb").read(), open(segs[2], "rb").read()
    open(segs[1], "wb").write(a[:SEAL_BLOCK] + b[SEAL_BLOCK:])
    open(segs[2], "wb").write(b[:SEAL_BLOCK] + a[SEAL_BLOCK:])


def declares_8_gib(cfg: Any, segs: List[str], ids: Any) -> None:
    rewrite_seal(segs[1], lambda s: dataclasses.replace(s, plain_size=8 << 30, signature=None))


def seal_bomb(cfg: Any, segs: List[str], ids: Any) -> None:
    """A seal of nested brackets: parsed bounded, refused as JSON."""
    raw = open(segs[1], "rb").read()
    doc = b"[" * 4000 + b"]" * 4000
    block = SEAL_MAGIC + U32.pack(len(doc)) + doc
    open(segs[1], "wb").write(block + b"\0" * (SEAL_BLOCK - len(block)) + raw[SEAL_BLOCK:])


def unknown_seal_field(cfg: Any, segs: List[str], ids: Any) -> None:
    raw = open(segs[1], "rb").read()
    n = U32.unpack_from(raw, 8)[0]
    doc = json.loads(raw[12 : 12 + n])
    doc["plaintext_follows"] = True
    body = json.dumps(doc).encode()
    block = SEAL_MAGIC + U32.pack(len(body)) + body
    open(segs[1], "wb").write(block + b"\0" * (SEAL_BLOCK - len(block)) + raw[SEAL_BLOCK:])


def sparse_8_gib(cfg: Any, segs: List[str], ids: Any) -> None:
    """A broken disk's or a careless copy's hole: segment 2 extended to 8 GiB (sparse, no blocks)."""
    os.truncate(segs[1], 8 << 30)


def sparse_8_gib_seal_agrees(cfg: Any, segs: List[str], ids: Any) -> None:
    """The same hole with a seal forged to match its size: refused from the seal, the file unread."""
    rewrite_seal(segs[1], lambda s: dataclasses.replace(s, age_size=(8 << 30) - SEAL_BLOCK, signature=None))
    os.truncate(segs[1], 8 << 30)


CASES = [bit_flip, cut_at_chunk_boundary, other_cluster, ten_thousand_recipients, seal_edited, seal_swapped,
         declares_8_gib, seal_bomb, unknown_seal_field, sparse_8_gib, sparse_8_gib_seal_agrees]


def outside_pitr(root: str) -> Any:
    """The tree without the replay's dirs - ``.pitr`` in the backup dir, the private dir of its
    plaintext in the state dir (``pitr.workdirs.private_dir``) - and without the backup and state dirs' own
    mtimes, which their creation changes."""
    return {p: v for p, v in tree(root).items()
            if "/.pitr" not in p and f"/{workdirs.PRIVATE_DIR}" not in p and not p.endswith(("/backups", "/state"))}


def refused_cleanly(cfg: Any, root: str, before: Any, what: str, msg: str) -> None:
    after = outside_pitr(root)
    written = sum(s for p, (s, _m) in after.items() if before.get(p) != (s, _m))
    left = os.listdir(os.path.join(cfg.backup.dir, ".pitr"))
    print(f"\nFIGURE hostile encrypted chain {what}: refused ({written} bytes written outside .pitr; .pitr holds "
          f"{left}): {msg}")
    assert "\n" not in msg, msg
    assert after == before and written == 0, sorted(set(after) ^ set(before))
    assert left == [".lock"], left
    private = workdirs.private_dir(cfg)
    assert not os.path.isdir(private) or os.listdir(private) == [], os.listdir(private)


def test_the_encrypted_chain_as_written_is_accepted_and_opened(sealed_bed: Any) -> None:
    cfg, d, segs, ids, _ = sealed_bed
    staging = str(os.path.join(d, "st"))
    os.makedirs(staging, mode=0o700)
    p = pitr.prepare(cfg, "latest", Target.to_revision(END), identities=ids, staging=staging)
    assert p.plan.complete and p.plan.stop_revision == END
    assert [s.sealed.signature for s in p.check.segments] == ["valid"] * 3  # type: ignore[union-attr]
    assert all(os.path.dirname(s.path) == staging and s.disk_path in segs for s in p.check.segments)


@pytest.mark.parametrize("damage", CASES, ids=[c.__name__ for c in CASES])
def test_a_hostile_encrypted_chain_is_refused_in_one_sentence_writing_nothing(sealed_bed: Any, damage: Any) -> None:
    cfg, d, segs, ids, _ = sealed_bed
    damage(cfg, segs, ids)
    root = os.path.dirname(d)
    before = outside_pitr(root)
    with pytest.raises(RefusedError) as exc:
        run(cfg, ids)
    refused_cleanly(cfg, root, before, damage.__name__, exc.value.message)
    assert exc.value.message.endswith("nothing touched"), exc.value.message


def test_without_an_identity_or_with_the_wrong_one_nothing_is_written(sealed_bed: Any, tmp_path: Any) -> None:
    cfg, d, _segs, _ids, _ = sealed_bed
    root = os.path.dirname(d)
    secret, _pub = age.generate_identity()
    wrong = tmp_path / "wrong.txt"
    wrong.write_text(secret + "\n")
    os.chmod(wrong, 0o600)
    for label, ids in (("no identity", None), ("wrong identity", age.load_identities(str(wrong)))):
        before = outside_pitr(root)
        with pytest.raises(IdentityRefused) as exc:
            run(cfg, ids)
        msg = exc.value.message
        refused_cleanly(cfg, root, before, label, msg)
        assert ("pass --identity FILE" in msg) if ids is None else ("nothing was decrypted" in msg)


def test_an_identity_file_others_can_read_is_refused_by_the_command(sealed_bed: Any) -> None:
    from etcd_agent.cli.backup import load_identity

    _cfg, _d, _segs, _ids, id_path = sealed_bed
    os.chmod(id_path, 0o640)
    with pytest.raises(IdentityRefused) as exc:
        load_identity(id_path)
    assert exc.value.message.endswith(f"run chmod 600 {id_path}")
