"""Defrag and NOSPACE on real etcd: a fragmented db shrinks with the cluster serving writes
throughout; a member over its quota raises NOSPACE, which `alarms --disarm` clears."""
import json
import subprocess
import sys
import threading
import time

import pytest

from etcd_agent.cluster.health import cluster_health
from etcd_agent.cluster.maintenance import defrag, fragmentation
from etcd_agent.errors import EtcdError
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.topology import static_bootstrap

pytestmark = pytest.mark.integration

VALUE = b"x" * 64 * 1024


def cli(c, *args):
    return subprocess.run([sys.executable, "-m", "etcd_agent.cli.main", "-c", c.config_path, *args],
                          capture_output=True, text=True, timeout=180)


def fragment(cl, n):
    """Overwrite one key n times, then compact: the old revisions become free pages."""
    for _ in range(n):
        cl.put("/frag/big", VALUE)
    rev = cl.status(cl.endpoints[0]).revision
    cl.compact(rev)


def test_defrag_shrinks_fragmented_db_while_writes_succeed(cluster_factory):
    c = cluster_factory(3, extra="[maintenance]\ndefrag_min_db_bytes = 1048576\ndefrag_threshold_percent = 50.0\n")
    c.start_static()
    with c.client() as cl:
        fragment(cl, 150)
        deadline = time.monotonic() + 15  # freed pages show in db_size_in_use after the next commit
        while True:
            before = {m.name: cl.status(m.client_url) for m in c.cfg.members}
            if all(fragmentation(s) > 0.5 for s in before.values()) or time.monotonic() > deadline:
                break
            cl.put("/frag/tick", b"1")
            time.sleep(0.3)
    assert all(fragmentation(s) > 0.5 for s in before.values()), {n: fragmentation(s) for n, s in before.items()}

    dry = cli(c, "--json", "defrag", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert all(m["defrag"] for m in json.loads(dry.stdout)["members"])

    failures, writes = [], [0]
    stop = threading.Event()

    def writer():
        with EtcdClient.from_config(c.cfg, timeout=3.0) as w:
            i = 0
            while not stop.is_set():
                try:
                    w.put(f"/during-defrag/{i}", b"v")
                    writes[0] += 1
                except EtcdError as exc:
                    failures.append(exc.message)
                i += 1
                time.sleep(0.01)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        with c.client() as cl:
            items = defrag(c.cfg, cl)
            ok, problems = cluster_health(c.cfg, cl)
    finally:
        stop.set()
        t.join(10)
    assert ok, problems
    assert not failures, failures[:3]
    assert items[-1].leader and all(i.defrag for i in items)
    for it in items:
        assert it.size_after < it.db_size / 2, it.to_json()
        print(f"\n{it.name}{' (leader)' if it.leader else ''}: db {it.db_size} -> {it.size_after} bytes "
              f"({it.fragmentation:.0%} fragmented) in {it.seconds:.2f}s", end="")
    print(f"\nwrites during defrag: {writes[0]} ok, {len(failures)} failed")

    again = cli(c, "--json", "defrag", "--dry-run")
    assert not any(m["defrag"] for m in json.loads(again.stdout)["members"])


def test_nospace_alarm_detected_and_cleared(cluster_factory):
    c = cluster_factory(1)
    lm = c.members[0]
    lm.render(static_bootstrap(c.cfg, lm.member))
    # a tiny quota, appended to the rendered EnvironmentFile the process backend reads
    with open(c.cfg.conf_file(lm.member.name), "a") as fh:
        fh.write("ETCD_QUOTA_BACKEND_BYTES=2097152\n")
    lm.backend.start()
    lm.wait_healthy(30)
    with c.client() as cl:
        for _i in range(200):
            try:
                cl.put("/fill/big", VALUE)
            except EtcdError as exc:
                assert "space" in exc.message.lower(), exc.message
                break
        else:
            pytest.fail("etcd never raised NOSPACE")
        assert [k for _m, k in cl.alarms()] == ["NOSPACE"]

    listed = cli(c, "alarms")
    assert listed.returncode == 1 and "NOSPACE" in listed.stdout
    dry = cli(c, "alarms", "--disarm", "--dry-run")
    assert "would compact" in dry.stdout
    refused = cli(c, "alarms", "--disarm")  # no terminal to ask on, no --yes: refuse, touch nothing
    assert refused.returncode == 2 and "--yes" in refused.stderr
    res = cli(c, "--json", "alarms", "--disarm", "--yes")
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(res.stdout)
    assert rep["cleared"] and rep["alarms"][0]["alarm"] == "NOSPACE"
    print("\n" + "\n".join(rep["actions"]))
    with c.client() as cl:
        assert cl.alarms() == []
        cl.put("/fill/after", b"ok")  # writes accepted again
        ok, problems = cluster_health(c.cfg, cl)
    assert ok, problems


def test_daemon_auto_defrag(cluster_factory):
    """[maintenance] auto_defrag: the daemon's maintenance step defragments the fragmented
    members under the cluster-wide lock, and not again within MAINTENANCE_EVERY."""
    from etcd_agent.daemon.loop import MAINTENANCE_EVERY, Daemon

    c = cluster_factory(3, extra="[maintenance]\ndefrag_min_db_bytes = 1048576\nauto_defrag = true\n")
    c.start_static()
    with c.client() as cl:
        fragment(cl, 150)
        deadline = time.monotonic() + 15
        while not all(fragmentation(cl.status(m.client_url)) > 0.5 for m in c.cfg.members):
            assert time.monotonic() < deadline, "db never showed as fragmented"
            cl.put("/frag/tick", b"1")
            time.sleep(0.3)
        before = {m.name: cl.status(m.client_url).db_size for m in c.cfg.members}
    d = Daemon(c.config_path, member="m2", cfg=c.cfg)
    done = d.maintain(now=1000.0)
    assert done and done.count("defragmented") == 3, done
    with c.client() as cl:
        after = {m.name: cl.status(m.client_url).db_size for m in c.cfg.members}
    assert all(after[n] < before[n] / 2 for n in before), (before, after)
    assert d.maintain(now=1000.0 + MAINTENANCE_EVERY / 2) is None
    ok, problems = cluster_health(c.cfg, EtcdClient.from_config(c.cfg))
    assert ok, problems
