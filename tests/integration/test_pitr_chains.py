"""Chains as a product, one member and its daemon on etcd 3.5.16: a damaged segment stops the
replay at the last good point; chain bounds make the daemon take a full backup; retention keeps
a full backup and its chain together (an orphaned chain is pruned with its reason); the daemon's
Prometheus endpoint and the textfile carry the delta metrics; remote copies of segments; the
daemon signs its segments, and a forged tail or an unsigned chain is refused."""
from __future__ import annotations

import os
import time
import urllib.request
from typing import Optional

import pytest

from etcd_agent.backup import keys
from etcd_agent.chain import chains
from etcd_agent.chain.reader import read_header, verify_segment
from etcd_agent.daemon.metrics import samples
from tests.harness.chains import EVIL, append_tail, strip_signatures, tree
from tests.harness.loopback import free_port_pairs
from tests.harness.rgw import RgwBed, remote_table
from tests.integration.continuous import (
    agent,
    dump,
    full_backups,
    put,
    rpc,
    segment_files,
    start_all,
    textfile,
    wait_durable,
    wait_for,
    wait_watching,
)

pytestmark = pytest.mark.integration


BED_MEMBERS = 1  # the conftest's `bed` fixture: one-member daemon beds


def batch(c, prefix: str, n: int) -> int:  # type: ignore[no-untyped-def]
    r = rpc(c)
    rev = 0
    for i in range(n):
        rev = put(r, f"{prefix}{i:03d}", b"x" * 100)
    return rev


