"""Continuous backup and point-in-time restore on loopback: etcd 3.5.16, three members, one
`etcd-agent run` daemon per member writing delta segments into the shared backup dir."""
from __future__ import annotations

import json
import os
import shutil
import time
from datetime import datetime, timezone

import pytest

from etcd_agent.chain import chains
from etcd_agent.errors import OperationFailed
from tests.integration.continuous import (
    agent,
    breaks,
    delete,
    dump,
    full_backups,
    lease_ttl,
    logs,
    put,
    rpc,
    segment_files,
    start_all,
    textfile,
    wait_durable,
    wait_for,
    wait_watching,
)
from tests.integration.test_daemon import wait_healthy

pytestmark = pytest.mark.integration


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def test_point_in_time_between_two_writes_with_the_lease_rule(bed) -> None:  # type: ignore[no-untyped-def]
    d = bed()
    c = d.c
    start_all(d)
    base = wait_watching(c)
    assert full_backups(c), "the daemon took no full backup to start its chain from"
    r = rpc(c)
    long_lease, _ = r.lease_grant(600)
    short_lease, _ = r.lease_grant(2)
    for i in range(50):
        put(r, f"/before/{i:03d}", b"b")
    put(r, "/before/leased", b"L", long_lease)
    put(r, "/before/short", b"S", short_lease)  # expires ~2 s later, before the target
    put(r, "/gone/x", b"x")
    delete(r, "/gone/x")
    time.sleep(3.5)  # the short lease runs out; its key's delete reaches the chain before the target
    last_before = put(r, "/before/last", b"z")
    # the daemon's watch is read in batches (batch_seconds = 1): a revision's time is when its
    # batch arrived, up to ~1.1 s after its commit, so the target is a good 2 s after the write
    time.sleep(2.0)
    target = time.time()
    time.sleep(0.6)
    first_after = put(r, "/after/first", b"a")
    for i in range(20):
        put(r, f"/after/{i:03d}", b"a")
    delete(r, "/before/000")  # a delete after the target: the key must come back
    live_rev = put(r, "/after/last", b"a")
    waited = wait_durable(c, live_rev)
    print(f"\nFIGURE pitr: last write before the target at revision {last_before}, first after at {first_after}; "
          f"closed segment holding revision {live_rev} {waited:.2f}s after the write")
    assert dump(r, "/before/short/") == {} and "/before/short" not in dump(r)

    listing = agent(c, "backup", "list")
    assert listing.returncode == 0, listing.stderr
    assert "delta chain" in listing.stdout and "events/s" in listing.stdout, listing.stdout
    print("BACKUP LIST:\n" + listing.stdout)

    when = iso(target)
    dry = agent(c, "restore", "--from", "latest", "--to-time", when, "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "point in time: full backup" in dry.stdout and f"reached revision {last_before}" in dry.stdout, dry.stdout
    assert "lost after it: revisions" in dry.stdout and "leases as at the target" in dry.stdout
    assert "the point-in-time replay ran in a throwaway etcd on loopback" in dry.stdout
    print("DRY RUN:\n" + "\n".join(ln for ln in dry.stdout.splitlines() if "point in time" in ln or "identity" in ln))
    assert "/after/first" in dump(r), "the dry run changed the live cluster"
    assert not os.listdir(os.path.join(c.cfg.backup.dir, ".pitr")) or all(
        n.startswith("etcd-replay-") is False for n in os.listdir(os.path.join(c.cfg.backup.dir, ".pitr")))

    t = time.monotonic()
    res = agent(c, "--json", "restore", "--from", "latest", "--to-time", when, "--yes")
    wall = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(c.cfg, 3, 60)
    r = rpc(c)
    got = dump(r)
    before = {k for k in got if k.startswith("/before/")}
    assert before == {f"/before/{i:03d}" for i in range(50)} | {"/before/leased", "/before/last"}, sorted(got)
    assert not [k for k in got if k.startswith("/after/")], "a write after the target came back"
    assert "/gone/x" not in got, "a key deleted before the target came back"
    assert "/before/short" not in got, "a key of a lease expired before the target came back"
    ttl = lease_ttl(r, "/before/leased")
    assert ttl is not None and 5 <= ttl <= 600, ttl  # the TTL it had left at the target, as a lease
    print(f"FIGURE pitr restore to {when}: {len(before)} keys from before back, 0 from after, expired-lease key "
          f"absent, leased key restored with {ttl}s left; restore wall time {wall:.1f}s")
    out = json.loads(res.stdout)
    assert out["done"] is True
    # recorded as from the full backup, its chain and the target: not from the throwaway replay
    from etcd_agent.backup import boundaries

    [rec] = [b for b in boundaries.read(c.cfg.backup.dir) if b.op == out["plan"]["op"]]
    assert rec.from_backup in os.listdir(c.cfg.backup.dir) and ".to-" not in rec.from_backup, rec
    assert rec.to_revision is not None and last_before <= rec.to_revision < first_after and rec.chain_id, rec
    assert not os.listdir(os.path.join(c.cfg.backup.dir, ".pitr")) or not [
        n for n in os.listdir(os.path.join(c.cfg.backup.dir, ".pitr")) if n.endswith(".db")], "replay left behind"

    # the restored cluster is another cluster id: the daemons break the old chain, take a full
    # backup and watch from it; the textfile says so
    try:
        wait_for(lambda: chains.active_base(c.cfg.backup.dir) not in (None, base) and breaks(c) >= 1, 90,
                 "a new chain after the restore")
    except OperationFailed as exc:
        raise AssertionError(f"{exc.message}; active base {chains.active_base(c.cfg.backup.dir)} (was {base}), "
                             f"breaks {breaks(c)}; daemons:\n{logs(d)[-6000:]}") from None
    assert "CHAIN BROKEN" in logs(d)
    m = wait_for(lambda: textfile(c).get("etcd_agent_delta_chain_breaks_total", 0) >= 1 and textfile(c), 30,
                 "the textfile counting the break")
    assert m["etcd_agent_delta_enabled"] == 1
    assert segment_files(c)


def test_compaction_while_stopped_breaks_the_chain_and_a_restore_stops_at_the_gap(bed) -> None:  # type: ignore[no-untyped-def]
    d = bed(n=1)
    c = d.c
    start_all(d)
    base = wait_watching(c)
    r = rpc(c)
    for i in range(30):
        put(r, f"/a/{i:03d}", b"1")
    time.sleep(2.0)  # past the batch (batch_seconds = 1) that receives the /a/ writes
    t_mid = time.time()  # between the /a/ writes and /a/mid
    time.sleep(0.3)
    mid = put(r, "/a/mid", b"1")
    wait_durable(c, mid)
    d.stop()  # the daemon stops (its etcd with it: process backend); etcd comes back without it
    c.members[0].backend.start()
    c.members[0].wait_healthy(30)
    r = rpc(c)
    for i in range(30):
        put(r, f"/b/{i:03d}", b"2")
    top = put(r, "/b/top", b"2")
    r.compact(top)  # what the apiserver does every 5 minutes
    backups_before = full_backups(c)
    d.start("m1")
    wait_for(lambda: breaks(c) >= 1 and chains.active_base(c.cfg.backup.dir) not in (None, base), 90,
             "the daemon to start a new chain after the compaction")
    log = logs(d)
    assert "CHAIN BROKEN" in log and "compacted" in log, log[-3000:]
    assert len(full_backups(c)) == len(backups_before) + 1, "no full backup at the break"
    print("\nFIGURE compaction break, daemon log:\n  " + "\n  ".join(
        ln for ln in log.splitlines() if "CHAIN BROKEN" in ln or "full backup" in ln))

    old = backups_before[-1]
    after = iso(time.time())
    res = agent(c, "restore", "--from", old, "--to-time", after, "--dry-run")
    assert res.returncode == 3, res.stdout + res.stderr
    assert "cannot be reached" in res.stderr and "compacted" in res.stderr and f"--from {full_backups(c)[-1]}" in res.stderr
    print("FIGURE restore across the gap refused:\n  " + "\n  ".join(res.stderr.strip().splitlines()[-4:]))
    # up to the last good point it works (and says what is lost after it)
    ok = agent(c, "restore", "--from", old, "--to-time", iso(t_mid), "--dry-run")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"reached revision {mid - 1}" in ok.stdout, ok.stdout
    # `latest` with a target is the newest full backup at or before it: the old one here
    latest = agent(c, "restore", "--from", "latest", "--to-time", iso(t_mid), "--dry-run")
    assert latest.returncode == 0 and f"full backup {old}" in latest.stdout, latest.stdout + latest.stderr
    # and the chain's coverage reaches the daemon's stop (its last, empty segment says so)
    assert agent(c, "restore", "--from", old, "--to", "newest", "--dry-run").returncode == 0
    shutil.rmtree(os.path.join(c.cfg.backup.dir, ".pitr"), ignore_errors=True)


def test_a_crashed_point_in_time_restore_resumes_with_the_same_command(bed) -> None:  # type: ignore[no-untyped-def]
    import signal
    import subprocess

    from etcd_agent.restore.host.facts import work_dir_for
    from tests.integration.test_restore import AGENT

    d = bed()
    c = d.c
    start_all(d)
    wait_watching(c)
    r = rpc(c)
    for i in range(40):
        put(r, f"/k/{i:03d}", b"v")
    top = put(r, "/k/top", b"v")
    wait_durable(c, top)
    cmd = [AGENT, "-c", c.config_path, "restore", "--from", "latest", "--to", "newest", "--yes"]
    journal = os.path.join(work_dir_for(c.cfg.data_dir("m2"), "m2"), "journal.json")
    said = open(os.path.join(c.dir, "restore-killed.stderr"), "w+b")  # what it said, should it end early
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=said, start_new_session=True)
    try:
        def aside() -> bool:
            if proc.poll() is not None:
                said.seek(0)
                raise AssertionError(f"the restore ended (rc {proc.returncode}) before it could be killed: "
                                     + said.read().decode(errors="replace")[-3000:])
            try:
                with open(journal) as fh:
                    j = json.load(fh)
            except (FileNotFoundError, ValueError):
                return False
            return "aside" in j.get("steps", {}) and j.get("state") == "running"

        wait_for(aside, 120, "m2's data set aside", interval=0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        said.close()
    kept = [n for n in os.listdir(os.path.join(c.cfg.backup.dir, ".pitr")) if n.endswith(".db")]
    assert len(kept) == 1, "the replay of the crashed restore is gone"
    t = time.monotonic()
    res = agent(c, *cmd[3:])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "reusing the replay an interrupted run" in res.stderr and "begin ok - already done" in res.stderr, res.stderr
    wait_healthy(c.cfg, 3, 60)
    got = dump(rpc(c), "/k/")
    assert len(got) == 41, sorted(got)
    assert not [n for n in os.listdir(os.path.join(c.cfg.backup.dir, ".pitr")) if n.endswith(".db")]
    print(f"\nFIGURE pitr resume: restore --to newest SIGKILLed after m2's data was set aside; the same command "
          f"resumed it on the kept replay in {time.monotonic() - t:.1f}s; 41 keys back")
