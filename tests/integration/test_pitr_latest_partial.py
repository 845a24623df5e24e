"""`restore --from latest --to-revision N` over a partial chain (its first segments not here, as a
restore from the bucket with the manifest key leaves it): `latest` takes the full backup whose
partial chain reaches N, with the key; without the key it says why it cannot use it. A newer
operator's backup at the same revision, with no chain, is the one `latest` must pass over. Real
daemon on etcd 3.5.16 with checkpoints; its signed chain made partial by removing the segments
before the newest checkpoint's lease census; the restored key space equals the live Range at N."""
from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from etcd_agent.backup import keys
from etcd_agent.chain import chains
from etcd_agent.etcd.rpc import EtcdRpc
from tests.integration.continuous import agent, dump, full_backups, rpc, wait_durable, wait_for
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_pitr_checkpoints import live_at, same_state, user_keys, vouched, watched, workload

pytestmark = pytest.mark.integration

BED_MEMBERS = 1


def past_a_checkpoint(c: Any, r: EtcdRpc, lease: int) -> int:
    """Writes over several segments, a checkpoint the chain vouches for, then a tail after it: its
    last revision, durable."""
    rev = 0
    for i in range(4):  # segments close every second: several before any checkpoint
        rev = workload(r, f"p{i}", 25, lease)
        time.sleep(1.3)
    wait_durable(c, rev)
    # 100 puts of 16 KiB grow the chain past one checkpoint's worth (1 MiB), maybe not past two:
    # any vouched one will do, whose lease census is after the chain's first segments
    wait_for(lambda: vouched(c.cfg.backup.dir), 240, "a checkpoint the chain vouches for")
    n = workload(r, "tail", 20, lease)
    wait_durable(c, n)
    return n


def test_latest_takes_the_backup_whose_partial_chain_reaches_the_target(bed) -> None:  # type: ignore[no-untyped-def]
    d, c, directory, r, lease = watched(bed)
    (daemons,) = full_backups(c)
    time.sleep(1.1)  # a backup name is to the second
    op = agent(c, "backup")  # the operator's, no write since the daemon's: newer, same revision, no chain
    assert op.returncode == 0, op.stdout + op.stderr
    operators = next(n for n in full_backups(c) if n != daemons)
    n = past_a_checkpoint(c, r, lease)
    live = user_keys(live_at(r, n))
    d.stop()  # nothing writes into the dir while its chain is cut
    c.members[0].backend.start()
    c.members[0].wait_healthy(30)

    (chain,) = [ch for ch in chains.scan(directory).chains if ch.checkpoints]
    census = max(chain.checkpoints, key=lambda cp: cp.revision).leases_from
    gone = []
    for p in chain.paths:
        head = os.path.basename(p).split("-")
        if int(head[3]) < census:  # etcd-delta-<first>-<last>-<time>: wholly before the census
            os.unlink(p)
            gone.append(os.path.basename(p))
    (partial,) = [ch for ch in chains.scan(directory).chains if ch.checkpoints]
    assert gone and partial.begins_at and partial.begins_at <= census, (gone, partial.begins_at, census)
    assert partial.end_revision >= n

    dry = agent(c, "restore", "--from", "latest", "--to-revision", str(n), "--dry-run")
    plan = dry.stdout + dry.stderr
    assert dry.returncode == 0, plan
    said = [ln.strip() for ln in plan.splitlines() if "--from latest" in ln]
    print(f"\nFIGURE --from latest over a partial chain ({len(gone)} segment(s) removed, revisions "
          f"{partial.begins_at}..{partial.end_revision} here):\n  " + "\n  ".join(said))
    assert any(f"--from latest: {daemons}" in ln for ln in said), said
    assert any(f"passed over {operators}" in ln for ln in said), said
    assert f"reached revision {n}" in plan, plan

    key = keys.key_path(c.cfg)
    os.rename(key, key + ".aside")
    try:
        no_key = agent(c, "restore", "--from", "latest", "--to-revision", str(n), "--dry-run")
    finally:
        os.rename(key + ".aside", key)
    refusal = no_key.stdout + no_key.stderr
    print(f"FIGURE without the key: rc {no_key.returncode}: "
          + next((ln.strip() for ln in refusal.splitlines() if "partial chain" in ln), refusal[-400:]))
    assert no_key.returncode == 3, refusal
    assert "partial chain" in refusal and "--key-file" in refusal, refusal

    res = agent(c, "--json", "restore", "--from", "latest", "--to-revision", str(n), "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["done"] is True
    wait_healthy(c.cfg, 1, 60)
    diff = same_state(live, user_keys(dump(rpc(c))))
    assert not diff, diff[:10]
    print(f"FIGURE restored to {n} from {daemons}'s partial chain: {len(live)} keys equal to the live Range at {n}")
