"""Encrypted delta segments (``.seg.age``): written through age, checked without the key, opened
with it, decrypted by hand with the distribution's ``age`` (pure: no etcd)."""
import os
import stat
import subprocess

import pytest

from etcd_agent.age import generate_identity, load_identities, parse_recipient
from etcd_agent.chain.check import check_chain
from etcd_agent.chain.errors import SegmentCorrupt
from etcd_agent.chain.reader import read_header, read_segment, read_summary
from etcd_agent.chain.seal import SEAL_BLOCK, open_sealed, read_seal, verify_sealed
from etcd_agent.chain.segments import SegmentHeader, Txn, list_segments, parse_name
from etcd_agent.chain.writer import SegmentWriter
from etcd_agent.continuous.position import find_resume_point
from etcd_agent.errors import IdentityRefused

from .test_chain_segments import put, write_chain

KEY = b"\x07" * 32


@pytest.fixture
def keypair(tmp_path):
    secret, public = generate_identity()
    path = tmp_path / "id.txt"
    path.write_text(f"# test key\n{secret}\n")
    os.chmod(path, 0o600)
    return load_identities(str(path)), parse_recipient(public), str(path)


def staging(tmp_path, name="st"):
    d = tmp_path / name
    d.mkdir(mode=0o700)
    return str(d)


