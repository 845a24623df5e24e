"""The restore's ship over real SSH: three namespace hosts sh1..sh3 (10.213.14.11-13) with sshd and
their own agents, as in test_restore_ssh (sh1 drives, locally; sh2 and sh3 over SSH).

What shipping must do on real links: compress a snapshot that compresses and send one that does
not as it is, to the two other hosts at once (sh1 copies its own); when a host is cut off mid-ship, fail without stopping any
etcd, every member serving its old data and no staging copy left anywhere; refuse a snapshot that
is not the manifest's with nothing kept; refuse, before any data flows, a host whose work dir's
disk is too small. The tests build on each other in file order (one cluster).
"""
from __future__ import annotations

import glob
import os
import subprocess
import tarfile
import time
from typing import Dict, Iterator, List, Sequence

import pytest

from etcd_agent.errors import AgentError
from tests.harness.releases import DEFAULT, release
from tests.harness.restorebed import RestoreBed, counts, put_many, restore_bed, wait_healthy

pytestmark = pytest.mark.multihost

PREFIX, SUBNET = "sh", "10.213.14"
KEYS = 10_000
RANDOM_VALUES = 480  # x 64 KiB of random bytes: a ~32 MB snapshot that does not compress
HEAL = 150.0  # s for a member cut off for a minute or more to serve again: TCP_RTO_MAX 120 s + an election


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestoreBed]:
    with restore_bed(tmp_path_factory, PREFIX, SUBNET, etcd=release(DEFAULT).toml()) as b:
        put_many(b.cfg(), "/k/", KEYS)
        yield b


def staging(bed: RestoreBed) -> Dict[str, List[str]]:
    """What a ship left in each member's work dir: temp files, the snapshot, its receipt."""
    out = {}
    for m in bed.cfg().members:
        d = bed.work_dir(m.name)
        out[m.name] = sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, ".etcd_snapshot.db.*"))
                             + glob.glob(os.path.join(d, "etcd_snapshot.db*")) + glob.glob(os.path.join(d, "received.json")))
    return out


def untouched(bed: RestoreBed) -> Dict[str, tuple]:
    """Each member's etcd pid and data dir inode: what a failed ship must leave as it was."""
    cfg = bed.cfg()
    pids = bed.pids()
    return {m.name: (pids[m.name], os.stat(cfg.data_dir(m.name)).st_ino) for m in cfg.members}


def nothing_staged(bed: RestoreBed) -> bool:
    return not any(staging(bed).values())


def details(stderr: str) -> str:
    """The error's per-host lines (the progress above them says the same once more)."""
    return "\n".join(line for line in stderr.splitlines() if line.startswith("  - "))


def shipped_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if "shipped " in line)


