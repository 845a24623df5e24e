"""The daemon on real etcd (process backend, one daemon per member on loopback): bootstrap both
ways, heal a killed etcd, replace a member whose data dir vanished, stop cleanly."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from etcd_agent.cluster.status import cluster_status
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.waiting import poll
from tests.harness.loopback import LoopbackCluster

pytestmark = pytest.mark.integration


class Daemons:
    def __init__(self, cluster: LoopbackCluster):
        self.c = cluster
        self.procs = {}

    def start(self, name):
        log = open(os.path.join(self.c.dir, f"daemon-{name}.log"), "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "etcd_agent.cli.main", "-c", self.c.config_path, "run", "--member", name],
            stdout=log, stderr=subprocess.STDOUT,
        )

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def log(self, name):
        with open(os.path.join(self.c.dir, f"daemon-{name}.log")) as fh:
            return fh.read()


def wait_healthy(cfg, n, timeout=60):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        rows = cluster_status(cfg, timeout=1.0)
        if len(rows) == n and all(r.healthy for r in rows):
            return time.monotonic() - t0
        time.sleep(0.3)
    raise AssertionError(f"not healthy after {timeout}s: {[(r.name, r.errors) for r in cluster_status(cfg)]}")


@pytest.fixture
def daemons(tmp_path):
    made = []

    def make(bootstrap, cluster_extra=""):
        c = LoopbackCluster(str(tmp_path / bootstrap), 3, bootstrap=bootstrap, cluster_extra=cluster_extra,
                            extra=f'[daemon]\ninterval = 1.0\nlock_ttl = 10\nstate_dir = "{tmp_path}/{bootstrap}/state"\n')
        d = Daemons(c)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
        d.c.stop()  # any etcd a failed test left behind


@pytest.mark.parametrize("bootstrap", ["incremental", "static"])
def test_daemons_bootstrap_heal_and_replace(daemons, bootstrap):
    d = daemons(bootstrap)
    cfg = d.c.cfg
    t0 = time.monotonic()
    for m in ("m3", "m2", "m1"):  # seed last: the others must wait for it, not bootstrap alone
        d.start(m)
    wait_healthy(cfg, 3, 90)
    print(f"\n{bootstrap}: 3 daemons -> healthy cluster in {time.monotonic() - t0:.1f}s")
    with EtcdClient.from_config(cfg) as c:
        ids = {m.name: m.id for m in c.members()}
        c.put("/k", b"v")
    assert sorted(ids) == ["m1", "m2", "m3"]

    # a killed etcd comes back (the daemon restarts it on its data: same member id)
    victim = d.c.members[1].backend
    old_pid = victim.pid()
    victim.kill()
    t = time.monotonic()
    while victim.pid() in (None, old_pid) and time.monotonic() - t < 60:
        time.sleep(0.1)
    wait_healthy(cfg, 3, 60)
    assert victim.pid() not in (None, old_pid)
    print(f"{bootstrap}: killed etcd back to healthy in {time.monotonic() - t:.1f}s")
    with EtcdClient.from_config(cfg) as c:
        assert {m.name: m.id for m in c.members()}["m2"] == ids["m2"]

    # a lost data dir: the member is removed, re-added and rejoins with a new id; no key lost
    lost = d.c.members[2]
    shutil.rmtree(lost.data_dir)
    t = time.monotonic()
    deadline = t + 60
    while time.monotonic() < deadline:
        with EtcdClient.from_config(cfg, timeout=1.0) as c:
            try:
                now = {m.name: m.id for m in c.members()}
            except Exception:
                now = {}
        if now.get("m3") not in (None, ids["m3"]) and len(now) == 3:
            break
        time.sleep(0.3)
    wait_healthy(cfg, 3, 60)
    print(f"{bootstrap}: lost data dir -> member replaced and healthy in {time.monotonic() - t:.1f}s")
    with EtcdClient.from_config(cfg) as c:
        members = {m.name: m.id for m in c.members()}
        assert members["m3"] != ids["m3"], "member was not replaced"
        assert c.get("/k") == b"v"
    log = d.log("m3")
    assert "-> replace: " in log and "stale member" in log and "joined as" in log, log

    d.stop()
    assert not any(lm.backend.is_active() for lm in d.c.members), "daemon stop left etcd running"


def test_a_static_member_whose_daemon_starts_late_joins_the_forming_cluster_not_replaced(daemons):
    """Static bootstrap, m1's daemon started only once m2 and m3 formed the cluster (quorum):
    etcd lists m1 by its --initial-cluster name although it never ran (no client URLs). Taken as
    started, m1 was "replaced" (member remove, member add, a new id): a full backup taken meanwhile
    held two members, and a restore of it was refused (CI 46: test_pitr, test_bucket_disaster_ssh).
    It starts with state=new on its bootstrap id instead."""
    d = daemons("static")
    cfg = d.c.cfg
    for m in ("m2", "m3"):
        d.start(m)

    def two_healthy():
        rows = {r.name: r.healthy for r in cluster_status(cfg, timeout=1.0)}
        return rows.get("m2") and rows.get("m3")

    poll(two_healthy, timeout=90, what="m2 and m3 forming the static cluster", interval=0.3)
    with EtcdClient.from_config(cfg) as c:
        listed = {m.name: m for m in c.members()}
    assert "m1" in listed and not listed["m1"].client_urls, listed  # named by the bootstrap, never ran
    assert not listed["m1"].started
    d.start("m1")
    wait_healthy(cfg, 3, 90)
    with EtcdClient.from_config(cfg) as c:
        now = {m.name: m.id for m in c.members()}
    assert now["m1"] == listed["m1"].id, "m1 was replaced (a new member id) instead of starting on its bootstrap one"
    log = d.log("m1")
    assert "-> replace" not in log and "starting with state=new" in log, log


def test_daemon_respects_leave_until_join(daemons):
    """`leave` with the daemon still running: the daemon must not bring the member back by
    itself; `join` hands it back to the daemon."""
    d = daemons("static")
    cfg = d.c.cfg
    for m in ("m1", "m2", "m3"):
        d.start(m)
    wait_healthy(cfg, 3, 90)
    base = [sys.executable, "-m", "etcd_agent.cli.main", "-c", d.c.config_path]
    res = subprocess.run(base + ["leave", "--member", "m3", "--yes"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    time.sleep(5)  # five daemon cycles
    with EtcdClient.from_config(cfg) as c:
        assert sorted(m.name for m in c.members()) == ["m1", "m2"]
    assert "left the cluster on purpose" in d.log("m3")
    res = subprocess.run(base + ["join", "--member", "m3"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    wait_healthy(cfg, 3, 60)
    time.sleep(3)  # and the daemon keeps it (no fight over the member it now sees running)
    with EtcdClient.from_config(cfg) as c:
        assert sorted(m.name for m in c.members()) == ["m1", "m2", "m3"]


def test_daemons_join_as_learners_then_promote(daemons):
    """[cluster] learner_joins: each joining member is added as a learner, started, and promoted
    once caught up; the cluster ends with three voters."""
    d = daemons("incremental", cluster_extra="learner_joins = true")
    cfg = d.c.cfg
    for m in ("m1", "m2", "m3"):
        d.start(m)
    wait_healthy(cfg, 3, 120)
    with EtcdClient.from_config(cfg) as c:
        members = c.members()
    assert sorted(m.name for m in members) == ["m1", "m2", "m3"]
    assert not any(m.is_learner for m in members)
    # the daemon logs the join once its member is healthy, a moment after the cluster says so
    for m in ("m2", "m3"):
        poll(lambda m=m: "joined as learner" in d.log(m), timeout=30, what=f"{m}'s daemon logging its learner join")


def test_the_process_backend_notices_its_etcd_exit_at_once(tmp_path):
    """The daemon is etcd's parent (process backend): a killed etcd is restarted as soon as it
    exits, not at the next cycle. The cycle here is 10 minutes, so only the exit notice can bring
    it back within the wait below (the seconds it takes: bench/heal_bench.py)."""
    c = LoopbackCluster(str(tmp_path / "c"), 3, bootstrap="static",
                        extra=f'[daemon]\ninterval = 600.0\nlock_ttl = 10\nstate_dir = "{tmp_path}/c/state"\n')
    d = Daemons(c)
    try:
        for m in ("m1", "m2", "m3"):
            d.start(m)
        wait_healthy(c.cfg, 3, 90)
        victim = c.members[1].backend
        old_pid = victim.pid()
        assert old_pid is not None
        poll(lambda: "watching etcd pid" in d.log("m2"), timeout=30, what="m2's daemon watching its etcd",
             interval=0.2)
        os.kill(old_pid, signal.SIGKILL)  # its parent, the daemon, reaps it
        poll(lambda: victim.pid() not in (None, old_pid), timeout=60, what="m2's etcd started again", interval=0.1)
        wait_healthy(c.cfg, 3, 60)
        log = d.log("m2")
        assert f"etcd pid {old_pid} exited" in log and "restarting it" in log, log
        # and it watches the new one: a second kill is noticed too (past the pacing of one early
        # restart per cycle only when the first was a cycle ago, so this one waits: not asserted)
        new_pid = victim.pid()
        poll(lambda: f"watching etcd pid {new_pid}" in d.log("m2"), timeout=30, what="the new etcd watched",
             interval=0.2)
    finally:
        d.stop()
        c.stop()
