"""Restore drills against real etcd 3.5.16 on loopback: the command, what it proves, a corrupt
backup, the metrics and the listing.

The live members run as the test's user (their dirs are under pytest's 0700 temp root); each
drill's throwaway etcd runs as ``etcd`` ([drill] user) in a dir under /var/tmp it can reach.
"""
from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
from typing import Dict, Iterator, List

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from etcd_agent.backup import catalog
from etcd_agent.backup.service import take_backup
from etcd_agent.config import Config
from etcd_agent.drill import record as drillrecord
from etcd_agent.drill.run import run_drill
from etcd_agent.etcd.client import EtcdClient
from tests.harness.loopback import LoopbackCluster, orphan_etcd

pytestmark = pytest.mark.integration

B = "/opt/etcd/3.5.16"
AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
if not all(os.access(f"{B}/{t}", os.X_OK) for t in ("etcd", "etcdctl", "etcdutl")):  # pragma: no cover
    pytest.fail(f"etcd 3.5.16 is not installed in {B} (packaging/install-deps.sh test)", pytrace=False)


@pytest.fixture
def drill_root() -> Iterator[str]:
    """A parent for drill dirs the etcd user can traverse (pytest's temp root is 0700)."""
    root = f"/var/tmp/etcd-agent-drill-tests/{secrets.token_hex(4)}"
    yield root
    shutil.rmtree(root, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(root))  # the shared parent, once no other test's dir is in it
    except OSError:
        pass


def drill_extra(root: str, name: str = "d", sample: int = 25, every: float = 0.0) -> str:
    return (f'[drill]\ndir = "{root}/{name}"\nuser = "etcd"\nsample_keys = {sample}\nevery = {every}\n'
            f'metrics_file = "{root}/{name}.prom"\ntimeout = 300\n')


def make_cluster(factory, root: str, n: int = 1, **kw) -> LoopbackCluster:
    c = factory(n, extra=drill_extra(root, **kw))
    c.start_static()
    return c


def fill(cfg: Config) -> None:
    """Keys of every kind a drill must get right: puts, overwrites, deletes, a compaction, a lease,
    a large value."""
    with EtcdClient.from_config(cfg, timeout=10.0) as cl:
        for i in range(300):
            cl.put(f"/registry/pods/ns/p{i:04d}", os.urandom(200))
        for i in range(0, 300, 3):
            cl.put(f"/registry/pods/ns/p{i:04d}", b"rewritten")
        for i in range(0, 300, 10):
            cl.delete(f"/registry/pods/ns/p{i:04d}")
        cl.put("/registry/configmaps/big", os.urandom(900_000))
        rev = cl.status(cfg.members[0].client_url).revision
        cl.compact(rev - 50)
        kv = cl._kv_client()
        lease = kv.lease(600)
        kv.put("/registry/masterleases/10.0.0.1", b"x", lease=lease)


def prom(path: str) -> Dict[str, float]:
    with open(path) as fh:
        return {s.name: s.value for f in text_string_to_metric_families(fh.read()) for s in f.samples if not s.labels}


def agent(cfg_path: str, *args: str) -> "subprocess.CompletedProcess[str]":
    return subprocess.run([AGENT, "-c", cfg_path, *args], capture_output=True, text=True, timeout=300)


