"""After a restore, the daemons' continuous backup goes on with one full backup and one new chain
per host - not a full backup every 2 s whose prunes delete the operator's history.

Three namespace hosts es1..es3 (10.213.15.11-13), each with sshd and its own `etcd-agent run`
daemon (process backend, etcd 3.4.23: its restores keep the snapshot's revision, so the backup
taken after a restore has the revision of the pre-restore chain's base - the case that looped),
each with 20 hourly backups of the cluster's own already in its backup dir. Then a restore
(`restore --from latest --yes` on es1 over SSH), and again one made by hand with `etcdctl
snapshot restore` (new cluster token and id, no journal of the agent's), each followed by the
daemons running on their own for WATCH seconds.

What counts, per host: the full backups the daemon takes after the restore (the loop took ~1 per
2 s: 38 in two minutes on one host), the chain breaks recorded, the 20 hourly backups and the
restored-from backup still there, and one chain continuing the post-restore backup.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from datetime import datetime, timedelta, timezone
from typing import Callable, Dict, Iterator, List, Tuple

import pytest

from etcd_agent.backup import boundaries, catalog
from etcd_agent.backup.service import take_backup
from etcd_agent.chain import chains
from etcd_agent.continuous import status
from etcd_agent.errors import OperationFailed
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.member.process import ProcessBackend
from etcd_agent.waiting import NotYet, poll
from tests.harness.netns import NetnsBed, NsHost
from tests.integration.test_backup_trust import FakeClock
from tests.multihost.test_pitr_ssh import Bed, daemon_bed, healthy
from tests.multihost.test_pitr_ssh import agent_toml as pitr_toml

pytestmark = pytest.mark.multihost

PREFIX, SUBNET = "es", "10.213.15"
E34 = "/opt/etcd/3.4.23"
WATCH = float(os.environ.get("STORM_WATCH_SECONDS", "45"))  # the daemons alone after each restore
HOURLY = 20


def agent_toml(work: str, hosts: List[NsHost], me: NsHost, net: NetnsBed) -> str:
    # the shipped [backup] defaults: keep_last 7, keep_hourly 24, keep_daily 7
    return pitr_toml(work, hosts, me, net, cluster="es", release=E34, close_seconds=2.0)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    with daemon_bed(tmp_path_factory, PREFIX, SUBNET, agent_toml) as b:
        yield b


def names(bed: Bed, h: str) -> List[str]:
    return sorted(n for n in os.listdir(bed.cfg(h).backup.dir) if n.startswith("etcd-") and n.endswith(".tar")
                  and not n.startswith("etcd-delta-"))


def log_size(bed: Bed, h: str) -> int:
    return len(bed.log(h))


def daemon_backups_since(bed: Bed, h: str, offset: int) -> int:
    """Full backups the daemon's continuous backup took since ``offset`` in its log (the log, not
    the files: the loop's prunes deleted files as fast as it wrote them)."""
    return sum(1 for ln in bed.log(h)[offset:].splitlines() if "delta: full backup " in ln and " taken" in ln)


def breaks(bed: Bed, h: str) -> int:
    return status.read_breaks(bed.cfg(h).backup.dir)[0]


def put_keys(bed: Bed, prefix: str, n: int) -> None:
    with EtcdClient.from_config(bed.cfg("es1"), timeout=5.0) as c:
        for i in range(n):
            c.put(f"{prefix}{i:05d}", f"v{i}")


def fill_hourly(bed: Bed) -> Dict[str, List[str]]:
    """20 hourly backups of the cluster's own per host, named as cron made them the last 20 hours."""
    now = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    made: Dict[str, List[str]] = {}
    for h in bed.net.hosts:
        made[h.name] = [os.path.basename(take_backup(bed.cfg(h.name), member=h.name, prune=False,
                                                     clock=FakeClock(now - timedelta(hours=i + 1))).path)
                        for i in range(HOURLY)]
    return made


def chain_of_newest(bed: Bed, h: str) -> Tuple[str, chains.ChainSummary]:
    cfg = bed.cfg(h)
    best, _ = catalog.latest(catalog.list_backups(cfg.backup.dir, utc=cfg.backup.utc, cfg=cfg))
    assert best is not None and best.revision is not None
    c = chains.scan(cfg.backup.dir).for_full(best.revision, best.base)
    assert c is not None and c.usable >= 1, f"{h}: no chain continues {best.name}"
    return best.name, c