def restore_everywhere(bed: RestoreBed, b: Dict, how: str, prefixes: Sequence[str], want: List[int]) -> None:
    """Restore ``b`` with keys written after it; check the ship said ``how`` and every member serves
    ``want`` keys under ``prefixes`` (the later ones gone), with nothing left staged."""
    put_many(bed.cfg(), "/later/", 100)
    res = bed.agent(bed.h(1), "restore", "--from", b["path"], "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    line = shipped_line(res.stderr)
    # sh1 is the master it runs on: its member copies the file here; the two others are shipped to
    assert "to 2 member(s)" in line and how in line, line
    assert f"{PREFIX}1 (local): receive ok - copied from the file on this master" in res.stderr, res.stderr
    for m in bed.cfg().members:
        assert counts(bed.cfg(), *prefixes, "/later/", endpoint=m.client_url) == [*want, 0]
    assert nothing_staged(bed), staging(bed)
    print(f"\n[figure] netns tier: {line.split('restore: ')[-1]}")


def test_a_compressible_snapshot_ships_compressed_to_the_other_hosts(bed: RestoreBed) -> None:
    restore_everywhere(bed, bed.backup(), "compressed in transit", ["/k/"], [KEYS])


def test_a_random_snapshot_ships_as_it_is_to_the_other_hosts(bed: RestoreBed) -> None:
    put_many(bed.cfg(), "/rnd/", RANDOM_VALUES, size=64 << 10, random=True)
    restore_everywhere(bed, bed.backup(), "sent as it is", ["/k/", "/rnd/"], [KEYS, RANDOM_VALUES])


def test_a_host_cut_mid_ship_stops_nothing_and_leaves_no_copy(bed: RestoreBed) -> None:
    b = bed.backup()  # ~32 MB of random values: the raw stream
    put_many(bed.cfg(), "/after/", 10)
    before = untouched(bed)
    sh3 = bed.net.hosts[2]
    bed.net.shape(sh3, "40mbit")  # ~8 s for the snapshot: room to cut it half-way
    proc = bed.popen_agent(bed.h(1), "restore", "--from", b["path"], "--yes",
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        parts = os.path.join(bed.work_dir("sh3"), ".etcd_snapshot.db.*.part")
        deadline = time.monotonic() + 120
        while not any(os.path.getsize(p) > (4 << 20) for p in glob.glob(parts) if os.path.exists(p)):
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "sh3's receiver never got 4 MiB"
            time.sleep(0.05)
        bed.net.set_link(sh3, False)
        _out, err_b = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = err_b.decode()
    assert proc.returncode == 1, err
    assert "shipping the snapshot failed; nothing stopped" in err, err
    assert "sh3 (10.213.14.13): the stream has not moved for 20s" in err, err
    assert "sh1 (local) rolled back: etcd left running: its data dir was never touched" in err, err
    assert "sh2 (10.213.14.12) rolled back: etcd left running: its data dir was never touched" in err, err
    assert "sh3 (10.213.14.13): NOT rolled back" in err and "etcd-agent restore rollback --yes" in err, err
    assert untouched(bed) == before  # no etcd stopped, no data dir moved, sh3's neither
    wait_healthy(bed.cfg(), 30, ["sh1", "sh2"])
    for n in ("sh1", "sh2"):  # the old data, written after the backup included
        assert counts(bed.cfg(), "/after/", endpoint=bed.cfg().member(n).client_url) == [10]
    left = staging(bed)
    assert left["sh1"] == [] and left["sh2"] == [], left
    # sh3's receiver, cut off, gives up on its own once no data came for its idle limit
    deadline = time.monotonic() + 90
    while staging(bed)["sh3"]:
        assert time.monotonic() < deadline, staging(bed)
        time.sleep(0.5)
    bed.net.set_link(sh3, True)
    bed.net.shape(sh3, None)
    # what this test asserts of the restore is asserted above; from here on it hands the next
    # test a healed bed: the connections opened before the cut go now, not over the next minutes
    bed.net.reset_peers(sh3)
    # sh3 journaled the restore's begin; the operator rolls it back once it is back (its old
    # session may hold the host's lock until it notices the caller is gone)
    deadline = time.monotonic() + 120
    while True:
        res = bed.agent(bed.h(1), "restore", "rollback", "--yes")
        if res.returncode != 4 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert res.returncode == 0, res.stdout + res.stderr
    assert bed.journal("sh3").get("state") == "rolled-back"
    assert untouched(bed) == before
    # How soon sh3 serves again after a cut of a minute or more is etcd's and TCP's business, not
    # the restore's: a peer stream opened before the cut waits out TCP's retransmission backoff
    # (up to 120 s on Linux). One CI run saw sh3 still unhealthy 30 s after its link came back.
    healed = wait_healthy(bed.cfg(), HEAL)
    print(f"FIGURE: sh3 healthy {healed:.1f}s after its link and the rollback")
    settled(bed, "sh3")
    assert counts(bed.cfg(), "/after/", endpoint=bed.cfg().member("sh3").client_url) == [10]
    assert nothing_staged(bed), staging(bed)


def settled(bed: RestoreBed, member: str, steady: float = 8.0, within: float = 150.0) -> None:
    """Until linearizable reads through ``member`` have succeeded for ``steady`` seconds on end.
    After its link came back, a peer stream opened before the cut can stay stuck for a while
    (TCP's retransmission backoff) and then break. Seen in two clean-clone runs, where the next
    test's read through sh3 waited out its 5 s deadline; in the second, sh3's log showed the
    leader's stream breaking ("unexpected EOF") 8 s after its last failed probe of the cut. The
    next test starts on a healed bed, not on this one's aftermath."""
    url = bed.cfg().member(member).client_url
    deadline = time.monotonic() + within
    ok_since = None
    while True:
        now = time.monotonic()
        try:
            counts(bed.cfg(), "/after/", endpoint=url)
            ok_since = ok_since or now
            if now - ok_since >= steady:
                return
        except AgentError:
            ok_since = None
        assert now < deadline, f"{member} did not serve linearizable reads steadily within {within:g}s of its link"
        time.sleep(0.2)


def snapshot_span(path: str) -> "tuple[int, int]":
    with tarfile.open(path) as t:
        m = t.getmember("etcd_snapshot.db")
        return m.offset_data, m.size


def test_a_snapshot_that_is_not_the_manifests_is_refused_and_the_old_data_kept(bed: RestoreBed, tmp_path: object) -> None:
    b = bed.backup()
    put_many(bed.cfg(), "/after-bad/", 10)
    bad = os.path.join(str(tmp_path), "tampered.tar")
    with open(b["path"], "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read())
    off, size = snapshot_span(bad)
    with open(bad, "r+b") as fh:  # one byte in the middle of the db: the manifest (signed) still claims the old sha
        fh.seek(off + size // 2)
        byte = fh.read(1)
        fh.seek(off + size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    before = untouched(bed)
    res = bed.agent(bed.h(1), "restore", "--from", bad, "--yes")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "the manifest says" in res.stderr and "no member kept it, nothing stopped" in res.stderr, res.stderr
    assert details(res.stderr).count("rolled back: etcd left running: its data dir was never touched") == 3, res.stderr
    assert untouched(bed) == before
    for m in bed.cfg().members:
        assert counts(bed.cfg(), "/after-bad/", endpoint=m.client_url) == [10]
    assert nothing_staged(bed), staging(bed)


def test_a_work_dir_without_room_is_refused_before_any_data_flows(bed: RestoreBed) -> None:
    b = bed.backup()
    sh2 = bed.net.hosts[1]
    wd = bed.work_dir("sh2")
    # the work dir on a disk of its own, 256 KiB: the pre-check measures beside the data dir, so
    # only the receiver, on its own disk, can tell
    bed.net.run_in_sshd_mounts(sh2, ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", wd])
    try:
        before = untouched(bed)
        res = bed.agent(bed.h(1), "restore", "--from", b["path"], "--yes")
    finally:
        bed.net.run_in_sshd_mounts(sh2, ["umount", wd])
    assert res.returncode == 1, res.stdout + res.stderr
    err = res.stderr
    assert "shipping the snapshot was refused before any data was sent; nothing stopped" in err, err
    assert "sh2 (10.213.14.12): sh2: " in err and f"bytes free in {wd}, the snapshot needs" in err, err
    assert details(err).count("rolled back: etcd left running: its data dir was never touched") == 3, err
    assert untouched(bed) == before
    assert nothing_staged(bed), staging(bed)
    wait_healthy(bed.cfg(), 30)