def test_a_damaged_segment_stops_the_replay_at_the_last_good_point(bed) -> None:  # type: ignore[no-untyped-def]
    d = bed()
    c = d.c
    start_all(d)
    wait_watching(c)
    revs = []
    for p in ("/one/", "/two/", "/three/"):
        revs.append(batch(c, p, 20))
        wait_durable(c, revs[-1])
        time.sleep(1.5)  # close_seconds = 1: each batch in segments of its own
    d.stop()
    segs = [s for s in segment_files(c) if read_header(s).start_revision > revs[0]]
    victim = next(s for s in segs if read_header(s).start_revision <= revs[1] - 5)
    with open(victim, "r+b") as fh:  # one flipped byte in the middle of a segment of /two/
        fh.seek(os.path.getsize(victim) // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    # (backup list reads headers and footers only: damage inside is for the restore's full check)
    stop_at = read_header(victim).start_revision

    newest = agent(c, "restore", "--from", "latest", "--to", "newest", "--dry-run")
    assert newest.returncode == 0, newest.stdout + newest.stderr
    assert f"NOT COMPLETE - the chain stops at revision {stop_at} (corrupt" in newest.stdout, newest.stdout
    later = agent(c, "restore", "--from", "latest", "--to-revision", str(revs[2]), "--dry-run")
    assert later.returncode == 3 and "cannot be reached" in later.stderr and "corrupt" in later.stderr, later.stderr
    print("\nFIGURE damaged segment: --to newest: " + next(
        ln.strip() for ln in newest.stdout.splitlines() if "NOT COMPLETE" in ln))
    print("FIGURE damaged segment: --to-revision past it: " + later.stderr.strip().splitlines()[0])

    res = agent(c, "restore", "--from", "latest", "--to", "newest", "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    got = dump(rpc(c))
    assert len([k for k in got if k.startswith("/one/")]) == 20
    assert all(int(k.rsplit("/", 1)[1]) < 20 for k in got if k.startswith("/two/"))
    assert len([k for k in got if k.startswith("/two/")]) == stop_at - revs[0] - 1, "applied past the damage"
    assert not [k for k in got if k.startswith("/three/")], "a segment after the damage was applied"


def test_bounds_retention_orphans_and_metrics(bed) -> None:  # type: ignore[no-untyped-def]
    (port, _), = free_port_pairs(1)
    d = bed(delta={"max_chain_events": "150"}, backup="keep_last = 1\nkeep_hourly = 0\nkeep_daily = 0\n",
            daemon=f'metrics_address = "127.0.0.1:{port}"\n')
    c = d.c
    start_all(d)
    first = wait_watching(c)
    batch(c, "/a/", 200)  # past max_chain_events: a full backup, a new chain; keep_last = 1 prunes the old pair
    wait_for(lambda: chains.active_base(c.cfg.backup.dir) not in (None, first), 60, "a new chain past the bound")
    wait_for(lambda: len(full_backups(c)) == 1, 30, "the old full backup pruned")
    wait_for(lambda: {x.base_revision for x in chains.scan(c.cfg.backup.dir).chains} <= {
        chains.active_base(c.cfg.backup.dir)}, 30, "the old chain pruned with its full backup")
    log = "\n".join(d.log(lm.member.name) for lm in c.members)
    assert "passed max_chain_events" in log and "pruning delta chain after revision" in log, log[-3000:]

    batch(c, "/b/", 3)
    def scraped() -> Optional[str]:  # the /b/ writes captured: the watch reads them within batch_seconds
        body = _scrape(port)
        wanted = ("etcd_agent_delta_lag_revisions", "etcd_agent_delta_newest_event_timestamp_seconds")
        return body if all(w in body for w in wanted) else None

    body = wait_for(scraped, 30, "delta metrics on the daemon's endpoint")
    m = {(n, tuple(sorted(lb.items()))): v for n, lb, v in samples(body)}
    assert m[("etcd_agent_delta_enabled", ())] == 1
    assert m[("etcd_agent_delta_full_backups_total", (("reason", "chain_bounds"),))] >= 1
    assert m[("etcd_agent_delta_rpo_seconds", ())] < 30
    assert ("etcd_agent_delta_lag_revisions", ()) in m and ("etcd_agent_delta_newest_event_timestamp_seconds", ()) in m
    tf = wait_for(lambda: textfile(c) if textfile(c).get("etcd_agent_delta_chain_base_revision", 0) > first else None,
                  30, "the textfile on the new chain")
    print(f"\nFIGURE metrics: rpo {m[('etcd_agent_delta_rpo_seconds', ())]:.1f}s, lag "
          f"{m[('etcd_agent_delta_lag_revisions', ())]:.0f} revisions (endpoint); textfile rpo "
          f"{tf['etcd_agent_delta_rpo_seconds']:.1f}s")

    # an orphan: its full backup deleted by hand -> listed, then pruned with the reason
    d.stop()
    os.unlink(os.path.join(c.cfg.backup.dir, full_backups(c)[0]))
    listing = agent(c, "backup", "list")
    assert "ORPHANED delta chain" in listing.stdout, listing.stdout
    dry = agent(c, "backup", "prune", "--dry-run")
    assert "orphaned: no full backup here that it continues" in dry.stdout, dry.stdout
    assert segment_files(c)
    assert agent(c, "backup", "prune").returncode == 0
    assert not segment_files(c)


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return str(resp.read().decode())
    except OSError:
        return ""


def test_segments_are_copied_off_host_as_they_close_and_pruned_with_their_chain(bed, rgw: RgwBed) -> None:  # type: ignore[no-untyped-def]
    bucket = rgw.new_bucket()
    raw = rgw.client()
    remote = remote_table(rgw, bucket, prefix="p/", keep_last=1, keep_daily=0)
    d = bed(tables=remote)
    c = d.c
    start_all(d)
    first = wait_watching(c)
    rev = batch(c, "/r/", 30)
    wait_durable(c, rev)

    def keys() -> list:  # type: ignore[type-arg]
        out = raw.list_objects_v2(Bucket=bucket, Prefix="p/chains/").get("Contents", [])
        return sorted(o["Key"] for o in out if ".seg" in o["Key"])

    local = {os.path.basename(s) for s in segment_files(c)}
    wait_for(lambda: {k.rsplit("/", 1)[1] for k in keys()} >= local, 60, "every closed segment copied")
    k = keys()[0]
    head = raw.head_object(Bucket=bucket, Key=k)
    assert head["Metadata"]["base-revision"] == str(first) and len(head["Metadata"]["sha256"]) == 64
    old = f"p/chains/{head['Metadata']['chain']}/"
    assert all(k.startswith(old) for k in keys())
    fulls = raw.list_objects_v2(Bucket=bucket, Prefix=old).get("Contents", [])
    assert any(o["Key"].endswith(".tar") for o in fulls), "the chain's full backup is beside its segments"
    print(f"\nFIGURE remote: {len(keys())} segment(s) copied under {old} as they closed")

    # a new full backup (keep_last = 1 remote): the old chain's copies go with the old copy
    res = agent(c, "backup")
    assert res.returncode == 0, res.stderr
    second = wait_for(lambda: (chains.active_base(c.cfg.backup.dir) or first) != first
                      and chains.active_base(c.cfg.backup.dir), 60, "the watch on the new chain")
    rev = batch(c, "/s/", 5)
    wait_durable(c, rev)
    wait_for(lambda: any(not k.startswith(old) for k in keys()), 60, f"the new chain (after revision {second}) copied")
    pr = agent(c, "backup", "prune", "--remote")  # (the backup's own prune ran while the old chain was live)
    assert pr.returncode == 0, pr.stderr
    assert "remote chain chains/" in pr.stdout, pr.stdout
    assert keys() and all(not k.startswith(old) for k in keys()), keys()


def test_forged_tails_are_refused_and_an_unsigned_chain_needs_the_flag(bed) -> None:  # type: ignore[no-untyped-def]
    """A forged tail appended to the daemon's signed chain (a well-formed segment from the segment
    writer, unsigned or signed with a made-up key) is refused by `restore --to newest`, dry run and
    --yes alike, the data dir untouched; a legacy (unsigned) chain only with --accept-unsigned-chain."""
    d = bed()
    c = d.c
    start_all(d)
    wait_watching(c)
    rev = batch(c, "/signed/", 20)
    wait_durable(c, rev)
    time.sleep(1.5)  # close_seconds = 1: the open segment closed
    d.stop()
    bdir = c.cfg.backup.dir
    key = keys.local_key(c.cfg).key
    assert key is not None, "the daemon's full backup left no manifest key beside the config"
    assert all(verify_segment(p, key=key).signature == "valid" for p in segment_files(c))
    ok = agent(c, "restore", "--from", "latest", "--to", "newest", "--dry-run")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    line = next(ln.strip() for ln in ok.stdout.splitlines() if "delta chain signed" in ln)
    assert "signed with this cluster's manifest key" in line, line
    print(f"\nFIGURE signed chain: plan: {line}")
    data = os.path.join(c.dir, "data")  # the member's data dir (its etcd is down with its daemon)
    before = tree(data)

    for label, sign_key in (("unsigned", None), ("wrong key", bytes(32))):
        forged = append_tail(bdir, sign_key)
        name = os.path.basename(forged)
        for mode in ("--dry-run", "--yes"):
            res = agent(c, "restore", "--from", "latest", "--to", "newest", mode)
            assert res.returncode == 3, res.stdout + res.stderr
            first = res.stderr.strip().splitlines()[0]
            assert name in first and "forged" in first and first.endswith("nothing touched"), res.stderr
            print(f"\nFIGURE forged tail ({label}) {mode}: exit 3: {first}")
        assert tree(data) == before, "a refused restore touched the member's data dir"
        os.unlink(forged)

    strip_signatures(bdir)
    res = agent(c, "restore", "--from", "latest", "--to", "newest", "--dry-run")
    assert res.returncode == 3, res.stdout + res.stderr
    first = res.stderr.strip().splitlines()[0]
    assert "not signed" in first and "--accept-unsigned-chain" in first, res.stderr
    print(f"FIGURE unsigned chain, no flag: exit 3: {first}")
    dry = agent(c, "restore", "--from", "latest", "--to", "newest", "--dry-run", "--accept-unsigned-chain")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    line = next(ln.strip() for ln in dry.stdout.splitlines() if "not signed" in ln)
    print(f"FIGURE unsigned chain, --accept-unsigned-chain: plan: {line}")
    res = agent(c, "restore", "--from", "latest", "--to", "newest", "--yes", "--accept-unsigned-chain")
    assert res.returncode == 0, res.stdout + res.stderr
    got = dump(rpc(c))
    assert EVIL not in got
    assert {k for k in got if k.startswith("/signed/")} == {f"/signed/{i:03d}" for i in range(20)}
