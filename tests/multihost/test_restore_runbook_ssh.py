"""Restore what operators actually have, and trust nothing a tarball says - over real SSH.

Three namespace hosts eb1..eb3 (10.213.10.11-13) with sshd, each with its own agent.toml
(``tests/harness/restorebed.py``); the operator's command runs on one master (its namespace, its
hostname), which drives itself locally and the other two over SSH. Real etcd 3.4.23, etcdctl and
tar; no mocks.

- runbook tarballs made by hand exactly as the manual runbook does (``etcdctl snapshot save`` then
  ``tar czf etcd-2019-08-07.tar ...``: gzip in a ``.tar`` name; a plain tar; one with only the
  snapshot and the conf, ``./``-prefixed), each restored with ``restore --from NAME --yes`` from
  the backup dir of the master it is run on;
- ``--json restore --dry-run``: one JSON document on stdout, progress on stderr only;
- a copy of a backup with two bytes changed is not verified in ``backup list``;
- foreign snapshots refused before anything stops, in agent-format tarballs whose manifests
  (one validly signed with this cluster's key) simply lack ``cluster`` and ``members``;
- a runbook tarball of another cluster layout refused (exit 3, naming --new-cluster) before
  anything stops, then restored on purpose with ``--new-cluster``.

Two clusters other than ours run first and are snapshotted: one with this bed's member names
and peer URLs but its own token (so other member ids), one of another layout on loopback inside
eb1. The tests build on each other in file order, like an operator's session.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import time
from datetime import datetime, timezone
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from etcd_agent import __version__
from etcd_agent.backup.archive import FileInfo, write_archive
from etcd_agent.backup.keys import read_key_file
from etcd_agent.backup.manifest import FileEntry, Manifest
from etcd_agent.etcd.snapdb import SnapshotIdentity
from tests.harness.restorebed import (
    ETCD,
    ETCDCTL,
    RestoreBed,
    copy_into,
    counts,
    every_member,
    put_many,
    restore_bed,
    revisions,
    wait_healthy,
)

pytestmark = pytest.mark.multihost

PREFIX, SUBNET = "eb", "10.213.10"
KEYS = 5_000
RUNBOOK = "etcd-2019-08-07.tar"


class Snapshots:
    """The snapshots of the two other clusters, taken before ours started."""

    same_layout = ""  # our names and peer URLs, another token: other member ids
    other_layout = ""  # other names and peer URLs (loopback inside eb1)
    other_conf = ""


SNAPS = Snapshots()


def _wait_ctl(bed: RestoreBed, endpoints: str, timeout: float = 60) -> None:
    h1 = bed.h(1)
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(bed.net.exec_argv(h1, [ETCDCTL, f"--endpoints={endpoints}", "endpoint", "health"]),
                              capture_output=True, text=True, timeout=30, env=dict(os.environ, ETCDCTL_API="3"))
        if proc.returncode == 0:
            return
        assert time.monotonic() < deadline, proc.stderr
        time.sleep(0.3)


def _other_clusters(bed: RestoreBed) -> None:
    """Run two clusters that are not ours, snapshot each with etcdctl, stop them, remove their data."""
    work = os.path.join(bed.work, "others")
    os.makedirs(work, mode=0o700)
    hosts = bed.net.hosts
    # 1. this bed's layout (names, peer URLs), its own token: what a cluster rebuilt elsewhere
    #    with the same addresses looks like
    initial = ",".join(f"{h.name}=http://{h.ip}:2380" for h in hosts)
    procs = []
    for h in hosts:
        argv = [ETCD, "--name", h.name, "--data-dir", f"{work}/{h.name}.etcd",
                "--listen-peer-urls", f"http://{h.ip}:2380", "--initial-advertise-peer-urls", f"http://{h.ip}:2380",
                "--listen-client-urls", f"http://{h.ip}:2379", "--advertise-client-urls", f"http://{h.ip}:2379",
                "--initial-cluster", initial, "--initial-cluster-token", "eb-elsewhere",
                "--initial-cluster-state", "new"]
        procs.append(bed.net.popen(h, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    eps = ",".join(f"http://{h.ip}:2379" for h in hosts)
    _wait_ctl(bed, eps)
    put_many(bed.cfg(), "/elsewhere/", 200)  # the same client URLs as ours will be
    SNAPS.same_layout = os.path.join(work, "same-layout.db")
    bed.ctl(bed.h(1), "snapshot", "save", SNAPS.same_layout, endpoint=f"http://{hosts[0].ip}:2379")
    # 2. another layout: three members on eb1's loopback
    ports = [(23791 + 10 * i, 23792 + 10 * i) for i in range(3)]
    initial = ",".join(f"ops{i + 1}=http://127.0.0.1:{p}" for i, (_c, p) in enumerate(ports))
    for i, (c, p) in enumerate(ports):
        argv = [ETCD, "--name", f"ops{i + 1}", "--data-dir", f"{work}/ops{i + 1}.etcd",
                "--listen-peer-urls", f"http://127.0.0.1:{p}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
                "--listen-client-urls", f"http://127.0.0.1:{c}", "--advertise-client-urls", f"http://127.0.0.1:{c}",
                "--initial-cluster", initial, "--initial-cluster-token", "ops-cluster", "--initial-cluster-state", "new"]
        procs.append(bed.net.popen(hosts[0], argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    ep = f"http://127.0.0.1:{ports[0][0]}"
    _wait_ctl(bed, ep)
    for i in range(20):
        bed.ctl(bed.h(1), "put", f"/ops/{i:03d}", "theirs", endpoint=ep)
    SNAPS.other_layout = os.path.join(work, "other-layout.db")
    bed.ctl(bed.h(1), "snapshot", "save", SNAPS.other_layout, endpoint=ep)
    SNAPS.other_conf = (f"ETCD_NAME=ops1\nETCD_DATA_DIR={work}/ops1.etcd\n"
                        f"ETCD_LISTEN_PEER_URLS=http://127.0.0.1:{ports[0][1]}\n"
                        f"ETCD_LISTEN_CLIENT_URLS=http://127.0.0.1:{ports[0][0]}\n"
                        f"ETCD_INITIAL_CLUSTER={initial}\nETCD_INITIAL_CLUSTER_TOKEN=ops-cluster\n")
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(30)
    for d in os.listdir(work):
        if d.endswith(".etcd"):
            shutil.rmtree(os.path.join(work, d))


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestoreBed]:
    t = time.monotonic()
    with restore_bed(tmp_path_factory, PREFIX, SUBNET, before_start=_other_clusters) as b:
        print(f"\n[figure] runbook bed: two other clusters snapshotted, ours up, in {time.monotonic() - t:.1f}s")
        yield b


@pytest.fixture(scope="module")
def taken(bed: RestoreBed) -> Dict[str, Any]:
    """Our data, an agent backup on eb1 (it also creates the cluster's manifest key) and the
    runbook's snapshot, saved by hand on eb1; then keys written after both."""
    cfg = bed.cfg()
    t = time.monotonic()
    put_many(cfg, "/k/", KEYS)
    print(f"\n[figure] runbook bed: {KEYS} keys put in {time.monotonic() - t:.1f}s")
    backup = bed.backup()
    # the runbook, by hand, on eb1: snapshot save, the conf and unit as the agent rendered them
    hand = os.path.join(bed.work, "by-hand")
    os.makedirs(hand, mode=0o700)
    bed.ctl(bed.h(1), "snapshot", "save", "etcd_snapshot.db", cwd=hand)
    shutil.copyfile(cfg.conf_file("eb1"), os.path.join(hand, "etcd.conf"))
    r = bed.agent(bed.h(1), "--json", "render")
    assert r.returncode == 0, r.stderr
    with open(os.path.join(hand, "etcd.service"), "w") as fh:
        fh.write(json.loads(r.stdout)["unit"])
    put_many(cfg, "/later/", 300)
    return {"backup": backup, "hand": hand}


def unchanged(bed: RestoreBed) -> Tuple[Dict[str, Any], Dict[str, Tuple[int, int]], List[str]]:
    return bed.pids(), bed.inodes(), bed.data_listing()


def check_restored(bed: RestoreBed, res: "subprocess.CompletedProcess[str]", later: str) -> Dict[str, int]:
    """Our keys back on every member, the keys written after the snapshot gone, one revision."""
    assert res.returncode == 0, res.stdout + res.stderr
    cfg = bed.cfg()
    wait_healthy(cfg, 30)
    revs = revisions(cfg)
    assert len(set(revs.values())) == 1, revs
    served = every_member(cfg, "/k/", "/later/", later)
    assert all(v == [KEYS, 0, 0] for v in served.values()), served
    for m in cfg.members:
        assert bed.journal(m.name).get("state") == "done"
        assert "etcd_snapshot.db" not in bed.work_files(m.name)
    return revs


def test_runbook_gzip_in_a_tar_name(bed: RestoreBed, taken: Dict[str, Any]) -> None:
    h1 = bed.h(1)
    bed.sh(h1, ["tar", "czf", RUNBOOK, "etcd.conf", "etcd.service", "etcd_snapshot.db"], cwd=taken["hand"])
    bed.sh(h1, ["mv", os.path.join(taken["hand"], RUNBOOK), bed.backup_dir(h1)])
    with open(os.path.join(bed.backup_dir(h1), RUNBOOK), "rb") as fh:
        assert fh.read(2) == b"\x1f\x8b"  # gzip inside, whatever the name says
    before = unchanged(bed)
    res = bed.agent(h1, "restore", "--from", RUNBOOK, "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "a runbook tarball (made by hand, no manifest)" in res.stdout
    assert "format: gzip-compressed tar (magic 1f8b), read from the content" in res.stdout
    assert res.stderr.count("pre-check ok") == 3, res.stderr
    print("\n--- FIGURE restore --from etcd-2019-08-07.tar --dry-run (runbook, gzip in a .tar name; run on eb1) ---\n"
          + res.stdout + "--- end of dry run ---")
    assert unchanged(bed) == before, "a dry run changes nothing"
    put_many(bed.cfg(), "/later1/", 50)
    t = time.monotonic()
    res = bed.agent(h1, "restore", "--from", RUNBOOK, "--yes")
    wall = time.monotonic() - t
    revs = check_restored(bed, res, "/later1/")
    print(f"\n[figure] runbook gzip-in-.tar restored from eb1 over SSH: exit {res.returncode}, wall {wall:.1f}s, "
          f"every member {KEYS} keys, 0 later keys, revision {sorted(set(revs.values()))}")
    print("\n".join(line for line in res.stderr.splitlines() if "done in" in line))


def test_json_dry_run_is_one_document(bed: RestoreBed, taken: Dict[str, Any]) -> None:
    res = bed.agent(bed.h(1), "--json", "restore", "--from", RUNBOOK, "--dry-run")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)  # the whole of stdout: exactly one document
    assert isinstance(doc, dict) and doc["done"] is False and doc["plan"]["kind"] == "runbook"
    assert [h["member"] for h in doc["plan"]["hosts"]] == ["eb1", "eb2", "eb3"]
    assert " restore: " not in res.stdout and res.stderr.count("pre-check ok") == 3
    progress = [line for line in res.stderr.splitlines() if " restore: " in line]
    assert progress and not any(line.lstrip().startswith(("{", "}")) for line in res.stderr.splitlines()), res.stderr
    print(f"\n[figure] --json restore --dry-run: stdout one JSON document of {len(res.stdout)} bytes "
          f"(keys {sorted(doc)}), stderr {len(progress)} progress lines")


def test_runbook_plain_tar_from_another_master(bed: RestoreBed, taken: Dict[str, Any]) -> None:
    h2 = bed.h(2)
    name = "etcd-2019-08-07-plain.tar"
    bed.sh(h2, ["tar", "cf", name, "etcd.conf", "etcd.service", "etcd_snapshot.db"], cwd=taken["hand"])
    bed.sh(h2, ["mv", os.path.join(taken["hand"], name), bed.backup_dir(h2)])
    put_many(bed.cfg(), "/later2/", 50)
    t = time.monotonic()
    res = bed.agent(h2, "restore", "--from", name, "--yes")
    wall = time.monotonic() - t
    revs = check_restored(bed, res, "/later2/")
    print(f"\n[figure] runbook plain tar restored from eb2 (eb2 local, eb1/eb3 over SSH): exit 0, wall {wall:.1f}s, "
          f"revision {sorted(set(revs.values()))}")


def test_runbook_snapshot_and_conf_only_dot_slash(bed: RestoreBed, taken: Dict[str, Any]) -> None:
    h3 = bed.h(3)
    bed.sh(h3, ["tar", "cf", "x.tar", "./etcd_snapshot.db", "./etcd.conf"], cwd=taken["hand"])
    bed.sh(h3, ["mv", os.path.join(taken["hand"], "x.tar"), bed.backup_dir(h3)])
    listed = subprocess.run(["tar", "tf", os.path.join(bed.backup_dir(h3), "x.tar")], capture_output=True,
                            text=True, check=True).stdout.split()
    assert listed == ["./etcd_snapshot.db", "./etcd.conf"], listed
    put_many(bed.cfg(), "/later3/", 50)
    t = time.monotonic()
    res = bed.agent(h3, "restore", "--from", "x.tar", "--yes")
    wall = time.monotonic() - t
    revs = check_restored(bed, res, "/later3/")
    print(f"\n[figure] runbook ./etcd_snapshot.db + ./etcd.conf only, restored from eb3: exit 0, wall {wall:.1f}s, "
          f"revision {sorted(set(revs.values()))}")


def test_backup_copy_with_two_bytes_changed_is_not_verified(bed: RestoreBed, taken: Dict[str, Any]) -> None:
    h1 = bed.h(1)
    orig = taken["backup"]["path"]
    copy = copy_into(orig, bed.backup_dir(h1), "etcd-2019-08-07-12-00-00.tar")
    with tarfile.open(copy) as t:
        snap = t.getmember("etcd_snapshot.db")
        at = snap.offset_data + snap.size // 2  # in the key pages: listing reads only meta and member pages
    with open(copy, "r+b") as fh:
        for off in (at, at + 4096):
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 0xFF]))
    res = bed.agent(h1, "--json", "backup", "list")
    assert res.returncode == 0, res.stderr
    listed = {b["name"]: b for b in json.loads(res.stdout)["backups"]}
    o, c = listed[os.path.basename(orig)], listed[os.path.basename(copy)]
    assert o["verified"] is True and c["verified"] is False, (o, c)
    assert c["check"].startswith("unchecked"), c
    text = bed.agent(h1, "backup", "list").stdout
    # restoring it anyway: caught as it is shipped, before anything stops
    before = unchanged(bed)
    put_many(bed.cfg(), "/later4/", 20)
    res = bed.agent(h1, "restore", "--from", os.path.basename(copy), "--yes")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "nothing stopped" in res.stderr, res.stderr
    assert sum("rolled back: etcd left running: its data dir was never touched" in line
               for line in res.stderr.splitlines() if line.startswith("  - ")) == 3, res.stderr
    after = unchanged(bed)
    assert after[0] == before[0], f"etcd pids changed: {before[0]} -> {after[0]}"
    assert after[1:] == before[1:]
    assert every_member(bed.cfg(), "/later4/") == {m.name: [20] for m in bed.cfg().members}
    shipped_err = [line for line in res.stderr.splitlines() if "error" in line or line.startswith("  - ")]
    r = bed.agent(h1, "backup", "verify", os.path.basename(copy))
    assert r.returncode == 1, r.stdout
    print(f"\n[figure] backup list over the real layout: {os.path.basename(orig)} verified={o['verified']}, "
          f"the copy with 2 bytes changed verified={c['verified']} ({c['check']}); "
          f"restore from it exit {res.returncode}, etcd pids and data dirs unchanged; verify exit {r.returncode}")
    print("backup list:\n" + text)
    print("restore from the changed copy:\n" + "\n".join(shipped_err))


