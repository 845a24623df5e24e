"""The restore record (``.etcd-agent-restores.json``) and the segments, as an attacker or a bad
disk leaves them, met by the commands an operator and cron run against a real etcd: a FIFO
blocks nothing (each command runs with a timeout, so a hang fails the test instead of hanging the
suite), and a record that cannot be read holds retention - nothing is deleted, and `prune
--dry-run`, `status` and the metrics file say why."""
from __future__ import annotations

import json
import os
import subprocess
from typing import Iterator, List

import pytest

from etcd_agent.backup import boundaries
from etcd_agent.backup.metrics import read_metrics
from tests.integration.test_backup import Etcd, cli, write_config

pytestmark = pytest.mark.integration

PROMPT = 90  # seconds: each command finishes well within it (a hang was for ever)
SEGMENT = "etcd-delta-0000000000000001-0000000000000002-20260101T000000Z.seg"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("record"))


@pytest.fixture(scope="module")
def etcd(base: str) -> Iterator[Etcd]:
    e = Etcd(base, "rec1", "tok-rec")
    try:
        e.fill(1)
        yield e
    finally:
        e.stop()


def backups(bdir: str) -> List[str]:
    return sorted(n for n in os.listdir(bdir) if n.startswith("etcd-") and n.endswith(".tar"))


def three_backups(base: str, etcd: Etcd, sub: str) -> str:
    bdir = os.path.join(base, sub)
    cfgp = write_config(base, etcd, bdir, keep_last=1, keep_hourly=0, keep_daily=0,
                        metrics_file=os.path.join(base, f"{sub}.prom"))
    for _ in range(3):
        r = cli(cfgp, "backup", "--no-prune", timeout=PROMPT)
        assert r.returncode == 0, r.stderr
    assert len(backups(bdir)) == 3
    return cfgp


def run(cfgp: str, *args: str) -> subprocess.CompletedProcess:
    try:
        r = cli(cfgp, *args, timeout=PROMPT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(args)}` still running after {PROMPT}s: blocked")
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


@pytest.mark.parametrize("content", [b'{"restores": [{"op": "r1", "time": 1e300}]}',
                                     b'{"restores": [{"op": "r1", "time": 1e400}]}',
                                     b'{"restores": [{"op": "r1", "time": ' + b"9" * 400 + b"}]}",
                                     b"garbage", b"", "fifo"],
                         ids=["1e300", "1e400", "400 digits", "garbage", "empty", "fifo"])
def test_an_unreadable_record_holds_prune_and_says_why(base: str, etcd: Etcd, content: object) -> None:
    sub = f"unreadable-{abs(hash(str(content)))}"
    cfgp = three_backups(base, etcd, sub)
    bdir = os.path.join(base, sub)
    rec = os.path.join(bdir, boundaries.FILE)
    if content == "fifo":
        os.mkfifo(rec, 0o600)
    else:
        with open(rec, "wb") as fh:
            fh.write(content)  # type: ignore[arg-type]
    before = backups(bdir)

    r = run(cfgp, "backup", "list")
    assert r.returncode == 0 and all(n in r.stdout for n in before), r.stderr
    assert "PRUNE HELD: the restore record is unreadable" in r.stdout, r.stdout

    r = run(cfgp, "backup", "prune", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "would delete" not in r.stdout and "the restore record is unreadable" in r.stdout, r.stdout
    assert "prune deletes nothing" in r.stdout

    r = run(cfgp, "backup", "prune")
    assert r.returncode == 0, r.stderr
    assert backups(bdir) == before

    r = run(cfgp, "--json", "backup")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pruned"] == [] and len(backups(bdir)) == 4
    assert read_metrics(os.path.join(base, f"{sub}.prom"))["prune_held"] == 1.0

    r = run(cfgp, "status")
    assert "PRUNE HELD: the restore record is unreadable" in r.stdout + r.stderr
    if content == "fifo":
        r = run(cfgp, "restore", "--from", "latest", "--dry-run")
        assert r.returncode in (0, 3), r.stdout + r.stderr

    # repaired (moved away): prune goes back to the rules, and the gauge to 0
    os.unlink(rec)
    r = run(cfgp, "--json", "backup")
    assert r.returncode == 0 and len(backups(bdir)) == 1, r.stdout
    assert read_metrics(os.path.join(base, f"{sub}.prom"))["prune_held"] == 0.0


def test_a_fifo_among_the_segments_blocks_no_command(base: str, etcd: Etcd) -> None:
    cfgp = three_backups(base, etcd, "fifo-segment")
    bdir = os.path.join(base, "fifo-segment")
    os.mkfifo(os.path.join(bdir, SEGMENT), 0o600)
    os.mkfifo(os.path.join(bdir, ".delta-watcher.lock"), 0o600)

    r = run(cfgp, "backup", "list")
    assert r.returncode == 0 and "is a FIFO, not a regular file" in r.stdout, r.stdout + r.stderr
    r = run(cfgp, "backup", "prune", "--dry-run")
    assert r.returncode == 0 and "not regular files, named like segments" in r.stdout, r.stdout + r.stderr
    r = run(cfgp, "--json", "backup")
    assert r.returncode == 0, r.stderr
    r = run(cfgp, "restore", "--from", "latest", "--dry-run")
    assert r.returncode in (0, 3), r.stdout + r.stderr
    r = run(cfgp, "restore", "--from", "latest", "--to", "newest", "--dry-run")
    assert r.returncode in (0, 1, 3), r.stdout + r.stderr  # the FIFO is no segment: not replayed, not waited on
