"""Restores that collide, die or lose a host, over real SSH.

Three namespace hosts ec1..ec3 (10.213.11.11-13) with sshd, each with its own agent.toml
(``tests/harness/restorebed.py``); the operator's commands run on a master (its namespace, its
hostname). Real etcd 3.4.23, etcdctl, tar, sshd; no mocks.

- two restores started 0.5, 2 and 5 s apart from two masters (ec1, then ec2): the second is
  refused (exit 4) naming the first's holder, the first completes;
- the orchestrator SIGKILLed while etcd is down, then re-run: it resumes and completes;
- a host cut off (its veth down) after the snapshot was shipped but before the fence: every
  member keeps serving, untouched; once the host is back, the command the error names
  (``restore rollback --yes``) leaves no shipped or staged copy anywhere.

The tests build on each other in file order (one cluster), like an operator's session.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Dict, Iterator, List

import pytest

from tests.harness.netns import NsHost
from tests.harness.restorebed import (
    RestoreBed,
    copy_into,
    every_member,
    put_many,
    restore_bed,
    retry_busy,
    revisions,
    wait_healthy,
    wait_journal,
)

pytestmark = pytest.mark.multihost

PREFIX, SUBNET = "ec", "10.213.11"
KEYS = 5_000
# bulk data, so that a restore takes longer than the longest gap between the two starts
BULK, BULK_SIZE = 20_000, 4096
GAPS = (0.5, 2.0, 5.0)
SHAPED = "100mbit"


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestoreBed]:
    with restore_bed(tmp_path_factory, PREFIX, SUBNET) as b:
        yield b


@pytest.fixture(scope="module")
def backup(bed: RestoreBed) -> str:
    """An agent backup taken on ec1, copied to ec2's backup dir too (each master has its own);
    keys written after it. Returns its name."""
    cfg = bed.cfg()
    t = time.monotonic()
    put_many(cfg, "/k/", KEYS)
    # random: the ship compresses what shrinks, and the two-masters test needs a ship that takes time
    put_many(cfg, "/bulk/", BULK, size=BULK_SIZE, random=True)
    out = bed.backup()
    path = out["path"]
    print(f"\n[figure] concurrent bed: {KEYS} keys + {BULK} x {BULK_SIZE} B, backup of {os.path.getsize(path)} bytes "
          f"in {out['duration']:.1f}s ({time.monotonic() - t:.1f}s with the puts)")
    copy_into(path, bed.backup_dir(bed.h(2)))
    put_many(cfg, "/later/", 300)
    return os.path.basename(path)


def healthy_on_backup(bed: RestoreBed, *gone: str) -> Dict[str, int]:
    cfg = bed.cfg()
    wait_healthy(cfg, 30)
    revs = revisions(cfg)
    assert len(set(revs.values())) == 1, revs
    served = every_member(cfg, "/k/", "/later/", *gone)
    assert all(v == [KEYS, 0] + [0] * len(gone) for v in served.values()), served
    return revs


def err_lines(stderr: str) -> List[str]:
    return [line for line in stderr.splitlines() if "error:" in line or line.startswith("  - ")]


def shape(bed: RestoreBed, rate: str = SHAPED) -> List[str]:
    """Traffic to ec2 and ec3 (their root-side veth's egress) limited to ``rate``."""
    devs = [bed.net.veth(h) for h in bed.net.hosts[1:]]
    for dev in devs:
        subprocess.run(["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                        "latency", "400ms"], check=True, capture_output=True, timeout=30)
    return devs


def unshape(devs: List[str]) -> None:
    for dev in devs:
        subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)


def test_two_masters_restore_at_once(bed: RestoreBed, backup: str) -> None:
    ec1, ec2 = bed.h(1), bed.h(2)
    # masters on a slower link: shipping the backup then outlasts the longest gap, so the second
    # restore always starts while the first runs (on the bare veths it takes ~6 s in all)
    devs = shape(bed)
    try:
        _two_masters(bed, backup, ec1, ec2)
    finally:
        unshape(devs)


def _two_masters(bed: RestoreBed, backup: str, ec1: NsHost, ec2: NsHost) -> None:
    for gap in GAPS:
        later = f"/gap-{gap}/"
        put_many(bed.cfg(), later, 20)
        t = time.monotonic()
        first = bed.popen_agent(ec1, "restore", "--from", backup, "--yes", stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        time.sleep(gap)
        t2 = time.monotonic()
        second = bed.agent(ec2, "restore", "--from", backup, "--yes")
        second_took = time.monotonic() - t2
        out, err = first.communicate(timeout=300)
        first_took = time.monotonic() - t
        assert first.returncode == 0, f"first (ec1) exit {first.returncode}:\n{err.decode()}\nsecond:\n{second.stderr}"
        assert second.returncode == 4, second.stdout + second.stderr
        assert gap + second_took < first_took, "the second was refused while the first still ran"
        holder = f"`etcd-agent restore --from {backup}` from ec1 (pid {first.pid})"
        assert holder in second.stderr, second.stderr
        assert "nothing touched" in second.stderr
        revs = healthy_on_backup(bed, later)
        shipped = [line.split("restore: ", 1)[1] for line in err.decode().splitlines() if "restore: shipped" in line]
        print(f"\n[figure] two masters ({SHAPED} to ec2/ec3), second started {gap} s after the first: first (ec1) "
              f"exit {first.returncode} in {first_took:.1f}s ({'; '.join(shipped)}); second (ec2) exit {second.returncode} after "
              f"{second_took:.1f}s; healthy at revision {sorted(set(revs.values()))}, {KEYS} keys, 0 later")
        print("second's refusal:\n" + "\n".join(err_lines(second.stderr)))


def test_orchestrator_killed_then_resumed(bed: RestoreBed, backup: str) -> None:
    ec1 = bed.h(1)
    put_many(bed.cfg(), "/after-kill/", 20)
    proc = bed.popen_agent(ec1, "restore", "--from", backup, "--yes", stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    j = wait_journal(bed, "ec3", "stop", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    steps = {m.name: sorted(bed.journal(m.name).get("steps", {})) for m in bed.cfg().members}
    # the plan says it resumes (the hosts' journals), then the same command completes it
    dry, busy0, _w = retry_busy(lambda: bed.agent(ec1, "restore", "--from", backup, "--dry-run"))
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"restore {j['op']} (resuming)" in dry.stdout, dry.stdout
    t = time.monotonic()
    res, busy, _w = retry_busy(lambda: bed.agent(ec1, "restore", "--from", backup, "--yes"))
    took = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    skipped = [line for line in res.stderr.splitlines() if "already done" in line]
    assert skipped and f"restore {j['op']} done" in res.stderr, res.stderr
    revs = healthy_on_backup(bed, "/after-kill/")
    for m in bed.cfg().members:
        assert bed.journal(m.name).get("state") == "done"
    print(f"\n[figure] orchestrator SIGKILLed once ec3 was stopped (journaled steps: {steps}); the dry run "
          f"said 'restore {j['op']} (resuming)'; re-run exit 0 in {took:.1f}s ({busy0 + busy} busy retries while "
          f"the dead run's sessions ended), {len(skipped)} steps 'already done', revision {sorted(set(revs.values()))}")


def test_host_cut_after_ship_before_fence(bed: RestoreBed, backup: str) -> None:
    cfg = bed.cfg()
    ec1, ec3 = bed.h(1), bed.h(3)
    # a runbook tarball, gzip: the orchestrator stages its snapshot (decompressed) in ec1's backup dir
    hand = os.path.join(bed.work, "by-hand")
    os.makedirs(hand, mode=0o700)
    bed.ctl(ec1, "snapshot", "save", "etcd_snapshot.db", cwd=hand)
    bed.sh(ec1, ["cp", cfg.conf_file("ec1"), os.path.join(hand, "etcd.conf")])
    bed.sh(ec1, ["tar", "czf", "etcd-2019-08-07.tar", "etcd.conf", "etcd_snapshot.db"], cwd=hand)
    bed.sh(ec1, ["mv", os.path.join(hand, "etcd-2019-08-07.tar"), bed.backup_dir(ec1)])
    put_many(cfg, "/after-snap/", 20)
    pids, inodes = bed.pids(), bed.inodes()
    stderr: List[str] = []
    t = time.monotonic()
    proc = bed.popen_agent(ec1, "restore", "--from", "etcd-2019-08-07.tar", "--yes", stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    reader = threading.Thread(target=lambda: stderr.extend(x.decode() for x in proc.stderr), daemon=True)  # type: ignore[union-attr]
    reader.start()
    staged: List[str] = []
    try:
        wait_journal(bed, "ec3", "receive", proc, poll=0.002)
        bed.net.set_link(ec3, False)
        cut_at = time.monotonic() - t
        staged = [n for n in os.listdir(bed.backup_dir(ec1)) if n.startswith(".etcd-agent-stage-")]
        proc.wait(180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(10)
    took = time.monotonic() - t
    err = "".join(stderr)
    try:
        assert proc.returncode == 1, err
        # ec3 journals its receipt before the orchestrator reads it: a cut right then ends the
        # ship, a cut a moment later the staged restore (beside the data dir, etcd serving) or
        # the fence; either way every copy was whole and no etcd was stopped
        assert any(f"restore failed at {p}" in err for p in ("ship", "restore", "fence")), err
        assert "ec3 (10.213.11.13): NOT rolled back" in err and "ROLLBACK INCOMPLETE" in err, err
        assert "etcd-agent restore rollback --yes" in err, err  # the next command, named
        assert "ec1 (local) rolled back: etcd left running" in err, err
        assert "ec2 (10.213.11.12) rolled back: etcd left running" in err, err
        # while ec3 is away: nothing was stopped or moved anywhere
        assert bed.pids() == pids, f"etcd pids changed: {pids} -> {bed.pids()}"
        assert bed.inodes() == inodes
        wait_healthy(cfg, 30, ["ec1", "ec2"])
        for n in ("ec1", "ec2"):
            assert "etcd_snapshot.db" not in bed.work_files(n)
        # ec3 was cut off with its shipped copy, or - when its staged restore came first - with
        # that restore, the copy dropped as soon as it had served
        assert ("etcd_snapshot.db" in bed.work_files("ec3")
                or os.path.isdir(cfg.data_dir("ec3") + ".restoring")), bed.work_files("ec3")
        for n in ("ec1", "ec2"):  # nothing staged beside their data dirs is left either
            assert not os.path.lexists(cfg.data_dir(n) + ".restoring")
        assert not [n for n in os.listdir(bed.backup_dir(ec1)) if n.startswith(".etcd-agent-stage-")]
        print(f"\n[figure] ec3 cut {cut_at:.2f}s into the restore (after its snapshot was received, staged copy "
              f"{staged or 'none'} in ec1's backup dir); orchestrator exit {proc.returncode} after {took:.1f}s; "
              "ec1/ec2 rolled back without a restart; every etcd pid and data dir unchanged")
        print("orchestrator:\n" + "\n".join(err_lines(err)))
    finally:
        bed.net.set_link(ec3, True)
    back = wait_healthy(cfg, 60)
    t = time.monotonic()
    res, busy, _w = retry_busy(lambda: bed.agent(ec1, "restore", "rollback", "--yes"))
    took = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    assert bed.journal("ec3").get("state") == "rolled-back"
    for m in cfg.members:
        assert not {"etcd_snapshot.db", "received.json"} & set(bed.work_files(m.name)), bed.work_files(m.name)
        assert not os.path.lexists(cfg.data_dir(m.name) + ".restoring"), m.name
    assert not [n for n in os.listdir(bed.backup_dir(ec1)) if n.startswith(".etcd-agent-stage-")]
    assert bed.pids() == pids, f"etcd pids changed: {pids} -> {bed.pids()}"
    assert bed.inodes() == inodes
    wait_healthy(cfg, 30)
    served = every_member(cfg, "/k/", "/after-snap/")
    assert all(v == [KEYS, 20] for v in served.values()), served
    print(f"[figure] ec3 back (all healthy {back:.1f}s after the link came up); `restore rollback --yes`: exit 0 "
          f"in {took:.1f}s after {busy} busy retries; no shipped or staged copy left; pids and data dirs as before")
    print("rollback:\n" + res.stdout + "\n".join(line for line in res.stderr.splitlines() if "restore:" in line))