def test_an_encrypted_chain_holds_no_plaintext_and_checks_without_the_key(tmp_path, keypair):
    ids, rcpt, _ = keypair
    d = str(tmp_path / "b")
    os.makedirs(d)
    old = os.umask(0)
    try:
        infos = write_chain(d, 100, [5, 0, 3], recipients=[rcpt], sign_key=KEY)
    finally:
        os.umask(old)
    names = [os.path.basename(p) for p in list_segments(d)]
    assert names == [os.path.basename(i.path) for i in infos] and all(n.endswith(".seg.age") for n in names)
    assert all(parse_name(n) is not None for n in names)
    for info in infos:
        raw = open(info.path, "rb").read()
        assert stat.S_IMODE(os.stat(info.path).st_mode) == 0o600
        assert b"ETCDDSEG" not in raw and b"gone105" not in raw and b"xxxxxxxx" not in raw
        assert raw[SEAL_BLOCK:SEAL_BLOCK + 21] == b"age-encryption.org/v1"
    # listings read the seal: header and footer in the clear
    h, f = read_summary(infos[2].path)
    assert (h.seq, h.start_revision, f.end_revision) == (2, 106, 108)
    assert read_header(infos[1].path).prev_sha256 == infos[0].sha256
    # the chain links by the sha256 of each whole encrypted file (what sha256sum prints)
    out = subprocess.run(["sha256sum", infos[0].path], capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == infos[0].sha256
    check = check_chain(list_segments(d), 100)
    assert check.stop is None and check.end_revision == 108
    assert all(s.sealed is not None and not s.sealed.opened and s.sealed.signature == "unknown-key"
               for s in check.segments)
    assert verify_sealed(infos[0].path, key=KEY).sealed.signature == "valid"


def test_opened_with_the_key_every_byte_is_checked_and_age_decrypts_it_by_hand(tmp_path, keypair):
    ids, rcpt, id_path = keypair
    d = str(tmp_path / "b")
    os.makedirs(d)
    infos = write_chain(d, 100, [5, 0, 3], recipients=[rcpt], sign_key=KEY)
    st = staging(tmp_path)
    check = check_chain(list_segments(d), 100, opener=lambda p: open_sealed(p, ids, st, key=KEY))
    assert check.stop is None and [s.sha256 for s in check.segments] == [i.sha256 for i in infos]
    for s in check.segments:
        assert s.sealed.opened and s.sealed.signature == "valid" and os.path.dirname(s.path) == st
        assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
        assert len(s.lease_records) == 1
        plain = read_segment(s.path)
        assert plain.info.sha256 == s.content_sha256 and plain.info.header == s.header
        # by hand, as the README says: the age file starts at byte 8193
        by_hand = subprocess.run(f"tail -c +{SEAL_BLOCK + 1} '{s.sealed.path}' | age -d -i '{id_path}'", shell=True,
                                 capture_output=True, check=True).stdout
        assert by_hand == open(s.path, "rb").read()


def test_a_wrong_identity_is_refused_before_a_byte_is_written(tmp_path, keypair):
    _ids, rcpt, _ = keypair
    d = str(tmp_path / "b")
    os.makedirs(d)
    infos = write_chain(d, 100, [5], recipients=[rcpt])
    secret, _pub = generate_identity()
    other = tmp_path / "other.txt"
    other.write_text(secret + "\n")
    os.chmod(other, 0o600)
    st = staging(tmp_path)
    with pytest.raises(IdentityRefused) as exc:
        open_sealed(infos[0].path, load_identities(str(other)), st)
    assert "nothing was decrypted" in exc.value.message and os.listdir(st) == []


def test_an_identity_file_others_can_read_is_refused(tmp_path, keypair):
    _ids, _rcpt, id_path = keypair
    os.chmod(id_path, 0o644)
    with pytest.raises(IdentityRefused) as exc:
        load_identities(id_path)
    assert "chmod 600" in exc.value.message


def test_damage_anywhere_is_seen(tmp_path, keypair):
    ids, rcpt, _ = keypair
    d = str(tmp_path / "b")
    os.makedirs(d)
    infos = write_chain(d, 100, [40], recipients=[rcpt], value_size=8000)
    path = infos[0].path
    good = open(path, "rb").read()
    st = staging(tmp_path)
    assert read_seal(path).age_size > 4 * 65536  # several age chunks

    def refused(data):
        """(what the keyless check says, what opening with the key says); no plaintext left."""
        open(path, "wb").write(data)
        with pytest.raises(SegmentCorrupt) as keyless:
            verify_sealed(path)
        with pytest.raises(SegmentCorrupt) as keyed:
            open_sealed(path, ids, st)
        assert os.listdir(st) == []  # a refused segment leaves no plaintext behind
        return keyless.value.problem, keyed.value.problem

    flipped = bytearray(good)
    flipped[len(good) - 100] ^= 1
    keyless, keyed = refused(bytes(flipped))
    assert "sha256" in keyless and "fails authentication" in keyed
    assert all("truncated" in m for m in refused(good[:-1000]))
    assert all("appended" in m for m in refused(good + b"x"))
    assert all("bad magic" in m for m in refused(b"ETCDDSEG" + good[8:]))


def test_resuming_a_chain_continues_after_its_last_encrypted_segment(tmp_path, keypair):
    _ids, rcpt, _ = keypair
    d = str(tmp_path / "b")
    os.makedirs(d)
    infos = write_chain(d, 100, [5, 3], recipients=[rcpt])
    pos = find_resume_point(d, 100)
    assert pos is not None and pos.prev_sha256 == infos[1].sha256 and pos.next_revision == 109 and pos.seq == 2


def test_a_chain_that_turns_encryption_on_is_one_chain(tmp_path, keypair):
    ids, rcpt, _ = keypair
    d = str(tmp_path / "b")
    os.makedirs(d)
    plain = write_chain(d, 100, [5], chain_id="cd" * 16)
    # the next segments are encrypted, linked to the plain one
    h = SegmentHeader("cd" * 16, 1, 100, 106, plain[0].sha256, plain[0].footer.end_time_ms)
    w = SegmentWriter(d, h, recipients=[rcpt])
    w.add_txn(Txn(106, plain[0].footer.end_time_ms + 5, (put(106, b"after"),)))
    sealed = w.close(plain[0].footer.end_time_ms + 10, confirmed=True)
    st = staging(tmp_path)
    check = check_chain(list_segments(d), 100, opener=lambda p: open_sealed(p, ids, st))
    assert check.stop is None and check.end_revision == 106
    assert [s.sealed is not None for s in check.segments] == [False, True]
    assert sealed.path.endswith(".seg.age")


def test_an_encrypted_segment_vouches_for_a_checkpoint_readable_without_the_key(tmp_path, keypair):
    """The checkpoints an encrypted segment vouches for are in its seal's footer (a restore lists
    them without the key) and, opened with the key, in the segment inside: both must agree."""
    from etcd_agent.chain.segments import Checkpoint

    ids, rcpt, _ = keypair
    d = str(tmp_path / "b")
    os.makedirs(d)
    w = SegmentWriter(d, SegmentHeader("ab" * 16, 0, 100, 101, "", 1_700_000_000_000), recipients=[rcpt],
                      sign_key=KEY)
    for rev in range(101, 104):
        w.add_txn(Txn(rev, 1_700_000_000_000 + rev, (put(rev, b"k"),)))
    cp = Checkpoint("etcd-2026-12-05-10-00-00.tar", "d" * 64, 103, 102)
    info = w.close(1_700_000_001_000, confirmed=True, checkpoints=[cp])
    assert read_summary(info.path)[1].checkpoints == (cp,)
    assert read_seal(info.path).footer.checkpoints == (cp,)
    opened = open_sealed(info.path, ids, staging(tmp_path), key=KEY)
    assert opened.footer.checkpoints == (cp,) and opened.sealed.signature == "valid"