def etcd_processes_in(directory: str) -> List[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cwd", "name"]):
        try:
            if (p.info["cwd"] or "").startswith(directory) and (p.info["name"] or "").startswith("etcd"):
                out.append(p)
        except psutil.Error:
            continue
    return out


def test_drill_restores_as_etcd_at_low_priority_and_proves_the_backup(cluster_factory, drill_root):
    """In-process, to look at the throwaway member while it runs: its user, priority, ports."""
    c = make_cluster(cluster_factory, drill_root)
    fill(c.cfg)
    take_backup(c.cfg, member="m1")  # it also stores the manifest key in etcd: one key more
    with EtcdClient.from_config(c.cfg) as cl:
        live = cl.count_prefix("/")
    seen: Dict[str, object] = {}
    my_nice = psutil.Process().nice()

    def progress(step: str) -> None:
        if step == "reading the restored member":
            procs = etcd_processes_in(os.path.join(drill_root, "d"))
            assert len(procs) == 1, procs
            p = procs[0]
            seen.update(uid=p.uids().real, nice=p.nice(), ioclass=p.ionice().ioclass,
                        ports=sorted(a.laddr.port for a in p.net_connections("tcp") if a.status == "LISTEN"),
                        addrs={a.laddr.ip for a in p.net_connections("tcp") if a.status == "LISTEN"},
                        gomaxprocs=p.environ().get("GOMAXPROCS"))

    report = run_drill(c.cfg, progress=progress)
    assert report.ok, report.lines()
    print("\n".join(report.lines()))
    assert seen["uid"] == pwd.getpwnam("etcd").pw_uid
    assert seen["nice"] == 10 and seen["ioclass"] == psutil.IOPRIO_CLASS_IDLE and seen["gomaxprocs"] == "1"
    assert seen["addrs"] == {"127.0.0.1"}
    live_port = int(c.cfg.members[0].client_url.rsplit(":", 1)[1])
    assert live_port not in seen["ports"]  # type: ignore[operator]
    # what it served is what the live cluster had when the backup was taken
    assert report.keys == live and report.leases == 1 and report.sample == 25
    assert report.run_as == "etcd" and report.etcd_version == "3.5.16"
    assert "exactly the keys the snapshot file holds" in (report.proved or "")
    assert any("sha256 matches the manifest" in c for c in report.checked)
    assert any(c.startswith("`snapshot status`") for c in report.checked)
    assert any("key-space digest" in c for c in report.checked)
    # nothing left: no etcd, no scratch dir, no staged copy (only the host's drill lock file)
    assert etcd_processes_in(os.path.join(drill_root, "d")) == []
    assert os.listdir(os.path.join(drill_root, "d")) == [".drill.lock"]
    # the caller's priority is put back
    assert psutil.Process().nice() == my_nice


def test_drill_command_metrics_and_listing(cluster_factory, drill_root):
    c = make_cluster(cluster_factory, drill_root)
    fill(c.cfg)
    path = take_backup(c.cfg, member="m1").path
    metrics = os.path.join(drill_root, "d.prom")

    res = agent(c.config_path, "drill")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"restore drill of {os.path.basename(path)}: PASSED in ")
    assert "\n  proved: " in res.stdout and "as etcd served revision" in res.stdout
    assert "drill: restoring and starting etcd" in res.stderr  # progress on stderr
    m = prom(metrics)
    print(f"\nFIGURE loopback drill: {m['etcd_agent_restore_drill_last_duration_seconds']:.2f}s "
          f"(metrics: last_result {m['etcd_agent_restore_drill_last_result']:.0f}, "
          f"runs {m['etcd_agent_restore_drill_runs_total']:.0f}, failures {m['etcd_agent_restore_drill_failures_total']:.0f})")
    assert m["etcd_agent_restore_drill_last_result"] == 1.0 and m["etcd_agent_restore_drill_failures_total"] == 0
    first = m["etcd_agent_restore_drill_last_success_timestamp_seconds"]
    with open(metrics) as fh:
        assert f'etcd_agent_restore_drill_backup_info{{backup="{os.path.basename(path)}"' in fh.read()

    # the listing says which backup was drilled, when and how it went; --json carries it too
    lst = agent(c.config_path, "backup", "list")
    assert lst.returncode == 0, lst.stderr
    assert "drilled 20" in lst.stdout and "restored and checked in" in lst.stdout
    assert "verified (drill," in lst.stdout
    data = json.loads(agent(c.config_path, "--json", "backup", "list").stdout)
    assert data["backups"][0]["drill"]["ok"] is True and data["backups"][0]["drill"]["keys"] > 0
    # the drill is the cluster's last one, in etcd: the daemons' schedule counts it
    with EtcdClient.from_config(c.cfg) as cl:
        rec = json.loads(cl.get("/etcd-agent/drill/last") or b"{}")
    assert rec["backup"] == os.path.basename(path) and rec["ok"] is True and rec["host"] == "m1"

    # --json, and --from as restore --from resolves it
    j = agent(c.config_path, "--json", "drill", "--from", os.path.basename(path))
    assert j.returncode == 0, j.stderr
    rep = json.loads(j.stdout)
    assert rep["ok"] and rep["backup"] == os.path.basename(path) and rep["run_as"] == "etcd"
    m2 = prom(metrics)
    assert m2["etcd_agent_restore_drill_runs_total"] == 2 and m2["etcd_agent_restore_drill_last_success_timestamp_seconds"] > first
    bad = agent(c.config_path, "drill", "--from", "1999-01-01")
    assert bad.returncode == 2 and "no good backup from 1999-01-01" in bad.stderr
    assert prom(metrics)["etcd_agent_restore_drill_runs_total"] == 2  # a usage error is not a drill