def _agent_tarball(bed: RestoreBed, snapshot: str, name: str, key: Any) -> str:
    """An agent-format tarball around ``snapshot`` written by the agent's own writer, with a
    manifest that simply lacks ``cluster`` and ``members`` (every checksum consistent), signed
    with ``key`` when given. It claims to be eb1's, with eb1's conf and unit."""
    cfg = bed.cfg()
    h1 = bed.h(1)
    files = {"etcd.conf": open(cfg.conf_file("eb1"), "rb").read()}
    stamp = datetime.strptime(name[5:24], "%Y-%m-%d-%H-%M-%S").replace(tzinfo=timezone.utc)

    def build(infos: Dict[str, FileInfo], facts: Any, ident: SnapshotIdentity) -> Manifest:
        m = Manifest(files={n: FileEntry(i.size, i.sha256) for n, i in infos.items()}, name=name,
                     created=stamp.isoformat(), created_unix=int(stamp.timestamp()), host="eb1", member="eb1",
                     endpoint=cfg.member("eb1").client_url, revision=ident.revision, etcd_version="3.4.23",
                     agent_version=__version__, compression="none",
                     missing={"etcd.service": "not present on the host"},
                     snapshot={"page_size": facts.page_size, "pages": facts.high_water, "txid": facts.txid},
                     verified=True)
        return m.signed(key) if key is not None else m

    def chunks() -> Iterator[bytes]:
        with open(snapshot, "rb") as fh:
            while True:
                b = fh.read(1 << 20)
                if not b:
                    return
                yield b

    w = write_archive(bed.backup_dir(h1), name, chunks=chunks(), files=files, build_manifest=build,
                      mtime=int(stamp.timestamp()))
    with open(snapshot, "rb") as fh:
        assert w.sha256 == hashlib.sha256(fh.read()).hexdigest()
    return name


