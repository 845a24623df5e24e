"""A restore with the daemon running on every member (loopback, process backend).

The restore stops etcd and moves data dirs on purpose; a daemon that "healed" that would restart
a member on the old data, or replace it. Each `node begin` writes a marker into the daemon's state
dir, so the daemons log a wait naming the op and both ways out, until `finish`/`rollback`. A
restore killed midway keeps them waiting (and `status` says so) until it is resumed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from etcd_agent.backup.service import BackupResult, take_backup
from etcd_agent.errors import BusyError
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.restore.host.facts import work_dir_for
from etcd_agent.state import markers
from tests.harness.loopback import LoopbackCluster
from tests.integration.test_daemon import Daemons, wait_healthy
from tests.integration.test_restore import AGENT, EXTRA, counts, put_many, revisions

pytestmark = pytest.mark.integration


@pytest.fixture
def daemons(tmp_path):  # type: ignore[no-untyped-def]
    made = []

    def make() -> Daemons:
        d = str(tmp_path / "c")
        c = LoopbackCluster(d, 3, bootstrap="static",
                            extra=EXTRA + f'[daemon]\ninterval = 1.0\nlock_ttl = 10\nstate_dir = "{d}/state"\n')
        ds = Daemons(c)
        made.append(ds)
        return ds

    yield make
    for ds in made:
        ds.stop()
        ds.c.stop()


def member_ids(c: LoopbackCluster) -> dict:
    with EtcdClient.from_config(c.cfg, timeout=2.0) as cl:
        return {m.name: m.id for m in cl.members()}


def agent(c: LoopbackCluster, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([AGENT, "-c", c.config_path, *args], capture_output=True, text=True, timeout=timeout)


def backup_when_free(c: LoopbackCluster) -> BackupResult:
    """The test's backup, once the host's lock is free: each daemon's delta supervisor takes a
    full backup of its own as it starts (its chain's base), and one clean-clone run had the
    test's backup refused as busy by it (exit 4, the holder named: what an operator sees too)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return take_backup(c.cfg, member="m1")
        except BusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_daemons_wait_during_restore_and_after_a_crash(daemons) -> None:  # type: ignore[no-untyped-def]
    d = daemons()
    c = d.c
    for m in ("m1", "m2", "m3"):
        d.start(m)
    wait_healthy(c.cfg, 3, 90)
    put_many(c, "/k/", 2000)
    b = backup_when_free(c)
    put_many(c, "/later/", 50)

    # 1. an uninterrupted restore, daemons running: they wait while it runs, the data is the backup's
    t = time.monotonic()
    res = agent(c, "restore", "--from", b.path, "--yes")
    wall = time.monotonic() - t
    assert res.returncode == 0, res.stderr
    wait_healthy(c.cfg, 3, 30)
    assert counts(c, "/k/", "/later/") == [2000, 0]
    # a restore of 2.5 s may fall between one daemon's cycles; every daemon sees the marker of the
    # crashed restore below, which stays
    logs = {m: d.log(m) for m in ("m1", "m2", "m3")}
    assert any("is in progress on this host; hands off" in log and "etcd-agent restore rollback" in log
               for log in logs.values()), {m: log[-1000:] for m, log in logs.items()}
    for m, log in logs.items():
        assert " -> restart" not in log.split("is in progress")[-1], f"{m}'s daemon restarted etcd during the restore"
    assert markers.read_restores(c.cfg) == []
    ids = member_ids(c)
    time.sleep(3)  # three daemon cycles on the restored cluster: nobody replaced, nobody restarted
    assert member_ids(c) == ids
    wait_healthy(c.cfg, 3, 10)
    print(f"\nFIGURE restore with 3 daemons running: {wall:.2f}s")

    # 2. the orchestrator killed after m2's data was set aside: every daemon keeps waiting
    put_many(c, "/later/", 20)
    journal = os.path.join(work_dir_for(c.cfg.data_dir("m2"), "m2"), "journal.json")
    proc = subprocess.Popen([AGENT, "-c", c.config_path, "restore", "--from", b.path, "--yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with open(journal) as fh:
                    j = json.load(fh)
                if "aside" in j.get("steps", {}) and j.get("state") == "running":
                    break
            except (FileNotFoundError, ValueError):
                pass
            assert proc.poll() is None, "restore finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    op = j["op"]
    assert {r.member for r in markers.read_restores(c.cfg)} == {"m1", "m2", "m3"}
    marks = {m: os.path.getsize(d.c.dir + f"/daemon-{m}.log") for m in ("m1", "m2", "m3")}
    time.sleep(4)  # four cycles: without the marker every member would be restarted / replaced by now
    # The node call in flight when the orchestrator died still finishes its steps: that is the
    # restore's own work. When the kill came after the orchestrator had sent the start (the host's
    # members start in one call right after their prepare), the journals record that start; every
    # member without it must still be down.
    started = set()
    for m in ("m1", "m2", "m3"):
        with open(os.path.join(work_dir_for(c.cfg.data_dir(m), m), "journal.json")) as fh:
            if "start" in json.load(fh).get("steps", {}):
                started.add(m)
    down = [lm.member.name for lm in c.members if lm.member.name not in started]
    assert [lm.backend.pid() for lm in c.members if lm.member.name in down] == [None] * len(down), \
        f"a daemon started etcd during the crashed restore (the restore itself started {sorted(started)})"
    for m in ("m1", "m2", "m3"):
        with open(d.c.dir + f"/daemon-{m}.log") as fh:
            fh.seek(marks[m])
            after = fh.read()
        assert f"restore {op}" in after and f"restore --from {b.path} --yes" in after, after[-1500:]
        assert " -> restart" not in after and " -> replace" not in after and " -> join" not in after, after
    st = agent(c, "status")
    assert "RESTORE IN PROGRESS" in st.stdout and op in st.stdout and "restore rollback" in st.stdout, st.stdout

    # 3. the operator resumes: healthy on the backup's data, daemons back in charge
    t = time.monotonic()
    res = agent(c, "restore", "--from", b.path, "--yes")
    assert res.returncode == 0, res.stderr
    assert "(resuming)" in res.stderr or "already done" in res.stderr
    print(f"FIGURE resume of a crashed restore with daemons running: {time.monotonic() - t:.2f}s")
    wait_healthy(c.cfg, 3, 30)
    assert counts(c, "/k/", "/later/") == [2000, 0]
    assert len(set(revisions(c))) == 1
    assert markers.read_restores(c.cfg) == []
    assert "RESTORE IN PROGRESS" not in agent(c, "status").stdout
    ids = member_ids(c)
    time.sleep(3)
    assert member_ids(c) == ids
    wait_healthy(c.cfg, 3, 10)
