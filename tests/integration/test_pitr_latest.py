"""Which full backup and which chain a point-in-time restore takes, on a real chain: one member
and its daemon on etcd 3.5.16, the `restore` CLI's dry run (the replay runs, nothing live is
touched). Issue 38: an operator's `backup` with no write since the daemon's is a second full
backup at one revision, newer and with no chain; `--from latest --to newest` takes the one whose
chain holds what came after, and says which it passed over. A junk file named like the next
segment is named, never a gap."""
from __future__ import annotations

import os
import time

import pytest

from etcd_agent.chain import chains
from etcd_agent.chain.segments import segment_name
from tests.integration.continuous import agent, full_backups, put, rpc, start_all, wait_durable, wait_watching

pytestmark = pytest.mark.integration


BED_MEMBERS = 1  # the conftest's `bed` fixture: one-member daemon beds


def test_latest_takes_the_backup_whose_chain_reaches_newest_and_a_junk_name_is_no_gap(bed) -> None:  # type: ignore[no-untyped-def]
    d = bed()
    c = d.c
    start_all(d)
    base = wait_watching(c)
    (daemons,) = full_backups(c)
    time.sleep(1.1)  # a backup name is to the second
    op = agent(c, "backup")  # the operator's, no write since the daemon's: the same revision
    assert op.returncode == 0, op.stdout + op.stderr
    operators = next(n for n in full_backups(c) if n != daemons)
    r = rpc(c)
    rev = 0
    for i in range(40):
        rev = put(r, f"/after/{i:03d}", b"x" * 100)
    wait_durable(c, rev)
    d.stop()
    chain = chains.scan(c.cfg.backup.dir).chains[-1]
    assert chain.base_revision == base and chain.end_revision >= rev
    junk = os.path.join(c.cfg.backup.dir, segment_name(chain.end_revision + 1, chain.end_revision + 9,
                                                       int(time.time() * 1000)))
    with open(junk, "wb") as fh:
        fh.write(b"not a segment\n" * 20)

    out = agent(c, "restore", "--from", "latest", "--to", "newest", "--dry-run")
    plan = out.stdout + out.stderr
    assert out.returncode == 0, plan
    said = [ln.strip() for ln in plan.splitlines() if "--from latest" in ln or "passed over" in ln]
    print("\nFIGURE --from latest --to newest, two full backups at one revision:\n  " + "\n  ".join(said))
    assert "NOT COMPLETE" not in plan and "everything from there on is lost" not in plan, plan
    assert f"reached revision {chain.end_revision}" in plan, plan
    assert any(f"--from latest: {daemons}" in ln for ln in said), said
    assert any(f"passed over {operators}" in ln for ln in said), said
    assert any(os.path.basename(junk) in ln and "not a delta segment" in ln for ln in said), said
    listing = agent(c, "backup", "list")
    assert f"NOT A SEGMENT {os.path.basename(junk)}" in listing.stdout, listing.stdout
    assert "DAMAGED" not in listing.stdout, listing.stdout