def test_a_corrupted_backup_fails_says_why_and_moves_the_failure_metric(cluster_factory, drill_root):
    c = make_cluster(cluster_factory, drill_root)
    fill(c.cfg)
    older = take_backup(c.cfg, member="m1").path
    assert agent(c.config_path, "drill").returncode == 0
    metrics = os.path.join(drill_root, "d.prom")
    before = prom(metrics)
    import time

    time.sleep(1.1)  # the next backup's name is the next second's
    newest = take_backup(c.cfg, member="m1", prune=False).path
    # one flipped byte in the snapshot, as bit rot on the backup disk would do
    with open(newest, "r+b") as fh:
        fh.seek(600_000)
        b = fh.read(1)
        fh.seek(600_000)
        fh.write(bytes([b[0] ^ 0x01]))

    res = agent(c.config_path, "drill")
    assert res.returncode == 1
    head = res.stdout.splitlines()[0]
    print(f"\nFIGURE corrupt backup: {head}")
    assert head.startswith(f"restore drill of {os.path.basename(newest)}: FAILED after ")
    assert "while reading the archive: the archive is bad: etcd_snapshot.db: sha256" in head
    assert "restore drill of" in res.stderr and "failed while reading the archive" in res.stderr  # logged, one sentence
    after = prom(metrics)
    print(f"FIGURE corrupt backup metrics: failures_total {before['etcd_agent_restore_drill_failures_total']:.0f} -> "
          f"{after['etcd_agent_restore_drill_failures_total']:.0f}, last_result "
          f"{before['etcd_agent_restore_drill_last_result']:.0f} -> {after['etcd_agent_restore_drill_last_result']:.0f}, "
          f"last_failure_timestamp_seconds set: {'etcd_agent_restore_drill_last_failure_timestamp_seconds' in after}")
    assert after["etcd_agent_restore_drill_failures_total"] == before["etcd_agent_restore_drill_failures_total"] + 1
    assert after["etcd_agent_restore_drill_last_result"] == 0.0
    assert after["etcd_agent_restore_drill_last_failure_timestamp_seconds"] >= before[
        "etcd_agent_restore_drill_last_success_timestamp_seconds"]
    # what the last success proved stays exported
    assert after["etcd_agent_restore_drill_last_success_timestamp_seconds"] == before[
        "etcd_agent_restore_drill_last_success_timestamp_seconds"]
    # the reader refused its bytes: quarantined, so `latest` (and restore --from latest) passes it over
    entries = {e.name: e for e in drillrecord.with_drills(catalog.list_backups(c.cfg.backup.dir, cfg=c.cfg),
                                                          c.cfg.backup.dir)}
    bad = entries[os.path.basename(newest)]
    assert not bad.complete and "sha256" in (bad.problem or "")
    assert bad.drill is not None and not bad.drill.ok
    assert catalog.latest(list(entries.values()))[0].name == os.path.basename(older)
    lst = agent(c.config_path, "backup", "list").stdout
    assert "QUARANTINED" in lst and "drill FAILED" in lst
    # the next drill of latest takes the good one again
    assert agent(c.config_path, "drill").returncode == 0


