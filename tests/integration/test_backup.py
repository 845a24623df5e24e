"""Backups against a real etcd on free loopback ports: 3.5.16 (etcdutl checks the snapshot), and the
basic backup + verify on 3.4.23 as well (etcdctl checks it there)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Iterator

import pytest

from etcd_agent.backup import archive, catalog
from etcd_agent.backup.service import take_backup
from etcd_agent.backup.verify import verify
from etcd_agent.config import load
from etcd_agent.errors import BackupError
from etcd_agent.etcd.tools import snapshot_status
from etcd_agent.hosts.local import LocalHost
from tests.harness.loopback import free_port_pairs
from tests.harness.releases import DEFAULT, LEGACY, Release, release

pytestmark = pytest.mark.integration


def free_port() -> int:
    """A loopback port nobody listens on, outside the kernel's ephemeral range (see loopback.py)."""
    return free_port_pairs(1)[0][0]


class Etcd:
    """One single-member etcd of a release; stopped by PID."""

    def __init__(self, base: str, name: str, token: str, version: str = DEFAULT) -> None:
        self.name, self.token = name, token
        self.release: Release = release(version)
        etcd, etcdctl = self.release.etcd, self.release.etcdctl
        self.etcdctl = etcdctl
        self.client_port, self.peer_port = free_port(), free_port()
        self.client_url = f"http://127.0.0.1:{self.client_port}"
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.data_dir = os.path.join(base, f"{name}.etcd")
        self.log = open(os.path.join(base, f"{name}.log"), "wb")
        self.proc = subprocess.Popen(
            [
                etcd, f"--name={name}", f"--data-dir={self.data_dir}",
                f"--listen-client-urls={self.client_url}", f"--advertise-client-urls={self.client_url}",
                f"--listen-peer-urls={self.peer_url}", f"--initial-advertise-peer-urls={self.peer_url}",
                f"--initial-cluster={name}={self.peer_url}", f"--initial-cluster-token={token}",
                "--initial-cluster-state=new", "--quota-backend-bytes=4294967296",
            ],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited {self.proc.returncode}; see {self.log.name}")
            r = subprocess.run([etcdctl, f"--endpoints={self.client_url}", "endpoint", "health"],
                               capture_output=True, timeout=10)
            if r.returncode == 0:
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("etcd did not become healthy")

    def fill(self, megabytes: int) -> None:
        """Write ``megabytes`` x 1 MiB of incompressible values."""
        for i in range(megabytes):
            subprocess.run([self.etcdctl, f"--endpoints={self.client_url}", "put", f"/fill/{i:06d}"],
                           input=os.urandom(1 << 19).hex().encode()[: 1 << 20], check=True,
                           capture_output=True, timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def write_config(base: str, etcd: Etcd, backup_dir: str, **backup: object) -> str:
    conf = os.path.join(base, f"{etcd.name}.conf")
    if not os.path.exists(conf):
        with open(conf, "w") as fh:
            fh.write(f"ETCD_NAME={etcd.name}\nETCD_DATA_DIR={etcd.data_dir}\n")
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in backup.items())
    path = os.path.join(base, f"agent-{etcd.name}-{abs(hash((backup_dir, tuple(backup.items()))))}.toml")
    with open(path, "w") as fh:
        fh.write(f"""
[cluster]
name = "{etcd.name}"
token = "{etcd.token}"

[[member]]
name = "{etcd.name}"
host = "127.0.0.1"
client_url = "{etcd.client_url}"
peer_url = "{etcd.peer_url}"

[etcd]
{etcd.release.toml()}conf_file = "{conf}"
unit_file = "{base}/no-such-etcd.service"

[backup]
dir = "{backup_dir}"
{extra}""")
    return path


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="etcd-agent-backup-it-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd(base: str) -> Iterator[Etcd]:
    e = Etcd(base, "bk1", "tok-one")
    try:
        e.fill(40)  # ~40 MB db: big enough for kill -9 and concurrency to land mid-stream
        yield e
    finally:
        e.stop()


@pytest.fixture(scope="module")
def etcd_legacy(base: str) -> Iterator[Etcd]:
    """The 3.4 column: a smaller db, only the basic backup and verify run on it."""
    e = Etcd(base, "bk34", "tok-34", version=LEGACY)
    try:
        e.fill(4)
        yield e
    finally:
        e.stop()


@pytest.fixture(params=[DEFAULT, LEGACY])
def any_etcd(request: pytest.FixtureRequest) -> Etcd:
    return request.getfixturevalue("etcd" if request.param == DEFAULT else "etcd_legacy")


def cli(cfg_path: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "etcd_agent.cli.main", "-c", cfg_path, *args],
                          capture_output=True, text=True, timeout=timeout)


