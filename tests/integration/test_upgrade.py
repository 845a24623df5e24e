"""Rolling upgrade on real etcd: 3.4.23 (Debian's) -> 3.5.16 (Debian trixie's) -> 3.5.30 (Debian
sid's), one step per run, writes flowing; and restores across the releases afterwards.

One 3-member loopback cluster for the module, in this order: the refused long jump (nothing
touched), a forced failure (a "3.5.2" whose etcd exits at once) rolled back, the upgrade to
3.5.16 with a writer thread putting sequential keys throughout, a restore of the 3.4.23 backup
that upgrade took, the patch upgrade to 3.5.30, and a restore of the 3.5.16 backup onto it. The
agent.toml names 3.4.23's binaries throughout: the upgraded members run their version pins.
"""
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from etcd_agent.backup import catalog
from etcd_agent.cluster.health import cluster_health
from etcd_agent.cluster.upgrade import plan_upgrade, run_upgrade
from etcd_agent.config import load, with_local
from etcd_agent.errors import EtcdError, OperationFailed
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.member.local import LocalMember
from etcd_agent.member.process import ProcessBackend
from etcd_agent.restore.orchestrator.plan import BUMP_REVISION
from etcd_agent.state.pins import pin_path, read_pin
from tests.harness.loopback import LoopbackCluster
from tests.harness.releases import DEFAULT, LEGACY, NEWER, release

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
    for ver in (LEGACY, TARGET, NEWER):
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

    c = LoopbackCluster(d, 3, extra=f'[daemon]\nstate_dir = "{d}/state"\n', version=LEGACY)  # the upgrade's source
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


def who_serves(c):
    """Each member's etcd as the kernel sees it (pid, binary, parent, start time): what a failed
    version check prints, so a member restarted on the wrong release says who started it."""
    import psutil

    ports = {int(m.client_url.rsplit(":", 1)[1]): m.name for m in c.cfg.members}
    out = {}
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port in ports and conn.pid:
            try:
                p = psutil.Process(conn.pid)
                parent = p.parent()
                out[ports[conn.laddr.port]] = (p.pid, p.exe(), p.create_time(),
                                               parent.cmdline()[:6] if parent else None)
            except psutil.Error as exc:
                out[ports[conn.laddr.port]] = repr(exc)
    return out


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


def upgrade_with_writes(bed, source, target):
    """``upgrade --to target --yes`` with a writer putting sequential keys throughout; asserts every
    member moved, the leader last, each pinned, and no acknowledged write lost. The report."""
    acked, failed = [], []
    stop = threading.Event()
    prefix = f"/upgrade-writes-{target}/"

    def writer():
        with EtcdClient.from_config(bed.cfg, timeout=2.0) as cl:
            i = 0
            while not stop.is_set():
                key = f"{prefix}{i:07d}"
                try:
                    cl.put(key, str(i).encode())
                    acked.append(key)
                except EtcdError:
                    failed.append(key)
                i += 1
                time.sleep(0.005)

    assert set(versions_of(bed).values()) == {source}, who_serves(bed)
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        res = cli(bed, "--json", "upgrade", "--to", target, "--yes", "--timeout", "60")
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
    assert set(versions_of(bed).values()) == {target}
    for m in bed.cfg.members:
        assert read_pin(bed.cfg, m.name).version == target
        # a later start (daemon, reboot) resolves the pinned binary
        assert LocalMember(bed.cfg, m).cfg.etcd.binary.endswith(f"/{target}/etcd")
    with bed.client() as cl:
        missing = [k for k in acked if cl.get(k) is None]
        total = cl.count_prefix(prefix)
    assert acked and not missing, f"{len(missing)} acknowledged writes lost, e.g. {missing[:3]}"
    per = ", ".join(f"{s['name']} {s['seconds']:.1f}s" for s in steps)
    print(f"\nupgrade {source} -> {target}: {per}; whole run {took:.1f}s (backup {report['backups'][0]})")
    print(f"writes: {len(acked)} acknowledged, {len(failed)} refused while a member restarted, "
          f"{total} keys present, 0 acknowledged lost")
    return report