def test_foreign_snapshots_with_claimless_manifests_refused(bed: RestoreBed, taken: Dict[str, Any]) -> None:
    h1 = bed.h(1)
    key = read_key_file(os.path.join(h1.etc_dir, "etcd-agent", "manifest.key")).key
    assert key is not None, "the backup on eb1 cached the cluster's manifest key"
    cases = [
        (_agent_tarball(bed, SNAPS.same_layout, "etcd-2019-08-08-10-00-00.tar", key), "signed with our key",
         ["have this config's names and peer URLs but other member ids", "--new-cluster"]),
        (_agent_tarball(bed, SNAPS.other_layout, "etcd-2019-08-08-11-00-00.tar", None), "unsigned",
         ["another cluster layout", "--new-cluster"]),
    ]
    for name, how, want in cases:
        doc = json.loads(bed.agent(h1, "--json", "backup", "list").stdout)
        entry = {b["name"]: b for b in doc["backups"]}[name]
        before = unchanged(bed)
        t = time.monotonic()
        res = bed.agent(h1, "restore", "--from", name, "--yes")
        took = time.monotonic() - t
        assert res.returncode == 3, res.stdout + res.stderr
        for w in want:
            assert w in res.stderr, res.stderr
        assert "nothing touched" in res.stderr
        assert unchanged(bed) == before, "refused before anything stopped"
        assert all(bed.journal(m.name).get("state") != "running" for m in bed.cfg().members)
        print(f"\n[figure] foreign snapshot, manifest without cluster/members ({how}; listed "
              f"signature={entry['signature']} quarantined={entry['quarantined']}): restore exit {res.returncode} "
              f"in {took:.1f}s; etcd pids and data dir inodes unchanged on eb1..eb3")
        print("refusal:\n" + "\n".join(line for line in res.stderr.splitlines() if "error" in line or line.startswith("  - ")))
    assert every_member(bed.cfg(), "/k/", "/elsewhere/") == {m.name: [KEYS, 0] for m in bed.cfg().members}


