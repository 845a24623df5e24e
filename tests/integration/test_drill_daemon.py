"""Scheduled restore drills on real etcd 3.5.16: one master at a time under the etcd lock.

Two "masters" m1 and m2 of a 3-member loopback cluster, each with a config of its own (state dir,
backup dir, drill dir, metrics) as two hosts would have. First as real daemon processes; then the
same schedulers in-process on a fake wall clock, to walk the schedule over days in seconds.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from typing import Dict, Iterator, List

import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.config import Config, load
from etcd_agent.daemon.metrics import samples
from etcd_agent.drill import record as drillrecord
from etcd_agent.drill.schedule import RECORD_KEY, DrillScheduler
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.waiting import NotYet, poll
from tests.harness.loopback import LoopbackCluster, free_port_pairs

pytestmark = pytest.mark.integration

B = "/opt/etcd/3.5.16"


@pytest.fixture
def drill_root() -> Iterator[str]:
    root = f"/var/tmp/etcd-agent-drill-tests/{secrets.token_hex(4)}"
    yield root
    shutil.rmtree(root, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(root))  # the shared parent, once no other test's dir is in it
    except OSError:
        pass


def host_configs(c: LoopbackCluster, root: str, names: List[str], every: float,
                 ports: Dict[str, int]) -> Dict[str, str]:
    """One agent.toml per master, as if each ran on its own host."""
    base = open(c.config_path).read()
    out = {}
    for n in names:
        text = base.replace(f'dir = "{c.dir}/backups"', f'dir = "{c.dir}/backups-{n}"')
        daemon = f'state_dir = "{c.dir}/state-{n}"\ninterval = 1.0\nlock_ttl = 10'
        if n in ports:
            daemon += f'\nmetrics_address = "127.0.0.1:{ports[n]}"'
        text = text.replace(f'state_dir = "{c.dir}/state"', daemon)
        text += (f'[local]\nname = "{n}"\n[drill]\nevery = {every}\ndir = "{root}/{n}"\nuser = "etcd"\n'
                 f'sample_keys = 20\ntimeout = 300\nmetrics_file = "{root}/{n}.prom"\n')
        path = os.path.join(c.dir, f"agent-{n}.toml")
        with open(path, "w") as fh:
            fh.write(text)
        out[n] = path
    return out


def cluster(factory) -> LoopbackCluster:
    c = factory(3)
    c.start_static()
    with c.client() as cl:
        for i in range(200):
            cl.put(f"/registry/k{i:04d}", os.urandom(100))
    return c


def record(cfg: Config) -> Dict:
    with EtcdClient.from_config(cfg, timeout=3.0) as cl:
        raw = cl.get(RECORD_KEY)
    return json.loads(raw) if raw else {}


def test_two_daemons_make_one_drill(cluster_factory, drill_root):
    c = cluster(cluster_factory)
    (p1, p2), = free_port_pairs(1)  # two free ports for the metrics endpoints
    paths = host_configs(c, drill_root, ["m1", "m2"], 3600, {"m1": p1, "m2": p2})
    cfgs = {n: load(p) for n, p in paths.items()}
    for n, cfg in cfgs.items():
        take_backup(cfg, member=n)  # each master has backups of its own
    procs = {}
    for n, p in paths.items():
        log = open(os.path.join(c.dir, f"daemon-{n}.log"), "wb")
        procs[n] = subprocess.Popen([sys.executable, "-m", "etcd_agent.cli.main", "-c", p, "run"],
                                    stdout=log, stderr=subprocess.STDOUT)
    try:
        rec = poll(lambda: record(c.cfg), timeout=90, what="the first scheduled drill", interval=0.5)
        assert rec["ok"] is True, rec
        winner, loser = rec["host"], ({"m1", "m2"} - {rec["host"]}).pop()
        time.sleep(5)  # five more cycles of each daemon: no second drill within the period

        def scrape(n: str) -> Dict[str, float]:
            port = p1 if n == "m1" else p2
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3).read().decode()
            got = {name: v for name, labels, v in samples(text) if name.startswith("etcd_agent_restore_drill")}
            if "etcd_agent_restore_drill_runs_total" not in got:
                raise NotYet("no drill metrics yet")
            return got

        won = poll(lambda: scrape(winner) if scrape(winner)["etcd_agent_restore_drill_runs_total"] == 1 else None,
                   timeout=30, what="the winner's metrics", interval=0.5, transient=(OSError,))
        lost = poll(lambda: scrape(loser), timeout=30, what="the loser's metrics", interval=0.5, transient=(OSError,))
        assert record(c.cfg)["at"] == rec["at"]  # still the one drill
    finally:  # a daemon of the process backend stops its member with it: etcd is gone after this
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
    states = {n: drillrecord.load_state(cfg) for n, cfg in cfgs.items()}
    assert states[winner].runs == 1 and states[loser].runs == 0, states
    assert won["etcd_agent_restore_drill_last_result"] == 1.0
    assert won["etcd_agent_restore_drill_last_success_timestamp_seconds"] == pytest.approx(rec["at"])
    assert "etcd_agent_restore_drill_last_success_timestamp_seconds" not in lost
    assert lost["etcd_agent_restore_drill_runs_total"] == 0
    with open(os.path.join(c.dir, f"daemon-{winner}.log")) as fh:
        wlog = fh.read()
    assert "restore drill due (no drill of this cluster is recorded)" in wlog
    assert "restore drill of etcd-" in wlog and "passed in" in wlog
    print(f"\nFIGURE two daemons: {winner} drilled {rec['backup']} in {rec['duration']:.2f}s; {loser} did not "
          f"(its log: {'lock busy' if 'restore drill skipped' in open(os.path.join(c.dir, f'daemon-{loser}.log')).read() else 'saw the record'})")


class FakeWallClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.t, timezone.utc)

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def test_the_schedule_over_days_one_master_at_a_time(cluster_factory, drill_root):
    """Two schedulers ticking together on one fake clock: each period exactly one drill, by
    whichever takes the lock; none between periods."""
    c = cluster(cluster_factory)
    paths = host_configs(c, drill_root, ["m1", "m2"], 86400, {})
    cfgs = {n: load(p) for n, p in paths.items()}
    for n, cfg in cfgs.items():
        take_backup(cfg, member=n)
    clock = FakeWallClock(time.time())
    scheds = {n: DrillScheduler(clock=clock) for n in cfgs}

    def tick_all() -> List[str]:
        started = [n for n, s in scheds.items() if s.tick(cfgs[n], n)]
        poll(lambda: not any(s.running for s in scheds.values()), timeout=120, what="the drills", interval=0.2)
        return started

    def runs() -> int:
        return sum(drillrecord.load_state(cfg).runs for cfg in cfgs.values())

    try:
        started = tick_all()
        assert len(started) == 2  # both found one due at once ...
        assert runs() == 1  # ... and one drilled: the other found the lock held, or the record new
        first = record(c.cfg)
        for hours, want in ((1, 1), (12, 1), (23.9, 1), (24.1, 2), (30, 2), (48.2, 3)):
            clock.t = first["at"] + hours * 3600
            tick_all()
            assert runs() == want, (hours, [s.last_outcome for s in scheds.values()])
        last = record(c.cfg)
        assert last["at"] == pytest.approx(first["at"] + 48.2 * 3600) and last["ok"] is True
    finally:
        for s in scheds.values():
            s.stop()