def status_fn(cfg_path: str):  # type: ignore[no-untyped-def]
    cfg = load(cfg_path)
    return lambda p: snapshot_status(LocalHost(), cfg, p)


def test_backup_then_verify_ok(base: str, any_etcd: Etcd) -> None:
    etcd = any_etcd
    bdir = os.path.join(base, f"b-ok-{etcd.name}")
    cfgp = write_config(base, etcd, bdir)
    r = cli(cfgp, "--json", "backup")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"path", "size", "revision", "sha256", "duration"}
    path = out["path"]
    assert archive.parse_name(os.path.basename(path)) is not None
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(bdir).st_mode & 0o777 == 0o700
    assert [n for n in os.listdir(bdir) if not n.startswith(".etcd-agent")] == [os.path.basename(path)]
    # GNU tar reads the patched header
    listing = subprocess.run(["tar", "-tvf", path], capture_output=True, text=True, check=True).stdout
    assert "etcd_snapshot.db" in listing and "manifest.json" in listing and "etcd.conf" in listing
    with tarfile.open(path) as tar:
        snap = tar.getmember("etcd_snapshot.db")
        assert snap.size == json.loads(tar.extractfile("manifest.json").read())["files"]["etcd_snapshot.db"]["size"]
    rep = verify(path, status_fn=status_fn(cfgp))
    assert rep.ok, rep.problems
    # our own stream-side revision equals what etcdctl snapshot status reads
    assert rep.status is not None and rep.status["revision"] == out["revision"]
    m = rep.manifest
    # no unit file on this host: the unit the agent would install is rendered in, and marked so
    assert m["missing"] == {}
    assert m["rendered"]["etcd.service"].startswith(f"{base}/no-such-etcd.service not found")
    with tarfile.open(path) as tar:
        assert b"ExecStart=" in tar.extractfile("etcd.service").read()
    assert m["members"][0]["peer_urls"] == [etcd.peer_url]
    assert m["cluster"]["id"] and m["etcd_version"] == etcd.release.version
    r = cli(cfgp, "backup", "verify", path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "match the running cluster" in r.stdout, r.stdout
    assert "manifest valid" in r.stdout.splitlines()[0], r.stdout  # signed with the key etcd now holds
    r = cli(cfgp, "--json", "backup", "list")
    listed = json.loads(r.stdout)["backups"]
    assert [b["name"] for b in listed] == [os.path.basename(path)] and listed[0]["verified"] is True
    assert catalog.resolve(bdir, "latest").path == path
    assert catalog.resolve(bdir, os.path.basename(path)[5:15]).path == path  # YYYY-MM-DD
    with pytest.raises(Exception, match="no good backup from 1999-01-01"):
        catalog.resolve(bdir, "1999-01-01")


@pytest.mark.parametrize("compression", ["zstd", "gzip"])
def test_compressed_backup_verifies(base: str, etcd: Etcd, compression: str) -> None:
    bdir = os.path.join(base, f"b-{compression}")
    cfgp = write_config(base, etcd, bdir, compression=compression)
    res = take_backup(load(cfgp))
    assert res.path.endswith(archive.EXTENSIONS[compression])
    rep = verify(res.path, status_fn=status_fn(cfgp))  # `snapshot status` runs here, not at write time
    assert rep.ok, rep.problems
    assert rep.manifest["revision"] == res.revision
    # zstd: several frames (one per 4 MiB of snapshot, plus the head's and the tail's); gzip: one
    # stream; either way the runbook's tar reads it, the manifest first
    flag = "--zstd" if compression == "zstd" else "-z"
    listing = subprocess.run(["tar", flag, "-tf", res.path], capture_output=True, text=True, check=True)
    names = listing.stdout.split()
    assert names[0] == "manifest.json" and names[-1] == "etcd_snapshot.db", names  # the manifest first
    # nothing else left beside it (gzip's spooled snapshot is gone)
    assert [n for n in os.listdir(bdir) if not n.startswith(".etcd-agent")] == [os.path.basename(res.path)]


def _one_backup(base: str, etcd: Etcd, sub: str) -> str:
    bdir = os.path.join(base, sub)
    return take_backup(load(write_config(base, etcd, bdir))).path


def test_verify_catches_flipped_byte(base: str, etcd: Etcd) -> None:
    path = _one_backup(base, etcd, "b-flip")
    with tarfile.open(path) as tar:
        at = tar.getmember("etcd_snapshot.db").offset_data + 5_000_000
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x01]))
    rep = verify(path)
    assert not rep.ok
    assert any("sha256 trailer does not match" in p for p in rep.problems), rep.problems