def test_a_failure_of_etcd_is_not_held_against_the_backup(cluster_factory, drill_root, tmp_path):
    c = make_cluster(cluster_factory, drill_root)
    fill(c.cfg)
    path = take_backup(c.cfg, member="m1").path
    text = open(c.config_path).read().replace(f'binary = "{B}/etcd"', f'binary = "{tmp_path}/no-such-etcd"')
    broken = tmp_path / "broken.toml"
    broken.write_text(text)
    res = agent(str(broken), "drill")
    assert res.returncode == 1
    assert "while restoring and starting etcd: cannot run" in res.stdout.splitlines()[0]
    listing = drillrecord.with_drills(catalog.list_backups(c.cfg.backup.dir, cfg=c.cfg), c.cfg.backup.dir)
    entry = {e.name: e for e in listing}[os.path.basename(path)]
    assert entry.drill is not None and not entry.drill.ok  # the drill failed, and the listing says so ...
    assert entry.complete and entry.verified  # ... but the file is as good as its last check said
    assert not drillrecord.load_records(c.cfg.backup.dir)[entry.name].ok
    assert prom(os.path.join(drill_root, "d.prom"))["etcd_agent_restore_drill_last_result"] == 0.0


def test_no_good_backup_is_a_failed_drill(cluster_factory, drill_root):
    c = make_cluster(cluster_factory, drill_root)
    res = agent(c.config_path, "drill")
    assert res.returncode == 1 and "no good backup in" in res.stdout
    assert prom(os.path.join(drill_root, "d.prom"))["etcd_agent_restore_drill_failures_total"] == 1


def test_a_second_drill_on_the_host_is_busy_and_a_dead_drill_is_swept(cluster_factory, drill_root):
    from etcd_agent.state.locks import OperationLock

    c = make_cluster(cluster_factory, drill_root)
    fill(c.cfg)
    take_backup(c.cfg, member="m1")
    d = os.path.join(drill_root, "d")
    os.makedirs(d, mode=0o711, exist_ok=True)
    with OperationLock(os.path.join(d, ".drill.lock"), "drill"):
        res = agent(c.config_path, "drill")
    assert res.returncode == 4 and "busy" in res.stderr
    # what a drill killed with -9 leaves: a scratch dir with its etcd still running in it
    left = os.path.join(d, "etcd-scratch-dead")
    orphan = orphan_etcd(left, f"{B}/etcd")
    try:
        res = agent(c.config_path, "drill")
        assert res.returncode == 0, res.stdout + res.stderr
        assert orphan.wait(20) is not None
        assert not os.path.exists(left)
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait(10)


def test_a_zstd_backup_drills_like_a_plain_one(cluster_factory, drill_root):
    """A .tar.zst (several zstd frames, written in one pass) restores and is held against its
    signed revision; its writer ran no `snapshot status` (the stream is checked), and the drill says so."""
    c = cluster_factory(1, extra='compression = "zstd"\n' + drill_extra(drill_root))
    c.start_static()
    fill(c.cfg)
    path = take_backup(c.cfg, member="m1").path
    assert path.endswith(".tar.zst")
    report = run_drill(c.cfg)
    assert report.ok, report.lines()
    assert any(line.startswith("revision ") and "is the one the signed manifest claims" in line
               for line in report.checked), report.checked
    assert any("the writer recorded no `snapshot status`" in line for line in report.not_proven), report.not_proven