def backup(bed: Bed, h: NsHost) -> Tuple[str, int]:
    """`etcd-agent backup` on ``h``, as cron runs it: (file name, revision). Busy (exit 4: the
    daemon's own backup or prune holds the dir's lock for a moment) is tried again, as the next
    cron run would."""
    deadline = time.monotonic() + 60
    while True:
        res = bed.agent(h, "--json", "backup")
        if res.returncode != 4 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    return os.path.basename(doc["path"]), int(doc["revision"])


def still_there_and_one_chain(bed: Bed, h: str, older: List[str],
                              counts: Tuple[int, int]) -> Tuple[str, chains.ChainSummary]:
    """The operator's backups from before the restore all there; at most one full backup and one
    break since; a chain continuing the newest backup."""
    have = names(bed, h)
    gone = [n for n in older if n not in have]
    assert not gone, f"{h}: the operator's backups from before the restore pruned: {gone}"
    full_backups, broke = counts
    if full_backups > 1 or broke > 1:  # what the daemon said of its backups and chains, whole lines (CI 46
        # showed a tuple's repr cut in the middle, the reason of a second full backup lost)
        said = [line for line in bed.log(h).splitlines()
                if any(w in line for w in ("ERROR", "WARNING", "full backup", "CHAIN BROKEN", "membership", "delta:"))]
        raise AssertionError(f"{h}: {full_backups} daemon full backup(s) and {broke} break(s) since the restore, "
                             "at most one of each wanted; its log on them:\n" + "\n".join(said[-40:]))

    def continued() -> Tuple[str, chains.ChainSummary]:
        try:
            return chain_of_newest(bed, h)
        except AssertionError as exc:
            raise NotYet(str(exc)) from None

    # settle_and_count's last writes came after every daemon's full backup: a closed segment carries them
    return poll(continued, timeout=30, what=f"{h}'s chain continuing its newest backup", interval=0.5)


def settle_and_count(bed: Bed, offsets: Dict[str, int], before: Dict[str, int],
                     label: str) -> Dict[str, Tuple[int, int]]:
    poll(lambda: healthy(bed.cfg("es1")), timeout=120, what="healthy after the restore", interval=0.5)
    for h in bed.net.hosts:  # each daemon back on a chain of the restored cluster (the loop never settled:
        try:  # counted below, not failed here)
            poll(lambda h=h: chains.active_base(bed.cfg(h.name).backup.dir) is not None, timeout=120,
                 what=f"{h.name}'s watch", interval=0.5)
        except OperationFailed as exc:
            print(f"\n{exc.message}")
    put_keys(bed, f"/{label}/", 200)  # writes on the restored cluster: the new chains carry them
    time.sleep(WATCH)
    got = {}
    for h in bed.net.hosts:
        got[h.name] = (daemon_backups_since(bed, h.name, offsets[h.name]), breaks(bed, h.name) - before[h.name])
    # a daemon that noticed the restore only after the writes above took them into its full
    # backup, and its new chain has nothing yet: a few more, after every full backup counted
    put_keys(bed, f"/{label}-tail/", 5)
    print(f"\nFIGURE {label}: over {WATCH:.0f} s of the daemons after the restore, per host (daemon full "
          f"backups, chain breaks): {got}")
    return got