def test_verify_catches_truncation(base: str, etcd: Etcd) -> None:
    path = _one_backup(base, etcd, "b-trunc")
    with tarfile.open(path) as tar:
        m = tar.getmember("etcd_snapshot.db")
    cut = m.offset_data + m.size // 2
    os.truncate(path, cut)
    rep = verify(path)
    assert not rep.ok
    assert any(
        f"truncated: member 'etcd_snapshot.db' declares {m.size} bytes, only {m.size // 2} present "
        f"(archive ends at byte {cut})" in p
        for p in rep.problems
    ), rep.problems
    # listing / --from ignore it: no complete manifest
    e = catalog.list_backups(os.path.dirname(path))
    assert len(e) == 1 and not e[0].complete
    with pytest.raises(Exception, match="no good backup"):
        catalog.resolve(os.path.dirname(path), "latest")


def test_verify_catches_foreign_cluster(base: str, etcd: Etcd) -> None:
    other = Etcd(base, "bk2", "tok-two")
    try:
        foreign = _one_backup(base, other, "b-foreign")
    finally:
        other.stop()
    cfgp = write_config(base, etcd, os.path.join(base, "b-foreign"))
    r = cli(cfgp, "backup", "verify", foreign)
    assert r.returncode == 1
    assert "PROBLEM: the snapshot is of another cluster layout" in r.stdout, r.stdout


