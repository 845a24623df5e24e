"""Lean checkpoints: the daemon's checkpoint snapshot defragmented offline before it is archived
(``backup.lean``). On loopback, etcd 3.5.16 and its etcdutl, a real `etcd-agent run` daemon: keys
overwritten and the history compacted (as Kubernetes' API server does every 5 minutes), so that
the live db holds free pages; the checkpoint taken after that holds only the data, says what it
came from, is still the cluster's (its members), verifies, restores plainly, and a point-in-time
restore starting from it gives exactly what etcd's own Range at that revision read. With
``lean_checkpoints = false`` a checkpoint is the live db as etcd streams it, as before."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Tuple

import pytest

from etcd_agent.backup import archive, catalog, keys, lean
from etcd_agent.errors import AgentError
from etcd_agent.etcd.client import EtcdClient
from tests.harness.releases import DEFAULT, LEGACY
from tests.integration.continuous import agent, delete, dump, put, start_all, wait_durable, wait_for, wait_watching
from tests.integration.continuous import rpc as rpc_of
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_pitr_checkpoints import CHECKPOINTS, live_at, same_state, start_of, user_keys, vouched

pytestmark = pytest.mark.integration

BED_MEMBERS = 1
SNAP = "etcd_snapshot.db"


def live_db(c: Any) -> Tuple[int, Tuple[str, ...]]:
    """The member's db file size (`endpoint status` dbSize) and the cluster's member ids (hex)."""
    cl = EtcdClient.from_config(c.cfg, endpoints=[c.cfg.members[0].client_url], timeout=10.0)
    try:
        st = cl.status(c.cfg.members[0].client_url)
        ids = tuple(sorted(f"{m.id:x}" for m in cl.members(c.cfg.members[0].client_url)))
    finally:
        cl.close()
    return st.db_size, ids


def overwritten_and_compacted(bed: Any, lean: bool, backup: str = "") -> Tuple[Any, Any, str, Any, str, Dict[str, Any]]:
    """A one-member bed whose 20 keys were overwritten 50 times with 16 KiB values and whose
    history was then compacted; more puts until the daemon vouched for a checkpoint taken after
    the compaction. (daemons, cluster, backup dir, rpc, that checkpoint's path, its manifest)."""
    # a checkpoint each 1 MiB the chain grows (checkpoints.MIN_GROWTH), whatever its full backup's size
    delta = dict(CHECKPOINTS, checkpoint_ratio="0.01")
    d = bed(delta=delta if lean else dict(delta, lean_checkpoints="false"), backup=backup)  # on by default
    # what a daemon killed while staging a checkpoint left: swept when the next one starts
    killed = os.path.join(d.c.cfg.daemon.state_dir, "checkpoint-stage", "etcd-lean-killed", "member", "snap")
    os.makedirs(killed, mode=0o700)
    with open(os.path.join(killed, "db"), "wb") as fh:
        fh.write(b"\0" * 4096)
    start_all(d)
    c, directory = d.c, d.c.cfg.backup.dir
    wait_watching(c)
    wait_for(lambda: not os.path.exists(os.path.dirname(os.path.dirname(killed))), 30, "the killed stage swept")
    r = rpc_of(c)
    rev = 0
    for _round in range(50):
        for i in range(20):
            rev = put(r, f"/over/k{i:02d}", os.urandom(8192).hex().encode())
    r.compact(rev, physical=True)  # what was overwritten is now free pages in the live db
    # the chain grows by 1 MiB (checkpoints.MIN_GROWTH) in ~65 puts: a checkpoint of little more
    # than the data, once these are in
    for rnd in range(6):
        for i in range(80):
            put(r, f"/more/k{rnd}-{i:02d}", os.urandom(8192).hex().encode())
        try:
            wait_for(lambda: [x for x in vouched(directory) if x[1] > rev], 20, "a checkpoint after the compaction")
            break
        except AgentError:
            continue
    assert [x for x in vouched(directory) if x[1] > rev], (rev, vouched(directory))
    name, _rev = max(vouched(directory), key=lambda x: x[1])
    path = os.path.join(directory, name)
    return d, c, directory, r, path, archive.read_manifest(path)


def test_a_checkpoint_after_overwrites_holds_only_the_data_and_restores_exactly(bed) -> None:  # type: ignore[no-untyped-def]
    _d, c, directory, r, cp, man = overwritten_and_compacted(bed, lean=True)
    cp_rev = man["revision"]
    size = man["files"][SNAP]["size"]
    from_bytes = man["snapshot"]["lean"]["from_bytes"]
    db_size, member_ids = live_db(c)
    # a tail after it, then the target: the chain's end
    top = 0
    for i in range(20):
        top = put(r, f"/tail/k{i:02d}", f"t{i}".encode())
        if i % 5 == 4:
            top = delete(r, f"/over/k{i:02d}")
    wait_durable(c, top)
    lives = {n: user_keys(live_at(r, n)) for n in (cp_rev, top)}
    assert lives[cp_rev] and lives[top] != lives[cp_rev]
    # beyond the target: the operator's backup below is then no start for it
    wait_durable(c, put(r, "/after", b"x"))

    # the same cluster's plain backup (the operator's, not lean): the live db as etcd streams it
    res = agent(c, "--json", "backup")
    assert res.returncode == 0, res.stdout + res.stderr
    plain = json.loads(res.stdout)["path"]
    plain_man = archive.read_manifest(plain)
    assert "lean" not in plain_man["snapshot"], plain_man["snapshot"]
    plain_size = plain_man["files"][SNAP]["size"]
    print(f"\nFIGURE lean checkpoint: {size} bytes (defragmented from {from_bytes}); live db {db_size}, the same "
          f"cluster's plain backup {plain_size}")
    assert size < from_bytes // 2 and size < db_size // 2 and size < plain_size // 2, (size, from_bytes, db_size,
                                                                                       plain_size)
    assert man["snapshot"]["pages"] * man["snapshot"]["page_size"] + 32 == size  # the facts are the lean db's

    # still the cluster's: the catalogue reads its members from the snapshot's own db
    entry = next(e for e in catalog.list_backups(directory, key=keys.local_key(c.cfg).key) if e.path == cp)
    assert entry.complete and entry.checkpoint_of and tuple(sorted(entry.member_ids)) == member_ids, entry
    assert entry.snapshot_sha256 == man["files"][SNAP]["sha256"]
    assert any(x[0] == os.path.basename(cp) for x in vouched(directory))  # the chain vouches for the lean sha256
    ver = agent(c, "backup", "verify", cp)
    assert ver.returncode == 0, ver.stdout + ver.stderr

    # a point-in-time restore that starts from it: exactly etcd's own Range at the target
    dry = agent(c, "restore", "--from", "latest", "--to-revision", str(top), "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert start_of(directory, top) in dry.stdout and os.path.basename(cp) in start_of(directory, top), dry.stdout
    res = agent(c, "restore", "--from", "latest", "--to-revision", str(top), "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(c.cfg, 1, 60)
    diff = same_state(lives[top], user_keys(dump(rpc_of(c))))
    assert not diff, diff[:10]

    # and a plain restore from it: the state at its revision
    res = agent(c, "restore", "--from", cp, "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(c.cfg, 1, 60)
    diff = same_state(lives[cp_rev], user_keys(dump(rpc_of(c))))
    assert not diff, diff[:10]
    assert not os.listdir(os.path.join(c.cfg.daemon.state_dir, "checkpoint-stage"))  # every stage removed


def test_without_lean_checkpoints_a_checkpoint_is_the_live_db_as_etcd_streams_it(bed) -> None:  # type: ignore[no-untyped-def]
    _d, c, _directory, _r, _cp, man = overwritten_and_compacted(bed, lean=False)
    size = man["files"][SNAP]["size"]
    assert "lean" not in man["snapshot"], man["snapshot"]
    # today's size class: the db's pages, free ones included (the compacted history is still in them)
    assert size > man["db_size"] // 2, (size, man["db_size"])
    assert size > 10 * 1024 * 1024, size  # 1000 overwrites of 16 KiB, compacted but not defragmented
    assert os.listdir(os.path.join(c.cfg.daemon.state_dir, "checkpoint-stage")) == []  # the killed one swept


def test_an_encrypted_lean_checkpoint_is_staged_outside_the_backup_dir_and_verifies(bed, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent import age

    secret, recipient = age.generate_identity()
    key = tmp_path / "backup-key.txt"
    key.write_text(secret + "\n")
    os.chmod(key, 0o600)
    _d, c, directory, _r, cp, man = overwritten_and_compacted(bed, lean=True, backup=f'encrypt_to = ["{recipient}"]\n')
    assert SNAP + ".age" in man["files"] and SNAP not in man["files"], man["files"]
    size, from_bytes = man["encryption"]["plaintext_size"], man["snapshot"]["lean"]["from_bytes"]
    assert size < from_bytes // 2, (size, from_bytes)
    assert man["snapshot"]["pages"] * man["snapshot"]["page_size"] + 32 == size
    # the plaintext was staged under the state dir, never in the backup dir (copied off-host)
    assert os.path.isdir(os.path.join(c.cfg.daemon.state_dir, "checkpoint-stage"))
    assert not os.path.commonpath([c.cfg.daemon.state_dir, directory]) == directory
    ver = agent(c, "backup", "verify", "--identity", str(key), cp)
    assert ver.returncode == 0, ver.stdout + ver.stderr
    print(f"\nFIGURE encrypted lean checkpoint: {size} bytes of plaintext (defragmented from {from_bytes}), "
          "verified with its identity")


@pytest.mark.parametrize("version", [LEGACY, DEFAULT])
def test_each_releases_offline_defrag_keeps_the_snapshots_kv_hash_and_revision(tmp_path, version) -> None:  # type: ignore[no-untyped-def]
    """etcd 3.4's `ETCDCTL_API=3 etcdctl defrag --data-dir` and 3.5's etcdutl, on a real snapshot
    of that release: `snapshot status` reads the same KV hash, revision and keys before and after."""
    from etcd_agent.config import parse_text
    from etcd_agent.etcd.tools import snapshot_status
    from etcd_agent.hosts.local import LocalHost
    from tests.harness.releases import release

    data = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                        "snap-a-34.db" if version == LEGACY else "snap-a.db")
    with open(data, "rb") as fh:
        snap = fh.read()
    cfg, errors = parse_text(f'[cluster]\nname = "c"\n[etcd]\n{release(version).toml()}[daemon]\n'
                             f'state_dir = "{tmp_path}/state"\n[[member]]\nname = "a"\nhost = "10.0.0.1"\n')
    assert errors == [] and cfg is not None, errors
    before = snapshot_status(LocalHost(), cfg, data)
    with lean.staged(cfg, LocalHost(), lambda: iter([snap]), len(snap)) as st:
        assert st.lean, version
        after = snapshot_status(LocalHost(), cfg, st.path)
    for k in ("hash", "revision", "totalKey"):
        assert after[k] == before[k], (version, before, after)
