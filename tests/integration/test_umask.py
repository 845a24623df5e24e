"""Modes on real etcd: whatever the caller's umask (000 here), what the agent creates is private
or exactly as readable as it must be, and a dir it did not create keeps its mode."""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from typing import Dict

import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.config import load, with_local
from etcd_agent.member.local import LocalMember
from etcd_agent.member.process import ProcessBackend
from tests.harness.loopback import free_port_pairs
from tests.harness.modes import modes, umask
from tests.harness.releases import DEFAULT, release

pytestmark = pytest.mark.integration

AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
EXTRA = f'[ssh]\nagent_path = "{AGENT}"\n'


def writable_by_others(got: Dict[str, int]) -> Dict[str, str]:
    return {k: f"{v:04o}" for k, v in got.items() if v & 0o022}


def agent(config: str, *args: str, timeout: float = 180) -> "subprocess.CompletedProcess[str]":
    """The CLI as an operator runs it; the caller sets the umask it inherits."""
    return subprocess.run([AGENT, "-c", config, *args], capture_output=True, text=True, timeout=timeout)


def test_process_backend_start_under_umask_000(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "root"
    os.makedirs(root, mode=0o700)
    (c, p), = free_port_pairs(1)
    path = tmp_path / "agent.toml"
    path.write_text(f"""
[cluster]
name = "umask"
[[member]]
name = "m1"
host = "127.0.0.1"
client_url = "http://127.0.0.1:{c}"
peer_url = "http://127.0.0.1:{p}"
[etcd]
{release(DEFAULT).toml()}service_manager = "process"
user = "root"
group = "root"
data_dir = "{root}/var/lib/etcd/{{name}}.etcd"
conf_file = "{root}/etc/etcd/{{name}}.conf"
run_dir = "{root}/run/etcd-agent"
[daemon]
state_dir = "{tmp_path}/state"
""")
    cfg = with_local(load(str(path)), "m1")
    lm = LocalMember(cfg, cfg.member("m1"), ProcessBackend(cfg, "m1"))
    try:
        with umask(0):
            lm.start_static()  # render etcd.conf, then start etcd
        lm.wait_healthy(30)
        got = modes(str(root))
    finally:
        lm.backend.stop(timeout=10)
    agents = {k: v for k, v in got.items() if not k.startswith("var/lib/etcd/m1.etcd/")}
    assert agents == {
        "etc": 0o755, "etc/etcd": 0o755, "etc/etcd/m1.conf": 0o644,   # readable, nobody else's to swap
        "run": 0o700, "run/etcd-agent": 0o700, "run/etcd-agent/m1.log": 0o600, "run/etcd-agent/m1.pid": 0o600,
        "var": 0o700, "var/lib": 0o700, "var/lib/etcd": 0o700, "var/lib/etcd/m1.etcd": 0o700,
    }, agents
    assert writable_by_others(got) == {}  # etcd's own files too


def test_restore_under_umask_000_recreates_the_conf_dir_0755(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    c = cluster_factory(1, extra=EXTRA)
    c.start_static()
    b = take_backup(c.cfg, member="m1")
    c.stop()
    conf_dir = os.path.dirname(c.cfg.conf_file("m1"))
    shutil.rmtree(conf_dir)  # the restore repairs etcd.conf from the archive, into a new dir
    with umask(0):
        res = agent(c.config_path, "restore", "--from", b.path, "--yes")
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE(os.stat(conf_dir).st_mode) == 0o755  # was 0777: another user could swap etcd.conf
    assert stat.S_IMODE(os.stat(c.cfg.conf_file("m1")).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(c.cfg.backup.dir).st_mode) == 0o700
    assert writable_by_others(modes(c.dir)) == {}


def test_open_backup_dir_is_refused_and_keeps_its_mode(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    c = cluster_factory(1, extra=EXTRA)
    c.start_static()
    take_backup(c.cfg, member="m1")
    bdir = c.cfg.backup.dir
    os.chmod(bdir, 0o1777)  # as if it were /tmp
    want = (f"etcd-agent: error: {bdir} has mode 1777 but must be private (0700): it holds every Kubernetes Secret "
            f"and the agent does not change the mode of a directory it did not create, so run `chmod 700 {bdir}` "
            f"or configure a new directory\n")
    for args in (["backup", "--member", "m1"], ["restore", "--from", "latest", "--dry-run"]):
        res = agent(c.config_path, *args)
        assert (res.returncode, res.stderr) == (3, want), args
        assert stat.S_IMODE(os.stat(bdir).st_mode) == 0o1777, f"{args} changed the mode of {bdir}"
    assert len([n for n in os.listdir(bdir) if n.endswith(".tar")]) == 1  # nothing written either


def _umask_of(pid: int) -> str:
    with open(f"/proc/{pid}/status") as fh:
        return next(line.split()[1] for line in fh if line.startswith("Umask:"))


def test_the_agent_and_the_etcd_it_starts_run_under_umask_077(cluster_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = cluster_factory(1, extra=f'[daemon]\ninterval = 1.0\nstate_dir = "{tmp_path}/state"\n')
    log = open(tmp_path / "daemon.log", "wb")
    with umask(0):
        daemon = subprocess.Popen([AGENT, "-c", c.config_path, "run", "--member", "m1"], stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        backend = ProcessBackend(c.cfg, "m1")
        t0 = time.monotonic()
        while backend.pid() is None:
            assert daemon.poll() is None and time.monotonic() - t0 < 60, (tmp_path / "daemon.log").read_text()
            time.sleep(0.2)
        etcd_pid = backend.pid()
        assert etcd_pid is not None
        assert (_umask_of(daemon.pid), _umask_of(etcd_pid)) == ("0077", "0077")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        log.close()