def test_two_concurrent_backups_one_busy(base: str, etcd: Etcd) -> None:
    bdir = os.path.join(base, "b-busy")
    cfgp = write_config(base, etcd, bdir, compression="zstd")
    first = subprocess.Popen([sys.executable, "-m", "etcd_agent.cli.main", "-c", cfgp, "backup"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_partial(bdir, first)  # the first holds the lock from here on
        # and is stopped mid-stream while the second runs: a one-pass backup of this db ends
        # sooner than a second CLI starts up
        os.kill(first.pid, signal.SIGSTOP)
        try:
            before = sorted(os.listdir(bdir))
            second = cli(cfgp, "backup", "--wait", "0")
            assert second.returncode == 4, second.stderr
            assert "busy" in second.stderr
            assert sorted(os.listdir(bdir)) == before  # the busy one touched nothing
        finally:
            os.kill(first.pid, signal.SIGCONT)
    finally:
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert len(catalog.list_backups(bdir)) == 1


def test_a_backup_waits_for_the_one_holding_the_lock(base: str, etcd: Etcd) -> None:
    """Cron's backup while another backup of this host runs (the daemon's own full backup, a
    second cron line): it waits for that one (``--wait``, 60 s by default), then takes its own."""
    bdir = os.path.join(base, "b-wait")
    cfgp = write_config(base, etcd, bdir, compression="zstd")
    first = subprocess.Popen([sys.executable, "-m", "etcd_agent.cli.main", "-c", cfgp, "backup"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_partial(bdir, first)
        os.kill(first.pid, signal.SIGSTOP)  # held mid-stream while the second starts and waits
        second = subprocess.Popen([sys.executable, "-m", "etcd_agent.cli.main", "-c", cfgp, "backup"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3.0)
        assert second.poll() is None, "the second backup did not wait for the lock"
        os.kill(first.pid, signal.SIGCONT)
        out2, err2 = second.communicate(timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert second.returncode == 0, err2
    names = [b.name for b in catalog.list_backups(bdir)]
    assert len(names) == 2 and os.path.basename(out2.strip()) in names, (names, out2)


def _wait_partial(bdir: str, proc: subprocess.Popen, min_size: int = 1) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "backup finished before it could be caught mid-stream"
        if os.path.isdir(bdir):
            for n in os.listdir(bdir):
                p = os.path.join(bdir, n)
                if n.endswith(".partial") and os.path.getsize(p) >= min_size:
                    return p
        time.sleep(0.002)
    raise AssertionError("no partial file appeared")


def test_kill_9_midway_leaves_no_visible_backup(base: str, etcd: Etcd) -> None:
    bdir = os.path.join(base, "b-kill")
    cfgp = write_config(base, etcd, bdir)
    old = take_backup(load(cfgp)).path
    time.sleep(1.0)
    proc = subprocess.Popen([sys.executable, "-m", "etcd_agent.cli.main", "-c", cfgp, "backup"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        partial = _wait_partial(bdir, proc, min_size=2 << 20)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert os.path.exists(partial)  # it was really caught mid-way
    entries = catalog.list_backups(bdir)
    assert [e.path for e in entries] == [old]
    assert catalog.resolve(bdir, "latest").path == old
    # the next run cleans the leftover and works
    new = take_backup(load(cfgp)).path
    assert not os.path.exists(partial)
    assert [e.path for e in catalog.list_backups(bdir)] == [new, old]


def db_size(e: Etcd) -> int:
    r = subprocess.run([e.etcdctl, f"--endpoints={e.client_url}", "endpoint", "status", "-w", "json"],
                       capture_output=True, check=True, timeout=10)
    return int(json.loads(r.stdout)[0]["Status"]["dbSize"])


@pytest.fixture
def tmpfs(base: str, etcd: Etcd) -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tempfile.mkdtemp(prefix="tmpfs-", dir=base)
    size = db_size(etcd) * 3 // 2  # room for one backup, not two
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", mnt], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=False)
        os.rmdir(mnt)


def test_disk_full_refused_or_failed_cleanly(base: str, etcd: Etcd, tmpfs: str) -> None:
    cfgp = write_config(base, etcd, tmpfs, keep_last=10, space_margin=0.0)
    cfg = load(cfgp)
    old = take_backup(cfg).path  # about 2/3 of the tmpfs
    old_sha = catalog.entry_for(old).manifest["files"]["etcd_snapshot.db"]["sha256"]
    time.sleep(1.0)
    # 1. the pre-check refuses before writing (CLI: exit 3)
    r = cli(cfgp, "backup")
    assert r.returncode == 3, r.stderr
    assert "not enough space" in r.stderr
    assert [n for n in os.listdir(tmpfs) if not n.startswith(".etcd-agent")] == [os.path.basename(old)]
    # 2. without the pre-check the disk really fills: the write fails, nothing is left behind
    with pytest.raises(BackupError, match="No space left on device"):
        take_backup(cfg, check_space=False)
    assert [n for n in os.listdir(tmpfs) if not n.startswith(".etcd-agent")] == [os.path.basename(old)]
    assert verify(old).ok
    assert catalog.entry_for(old).manifest["files"]["etcd_snapshot.db"]["sha256"] == old_sha


def test_prune_dry_run_reasons(base: str, etcd: Etcd) -> None:
    bdir = os.path.join(base, "b-prune")
    cfgp = write_config(base, etcd, bdir, keep_last=1, keep_hourly=0, keep_daily=0)
    first = take_backup(load(cfgp), prune=False).path
    time.sleep(1.0)
    second = take_backup(load(cfgp), prune=False).path
    r = cli(cfgp, "backup", "prune", "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"keep         {os.path.basename(second)}: one of the last 1 (#1)")
    assert "newest verified backup" in lines[0]
    assert lines[1] == f"would delete {os.path.basename(first)}: not among the last 1"
    assert os.path.exists(first)  # dry run
    r = cli(cfgp, "backup", "prune")
    assert r.returncode == 0 and not os.path.exists(first) and os.path.exists(second)


def test_status_reports_the_last_backup(tmp_path):
    """`status` ends with the newest complete backup and its age (what an operator checks first)."""
    import subprocess
    import sys

    from tests.harness.loopback import LoopbackCluster

    c = LoopbackCluster(str(tmp_path / "st"), 1)
    try:
        c.start_static()
        base = [sys.executable, "-m", "etcd_agent.cli.main", "-c", c.config_path]
        made = subprocess.run(base + ["backup", "--member", "m1"], capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr
        res = subprocess.run(base + ["status"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        name = os.path.basename(made.stdout.strip())
        assert f"last backup: {name} (" in res.stdout
    finally:
        c.stop()


def test_full_verify_of_an_empty_keyspace(tmp_path):
    """A cluster that never had a write: the manifest's revision agrees with `snapshot status`."""
    from etcd_agent.backup.service import take_backup
    from tests.harness.loopback import LoopbackCluster

    c = LoopbackCluster(str(tmp_path / "empty"), 1)
    try:
        c.start_static()
        res = take_backup(c.cfg, member="m1", full_verify=True)
        m = archive.read_manifest(res.path)
        # the only write ever: the manifest key, created in etcd by this first backup before its
        # snapshot (full_verify has checked that `snapshot status` agrees)
        assert m["revision"] == 2 and m["store_revision"] >= 1
    finally:
        c.stop()
