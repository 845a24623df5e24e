"""Rolling upgrade on real etcd: 3.4.23 (Debian's) -> 3.5.16 (Debian trixie's), writes flowing.

One 3-member loopback cluster for the module, in this order: the refused long jump (nothing
touched), a forced failure (a "3.5.2" whose etcd exits at once) rolled back, then the real
upgrade with a writer thread putting sequential keys throughout.
"""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from etcd_agent.cluster.health import cluster_health
from etcd_agent.cluster.upgrade import plan_upgrade, run_upgrade
from etcd_agent.config import load, with_local
from etcd_agent.errors import EtcdError, OperationFailed
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.member.local import LocalMember
from etcd_agent.member.process import ProcessBackend
from etcd_agent.state.pins import pin_path, read_pin
from tests.harness.loopback import LoopbackCluster
from tests.harness.releases import DEFAULT, LEGACY, release

pytestmark = pytest.mark.integration

FAKE_ETCD = """#!/bin/sh
# a broken "new release": reports a version, exits at once when started as a server
if [ "$1" = "--version" ]; then echo "etcd Version: 3.5.2"; echo "Git SHA: fake"; exit 0; fi
echo "fake etcd: refusing to start" >&2
exit 1
"""


TARGET = DEFAULT


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("upgrade"))
    versions = os.path.join(d, "versions")
    for ver in (LEGACY, TARGET):
        rel = release(ver)
        os.makedirs(os.path.join(versions, ver))
        for name in ("etcd", "etcdctl", "etcdutl"):
            target = getattr(rel, name)
            if target:
                os.symlink(target, os.path.join(versions, ver, name))
    os.makedirs(os.path.join(versions, "3.5.2"))
    fake = os.path.join(versions, "3.5.2", "etcd")
    with open(fake, "w") as fh:
        fh.write(FAKE_ETCD)
    os.chmod(fake, 0o755)

    legacy = release(LEGACY)  # the upgrade's source
    c = LoopbackCluster(d, 3, extra=f'[daemon]\nstate_dir = "{d}/state"\n', binary=legacy.etcd, etcdctl=legacy.etcdctl)
    with open(c.config_path) as fh:
        text = fh.read().replace("[etcd]\n", f'[etcd]\nversions_dir = "{versions}"\n', 1)
    with open(c.config_path, "w") as fh:
        fh.write(text)
    c.cfg = load(c.config_path)
    c.members = [LocalMember(with_local(c.cfg, m.name), m, ProcessBackend(c.cfg, m.name)) for m in c.cfg.members]
    try:
        c.start_static()
        with c.client() as cl:  # a cluster with data (a fresh one's snapshot reports revision 0)
            cl.put("/seed", b"1")
        yield c
    finally:
        c.stop()


def versions_of(c):
    with c.client() as cl:
        return {m.name: cl.status(m.client_url).version for m in c.cfg.members}


def cli(c, *args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "etcd_agent.cli.main", "-c", c.config_path, *args],
        capture_output=True, text=True, timeout=timeout,
    )


def test_refused_jump_prints_the_multi_hop_path(bed):
    res = cli(bed, "upgrade", "--to", "3.6.0", "--dry-run")
    assert res.returncode == 3, res.stderr
    assert f"{LEGACY} -> 3.5.26 -> 3.6.0" in res.stderr
    print(f"\nrefused jump (exit {res.returncode}):\n{res.stderr.strip()}")
    down = cli(bed, "upgrade", "--to", "3.3.0", "--dry-run")
    assert down.returncode == 3 and "downgrade" in down.stderr
    assert set(versions_of(bed).values()) == {LEGACY}


def test_dry_run_prints_plan_followers_first(bed):
    res = cli(bed, "--json", "upgrade", "--to", TARGET, "--dry-run")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)["plan"]
    order = plan["hops"][0]["order"]
    assert order[-1] == plan["leader"] and len(order) == 3
    assert any(f"reports {TARGET}" in c for c in plan["checks"])


def test_failed_member_is_rolled_back_and_upgrade_stops(bed):
    with bed.client() as cl:
        plan = plan_upgrade(bed.cfg, "3.5.2", cl)
        first = plan.order(plan.hops[0].members)[0]
        with pytest.raises(OperationFailed) as err:
            run_upgrade(bed.cfg, plan, cl, step_timeout=30, health_timeout=30)
        assert "rolled back" in err.value.message and first in err.value.message
        ok, problems = cluster_health(bed.cfg, cl)
        assert ok, problems
    assert set(versions_of(bed).values()) == {LEGACY}
    assert not os.path.exists(pin_path(bed.cfg, first))
    with open(os.path.join(bed.cfg.daemon.state_dir, "upgrade.json")) as fh:
        assert json.load(fh)["state"] == "failed"
    print(f"\nforced failure: {err.value.message}")


def test_rolling_upgrade_with_writes_flowing(bed):
    acked, failed = [], []
    stop = threading.Event()

    def writer():
        with EtcdClient.from_config(bed.cfg, timeout=2.0) as cl:
            i = 0
            while not stop.is_set():
                key = f"/upgrade-writes/{i:07d}"
                try:
                    cl.put(key, str(i).encode())
                    acked.append(key)
                except EtcdError:
                    failed.append(key)
                i += 1
                time.sleep(0.005)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        res = cli(bed, "--json", "upgrade", "--to", TARGET, "--yes", "--timeout", "60")
        took = time.monotonic() - t0
        time.sleep(1.0)
    finally:
        stop.set()
        t.join(10)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    steps = report["plan"]["hops"][0]["steps"]
    assert [s["outcome"] for s in steps] == ["upgraded"] * 3
    assert steps[-1]["name"] == report["plan"]["leader"]
    assert set(versions_of(bed).values()) == {TARGET}
    for m in bed.cfg.members:
        assert read_pin(bed.cfg, m.name)["version"] == TARGET
        # a later start (daemon, reboot) resolves the pinned binary
        assert LocalMember(bed.cfg, m).cfg.etcd.binary.endswith(f"/{TARGET}/etcd")
    with bed.client() as cl:
        missing = [k for k in acked if cl.get(k) is None]
        total = cl.count_prefix("/upgrade-writes/")
    assert not missing, f"{len(missing)} acknowledged writes lost, e.g. {missing[:3]}"
    per = ", ".join(f"{s['name']} {s['seconds']:.1f}s" for s in steps)
    print(f"\nupgrade {LEGACY} -> {TARGET}: {per}; whole run {took:.1f}s (backup {report['backups'][0]})")
    print(f"writes: {len(acked)} acknowledged, {len(failed)} refused while a member restarted, "
          f"{total} keys present, 0 acknowledged lost")
    assert shutil.which("etcd")