def test_a_runbook_tarball_after_a_delete_and_a_compaction(cluster_factory, drill_root, tmp_path):
    """No manifest (made by hand: `etcdctl snapshot save` + `tar czf`), the newest revision a
    delete, compacted at it: checked from the content alone, and said so."""
    c = make_cluster(cluster_factory, drill_root)
    with EtcdClient.from_config(c.cfg) as cl:
        for i in range(20):
            cl.put(f"/registry/k{i}", b"v%d" % i)
        cl.delete("/registry/k19")
        rev = cl.status(c.cfg.members[0].client_url).revision
        cl.compact(rev)
    work = tmp_path / "runbook"
    work.mkdir()
    env = dict(os.environ, ETCDCTL_API="3")
    subprocess.run([f"{B}/etcdctl", f"--endpoints={c.cfg.members[0].client_url}", "snapshot", "save",
                    str(work / "etcd_snapshot.db")], check=True, capture_output=True, env=env)
    (work / "etcd.conf").write_text("ETCD_NAME=m1\n")
    (work / "etcd.service").write_text("[Service]\nExecStart=/usr/bin/etcd\n")
    name = "etcd-2026-01-01.tar"  # gzip in a .tar name, as `tar czf` by hand makes it
    os.makedirs(c.cfg.backup.dir, mode=0o700, exist_ok=True)
    subprocess.run(["tar", "czf", os.path.join(c.cfg.backup.dir, name), "-C", str(work), "etcd.conf", "etcd.service",
                    "etcd_snapshot.db"], check=True)
    res = agent(c.config_path, "drill", "--from", name)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"as etcd served revision {rev} with 19 keys" in res.stdout
    assert "no manifest, so no signed claim to hold them against" in res.stdout
    assert "the bytes are the ones etcd's own sha256 trailer covers (nothing proves who wrote them)" in res.stdout


def test_a_drill_of_an_encrypted_backup_takes_the_identity_and_says_what_it_needs(cluster_factory, drill_root,
                                                                                  tmp_path):
    """The masters hold only public keys: the drill of an encrypted backup decrypts it with
    --identity; without one it fails saying so (the daemon's scheduled drill too), with a wrong
    one it is refused; never a traceback."""
    from etcd_agent.drill.schedule import DrillScheduler
    from tests.integration.test_backup_age import keypair

    keyfile, recipient = keypair(tmp_path, "ops.key")
    wrong, _ = keypair(tmp_path, "wrong.key")
    c = cluster_factory(1, extra=f'encrypt_to = ["{recipient}"]\n' + drill_extra(drill_root))
    c.start_static()
    fill(c.cfg)
    path = take_backup(c.cfg, member="m1").path
    name = os.path.basename(path)

    res = agent(c.config_path, "drill")
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    assert res.returncode == 1, (res.stdout, res.stderr)
    head = res.stdout.splitlines()[0]
    print(f"\nFIGURE encrypted drill, no key: exit 1: {head}")
    assert f"restore drill of {name}: FAILED" in head and "its snapshot is encrypted (age, to 1 recipient(s): age1" in head
    assert "--identity FILE" in head

    res = agent(c.config_path, "drill", "--identity", wrong)
    assert "Traceback" not in res.stderr + res.stdout and res.returncode == 3, (res.stdout, res.stderr)
    print(f"FIGURE encrypted drill, wrong key: exit 3: {res.stderr.strip().splitlines()[-1]}")
    assert "none of the 1 key in identity file" in res.stderr

    res = agent(c.config_path, "drill", "--identity", keyfile)
    assert res.returncode == 0, (res.stdout, res.stderr)
    print(f"FIGURE encrypted drill, with the key: {res.stdout.splitlines()[0]}")
    assert res.stdout.startswith(f"restore drill of {name}: PASSED in ")
    assert f"decrypted with {keyfile}" in res.stdout and "as etcd served revision" in res.stdout
    assert prom(os.path.join(drill_root, "d.prom"))["etcd_agent_restore_drill_last_result"] == 1.0
    assert not [n for n in os.listdir(os.path.join(drill_root, "d")) if n != ".drill.lock"]  # nothing left staged

    # the daemon's scheduled drill: no key, one sentence saying what it needs, recorded as the cluster's
    sched = DrillScheduler()
    report = sched._drill(c.cfg)
    assert not report.ok and "its snapshot is encrypted" in (report.problem or "")
    assert "--identity FILE" in (report.problem or "")