def test_rolling_upgrade_with_writes_flowing(bed):
    """The minor step every 3.4 cluster takes: 3.4.23 -> 3.5.16."""
    upgrade_with_writes(bed, LEGACY, TARGET)


def newest_backup_of(c, version):
    """The newest backup taken while the cluster ran ``version`` (the upgrade takes one first)."""
    found = [e for e in catalog.list_backups(c.cfg.backup.dir)
             if e.complete and (e.manifest or {}).get("etcd_version") == version]
    assert found, f"no backup of etcd {version} in {c.cfg.backup.dir}"
    return found[0]


def restore_across(bed, backup_version, running):
    """Restore the newest backup of ``backup_version`` onto the cluster now on ``running``:
    agent.toml still names 3.4.23's binaries; every member's version pin names ``running``."""
    b = newest_backup_of(bed, backup_version)
    with bed.client() as cl:
        for i in range(10):
            cl.put(f"/after-upgrade-to-{running}/{i}", b"x")
    plan = cli(bed, "restore", "--from", b.path, "--dry-run")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    # each host restores with its pinned release's etcdutl, so the revision is bumped
    argvs = [ln.strip() for ln in plan.stdout.splitlines() if ln.strip().startswith("$ ") and "snapshot restore" in ln]
    assert len(argvs) == 3 and all(a.startswith(f"$ {bed.dir}/versions/{running}/etcdutl snapshot restore ") for a in argvs), argvs
    assert all(a.endswith("--mark-compacted --skip-hash-check") for a in argvs) and "revision bumped by" in plan.stdout, plan.stdout
    assert bed.cfg.etcd.binary.endswith(f"/{LEGACY}/etcd") and bed.cfg.etcd.etcdutl is None  # agent.toml unchanged
    t0 = time.monotonic()
    res = cli(bed, "restore", "--from", b.path, "--yes")
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    # the restored members run the pinned release, not agent.toml's 3.4.23
    assert set(versions_of(bed).values()) == {running}, who_serves(bed)
    print(f"\nafter the restore: {who_serves(bed)}")
    with bed.client() as cl:
        assert cl.get("/seed") == b"1" and cl.count_prefix(f"/after-upgrade-to-{running}/") == 0
        revs = {cl.status(m.client_url).revision for m in bed.cfg.members}
    assert len(revs) == 1 and min(revs) > b.revision + BUMP_REVISION, (revs, b.revision)
    print(f"\nFIGURE cross-version restore: backup of etcd {backup_version} (revision {b.revision}) onto the "
          f"cluster upgraded to {running}: exit 0 in {took:.1f}s, members on {sorted(set(versions_of(bed).values()))}, "
          f"revision {min(revs)} (bumped by {running}'s etcdutl); {argvs[0][:60]}...")


def test_restore_a_backup_of_the_old_release_after_the_upgrade(bed):
    """The common case after an upgrade: the newest good backup predates it (taken on 3.4.23 by
    the upgrade itself); the cluster now runs 3.5.16 from its pins."""
    restore_across(bed, LEGACY, TARGET)


def test_patch_upgrade_to_the_newer_release(bed):
    """Then a patch step on 3.5: 3.5.16 -> 3.5.30 (its etcdutl comes along in the pin)."""
    upgrade_with_writes(bed, TARGET, NEWER)
    for m in bed.cfg.members:
        assert read_pin(bed.cfg, m.name).etcdutl.endswith(f"/{NEWER}/etcdutl")


def test_restore_onto_the_newer_release(bed):
    """3.5.30 as a restore target: the 3.5.16 backup its upgrade took, restored onto it."""
    restore_across(bed, TARGET, NEWER)