def test_after_a_restore_one_full_backup_one_chain_and_every_older_backup_kept(bed: Bed) -> None:
    for h in bed.net.hosts:
        poll(lambda h=h: chains.active_base(bed.cfg(h.name).backup.dir), timeout=90,
             what=f"{h.name}'s delta watch", interval=0.5)
    put_keys(bed, "/k/", 2000)
    hourly = fill_hourly(bed)
    # cron's backup on every master (revision R), one write, a second one (R + 1) whose chains the
    # daemons then write. The restore of the first, with its lineage record, leaves the cluster
    # at R + 1: the revision of the second's chain of the cluster of before - the chain the
    # daemon must never take for the new backup's (it did, and looped)
    first = {h.name: backup(bed, h) for h in bed.net.hosts}
    put_keys(bed, "/one/", 1)
    second = {h.name: backup(bed, h) for h in bed.net.hosts}
    put_keys(bed, "/after/", 50)
    for h in bed.net.hosts:
        rev = second[h.name][1]
        poll(lambda h=h, rev=rev: any(c.base_revision == rev and c.usable for c in
                                      chains.scan(bed.cfg(h.name).backup.dir).chains),
             timeout=90, what=f"{h.name}'s chain continuing its second backup", interval=0.5)
    source = first["es1"][0]
    before = {h.name: breaks(bed, h.name) for h in bed.net.hosts}
    offsets = {h.name: log_size(bed, h.name) for h in bed.net.hosts}
    res = bed.agent(bed.net.hosts[0], "restore", "--from", source, "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    got = settle_and_count(bed, offsets, before, "after-agent-restore")
    for h in bed.net.hosts:
        cron = hourly[h.name] + [first[h.name][0], second[h.name][0]]
        newest, c = still_there_and_one_chain(bed, h.name, cron, got[h.name])
        assert c.continues(catalog.entry_for(os.path.join(bed.cfg(h.name).backup.dir, newest)).base)
        # the restore is a boundary every host's catalogue records, held back from retention
        recorded = boundaries.read(bed.cfg(h.name).backup.dir)
        assert recorded and recorded[-1].kind == "restore" and recorded[-1].from_backup == source
    assert source in names(bed, "es1"), "the backup the restore came from was pruned"
    listing = bed.agent(bed.net.hosts[0], "backup", "list")
    assert listing.returncode == 0 and "BEFORE restore" in listing.stdout, listing.stdout
    dry = bed.agent(bed.net.hosts[0], "backup", "prune", "--dry-run")
    assert dry.returncode == 0 and f"keep         {source}: " in dry.stdout and "came from" in dry.stdout, dry.stdout
    assert "would delete" not in "\n".join(ln for ln in dry.stdout.splitlines() if any(n in ln for n in hourly["es1"]))


def etcdctl(argv: List[str], wrap: Callable[[List[str]], List[str]] = lambda a: a) -> None:
    out = subprocess.run(wrap([f"{E34}/etcdctl", *argv]), capture_output=True, text=True,
                         env={**os.environ, "ETCDCTL_API": "3"}, timeout=120)
    assert out.returncode == 0, out.stderr


def restore_by_hand(bed: Bed, snapshot: str, token: str) -> None:
    """The runbook on every host: etcd stopped, data dir aside, `etcdctl snapshot restore` with a
    new token, etcd started - the daemons stopped meanwhile, as an operator would."""
    hosts = bed.net.hosts
    cluster = ",".join(f"{h.name}=http://{h.ip}:2380" for h in hosts)
    bed.stop_daemons()
    for h in hosts:
        cfg = bed.cfg(h.name)
        pid = ProcessBackend(cfg, h.name).pid()
        if pid:
            os.kill(pid, signal.SIGTERM)
            poll(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), timeout=30, what="etcd gone", interval=0.2)
    for h in hosts:
        cfg = bed.cfg(h.name)
        data = cfg.data_dir(h.name)
        shutil.move(data, data + ".by-hand-aside")
        etcdctl(["snapshot", "restore", snapshot, "--name", h.name, "--initial-cluster", cluster,
                 "--initial-cluster-token", token, "--initial-advertise-peer-urls", f"http://{h.ip}:2380",
                 "--data-dir", data])
    for h in hosts:
        bed.start_daemon(h)  # the daemon starts etcd on the restored data dir


def test_after_a_restore_by_hand_the_same(bed: Bed) -> None:
    snap = os.path.join(bed.work, "by-hand.db")
    etcdctl(["--endpoints", bed.cfg("es1").members[0].client_url, "snapshot", "save", snap],
            wrap=lambda argv: bed.net.exec_argv(bed.net.hosts[0], argv))
    operators = {h.name: [e.name for e in catalog.list_backups(bed.cfg(h.name).backup.dir, cfg=bed.cfg(h.name))
                          if e.complete and e.origin == "operator"] for h in bed.net.hosts}
    assert all(len(v) >= HOURLY for v in operators.values()), operators
    before = {h.name: breaks(bed, h.name) for h in bed.net.hosts}
    offsets = {h.name: log_size(bed, h.name) for h in bed.net.hosts}
    restore_by_hand(bed, snap, "es-by-hand")
    got = settle_and_count(bed, offsets, before, "after-restore-by-hand")
    for h in bed.net.hosts:
        still_there_and_one_chain(bed, h.name, operators[h.name], got[h.name])
        detected = [b for b in boundaries.read(bed.cfg(h.name).backup.dir) if b.kind == "detected"]
        assert detected, f"{h.name}: the restore by hand was not recorded as a boundary"