def test_foreign_runbook_refused_then_new_cluster(bed: RestoreBed, taken: Dict[str, Any]) -> None:
    h1 = bed.h(1)
    other = os.path.join(bed.work, "by-hand-other")
    os.makedirs(other, mode=0o700)
    shutil.copyfile(SNAPS.other_layout, os.path.join(other, "etcd_snapshot.db"))
    with open(os.path.join(other, "etcd.conf"), "w") as fh:
        fh.write(SNAPS.other_conf)
    name = "etcd-2019-08-09.tar"
    bed.sh(h1, ["tar", "czf", name, "etcd.conf", "etcd_snapshot.db"], cwd=other)
    bed.sh(h1, ["mv", os.path.join(other, name), bed.backup_dir(h1)])
    before = unchanged(bed)
    t = time.monotonic()
    res = bed.agent(h1, "restore", "--from", name, "--yes")
    took = time.monotonic() - t
    assert res.returncode == 3, res.stdout + res.stderr
    assert "another cluster layout" in res.stderr and "--new-cluster" in res.stderr, res.stderr
    assert "nothing touched" in res.stderr
    assert unchanged(bed) == before
    print(f"\n[figure] runbook tarball of another cluster (ops1..ops3 on 127.0.0.1): restore exit {res.returncode} "
          f"in {took:.1f}s; etcd pids and data dir inodes unchanged")
    print("refusal:\n" + "\n".join(line for line in res.stderr.splitlines() if "error" in line or line.startswith("  - ")))
    t = time.monotonic()
    res = bed.agent(h1, "restore", "--from", name, "--new-cluster", "--yes")
    wall = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    cfg = bed.cfg()
    wait_healthy(cfg, 30)
    revs = revisions(cfg)
    assert len(set(revs.values())) == 1, revs
    served = every_member(cfg, "/ops/", "/k/")
    assert all(v == [20, 0] for v in served.values()), served
    assert counts(cfg, "/ops/")[0] == 20
    print(f"[figure] the same with --new-cluster: exit 0, wall {wall:.1f}s, every member serves the other "
          f"cluster's 20 keys and none of ours, revision {sorted(set(revs.values()))}")
