"""Both bootstrap modes (on 3.5.16 and on the 3.4.23 column), status with a dead member, and
client reconnects - on real etcd."""
import json
import os
import subprocess
import sys
import time

import pytest

from etcd_agent.cluster.status import cluster_status
from etcd_agent.errors import RefusedError
from etcd_agent.member.process import ProcessBackend
from etcd_agent.waiting import poll
from tests.harness.releases import DEFAULT, LEGACY

pytestmark = pytest.mark.integration
BOTH = pytest.mark.parametrize("version", [DEFAULT, LEGACY])


@BOTH
def test_static_bootstrap_three_members(cluster_factory, version):
    c = cluster_factory(3, bootstrap="static", version=version)
    t = time.monotonic()
    c.start_static()
    took = time.monotonic() - t
    with c.client() as cl:
        members = cl.members()
        assert sorted(m.name for m in members) == ["m1", "m2", "m3"]
        cl.put("k", b"v")
        for m in c.cfg.members:
            # a follower applies the put a moment after the leader acknowledged it
            poll(lambda m=m: cl.status(m.client_url).revision >= 2, timeout=10, what=f"{m.name} at revision 2")
        assert {cl.status(m.client_url).version for m in c.cfg.members} == {version}
    rows = cluster_status(c.cfg)
    assert all(r.healthy for r in rows)
    assert sum(1 for r in rows if r.leader) == 1
    print(f"static 3-member bootstrap on etcd {version} healthy in {took:.1f}s")


@BOTH
def test_incremental_bootstrap_follows_the_documented_walk(cluster_factory, version):
    c = cluster_factory(3, bootstrap="incremental", version=version)
    c.start_incremental()
    # what each member was started with is what the docs' infra0/1/2 walk-through says
    confs = {}
    for lm in c.members:
        with open(c.cfg.conf_file(lm.member.name)) as fh:
            confs[lm.member.name] = fh.read()
    m1, m2, m3 = c.cfg.members
    assert f"ETCD_INITIAL_CLUSTER={m1.name}={m1.peer_url}\n" in confs["m1"]
    assert "ETCD_INITIAL_CLUSTER_STATE=new" in confs["m1"]
    assert f"ETCD_INITIAL_CLUSTER={m1.name}={m1.peer_url},{m2.name}={m2.peer_url}\n" in confs["m2"]
    assert "ETCD_INITIAL_CLUSTER_STATE=existing" in confs["m2"]
    assert "ETCD_INITIAL_CLUSTER_STATE=existing" in confs["m3"]
    for m in (m1, m2, m3):
        assert f"{m.name}={m.peer_url}" in confs["m3"]
    with c.client() as cl:
        assert sorted(m.name for m in cl.members()) == ["m1", "m2", "m3"]
        assert {cl.status(m.client_url).version for m in c.cfg.members} == {version}
    assert all(r.healthy for r in cluster_status(c.cfg))


def test_join_is_idempotent_after_half_done_add(cluster_factory):
    """An earlier `member add` whose start never happened is reused, not added twice."""
    c = cluster_factory(2, bootstrap="incremental")
    c.members[0].start_seed()
    c.members[0].wait_healthy(30)
    with c.client() as cl:
        first = cl.add_member([c.cfg.members[1].peer_url])
        info = c.members[1].join(cl)
        assert info.id == first.id
        c.members[1].wait_healthy(30)
        assert len(cl.members()) == 2


def test_static_start_refuses_existing_member_data(cluster_factory):
    c = cluster_factory(1)
    c.start_static()
    c.members[0].backend.stop()
    with pytest.raises(RefusedError, match="already holds member data"):
        c.members[0].start_static()


def test_status_shows_a_dead_member_as_a_row(cluster_factory):
    c = cluster_factory(3)
    c.start_static()
    c.members[2].backend.kill()
    # if the killed member led, the other two elect a new leader first (about a second)
    deadline = time.monotonic() + 15
    while True:
        rows = cluster_status(c.cfg, timeout=1.0)
        by_name = {r.name: r for r in rows}
        if (by_name["m1"].healthy and by_name["m2"].healthy) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert by_name["m3"].reachable is False and by_name["m3"].errors
    assert by_name["m1"].healthy and by_name["m2"].healthy
    # the CLI: a table, exit 1, no traceback
    env = dict(os.environ)
    res = subprocess.run(
        [sys.executable, "-m", "etcd_agent.cli.main", "-c", c.config_path, "status", "--timeout", "1"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "ID", "ENDPOINT"]
    m3 = [line for line in lines if line.startswith("m3 ")][0]
    assert "not reachable" in m3
    assert f"last backup: none in {c.cfg.backup.dir}" in res.stdout
    res = subprocess.run(
        [sys.executable, "-m", "etcd_agent.cli.main", "-c", c.config_path, "--json", "status", "--timeout", "1"],
        capture_output=True, text=True, timeout=60,
    )
    doc = json.loads(res.stdout)
    assert doc["healthy"] is False
    assert doc["last_backup"] is None
    assert [m["reachable"] for m in doc["members"]] == [True, True, False]


def test_client_reconnects_after_its_etcd_restarts(cluster_factory):
    c = cluster_factory(1)
    c.start_static()
    lm = c.members[0]
    with c.client(timeout=1.0) as cl:
        cl.put("before", b"1")
        lm.backend.stop()
        t0 = time.monotonic()
        lm.start_existing()
        deadline = t0 + 30
        while True:
            try:
                cl.put("after", b"2")
                break
            except Exception:
                assert time.monotonic() < deadline, "client never recovered"
                time.sleep(0.1)
        took = time.monotonic() - t0
        assert cl.get("before") == b"1" and cl.get("after") == b"2"
    print(f"client recovered {took:.2f}s after etcd restart")
    assert took < 10


def test_process_backend_never_signals_a_stranger(cluster_factory, tmp_path):
    """A stale pid file naming an unrelated live process must not get it killed."""
    c = cluster_factory(1)
    backend = ProcessBackend(c.cfg, "m1")
    os.makedirs(backend.run_dir, exist_ok=True)
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        import psutil

        with open(backend.pid_file, "w") as fh:
            json.dump({"pid": stranger.pid, "create_time": psutil.Process(stranger.pid).create_time(), "binary": "/usr/bin/etcd"}, fh)
        assert backend.pid() is None
        backend.stop()
        assert stranger.poll() is None, "an unrelated process was signalled"
    finally:
        stranger.kill()
        stranger.wait()
