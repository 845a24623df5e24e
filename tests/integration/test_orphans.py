"""No child outlives its run, no lock outlives its holder: real processes on a loopback cluster.

A restore whose orchestrator is killed (-9) while a host's node session is stuck in a step (here:
``etcdutl snapshot restore`` that never returns, a wrapper around the real one) leaves no
``node serve`` and no helper running, and no lock: the next restore resumes and ends."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from typing import List

import psutil
import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.state.locks import holder_of
from tests.harness.procs import agent_run
from tests.integration.test_restore import AGENT, cli, counts, make, put_many

pytestmark = pytest.mark.integration


def _block_snapshot_restore(c, tmp: str) -> str:  # type: ignore[no-untyped-def]
    """Point the config's etcdutl at a wrapper whose ``snapshot restore`` hangs while ``<tmp>/block``
    exists (writing its pid to ``<tmp>/stuck``); everything else runs the real etcdutl."""
    real = c.cfg.etcd.etcdutl
    wrapper = os.path.join(tmp, "etcdutl")
    with open(wrapper, "w") as fh:
        fh.write(f"""#!/bin/sh
if [ "$1" = snapshot ] && [ "$2" = restore ] && [ -e {tmp}/block ]; then
    echo $$ >> {tmp}/stuck
    exec sleep 3600
fi
exec {real} "$@"
""")
    os.chmod(wrapper, 0o755)
    with open(os.path.join(tmp, "block"), "w"):
        pass
    with open(c.config_path) as fh:
        text = fh.read()
    with open(c.config_path, "w") as fh:
        fh.write(text.replace(f'etcdutl = "{real}"', f'etcdutl = "{wrapper}"'))
    return os.path.join(tmp, "stuck")


def _node_serves(config_path: str) -> List[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if config_path in cmd and "node" in cmd and "serve" in cmd:
            out.append(p)
    return out


def test_a_killed_restore_leaves_no_node_session_no_helper_and_no_lock(cluster_factory, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = make(cluster_factory)
    put_many(c, "/k/", 50)
    b = take_backup(c.cfg, member="m1")
    stuck = _block_snapshot_restore(c, str(tmp_path))
    with agent_run([AGENT, "-c", c.config_path, "restore", "--from", b.path, "--yes"]) as proc:
        deadline = time.monotonic() + 120
        while not os.path.exists(stuck) or not open(stuck).read().strip():
            assert proc.poll() is None, "the restore ended before a step got stuck"
            assert time.monotonic() < deadline, "no snapshot restore started"
            time.sleep(0.05)
        time.sleep(1)  # every member's step reaches it
        helpers = [psutil.Process(int(x)) for x in open(stuck).read().split()]
        serves = _node_serves(c.config_path)
        assert serves, "no node serve found"
        # while it runs: a second command is refused naming host, command, pid and since
        busy = subprocess.run([AGENT, "-c", c.config_path, "backup"], capture_output=True, text=True, timeout=60)
        host = socket.gethostname()
        assert busy.returncode == 4, busy.stderr
        assert "`etcd-agent restore " in busy.stderr and f" from {host} (pid {proc.pid}) since 20" in busy.stderr, busy.stderr
        assert "STALE" not in busy.stderr, busy.stderr
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # its run is gone, its session not yet: named stale, with what to do
    stale = subprocess.run([AGENT, "-c", c.config_path, "backup"], capture_output=True, text=True, timeout=60)
    assert stale.returncode == 4 and "STALE" in stale.stderr, stale.stderr
    assert f"pid {proc.pid} is gone" in stale.stderr and f"kill {serves[0].pid}" in stale.stderr, stale.stderr
    st = subprocess.run([AGENT, "-c", c.config_path, "--json", "status"], capture_output=True, text=True, timeout=60)
    lock = json.loads(st.stdout)["operation_lock"]
    assert lock is not None and f"kill {serves[0].pid}" in lock["stale"], st.stdout
    t = time.monotonic()
    gone, alive = psutil.wait_procs(serves, timeout=120)
    left = time.monotonic() - t
    _, stuck_alive = psutil.wait_procs(helpers, timeout=10)
    for p in alive + stuck_alive:  # the test's own cleanup; the assertions below say it failed
        p.kill()
    assert not alive, f"node serve pid(s) {[p.pid for p in alive]} outlived their killed restore by 120s"
    assert not stuck_alive, f"the stuck etcdutl(s) {[p.pid for p in stuck_alive]} outlived their node session"
    assert holder_of(c.cfg.backup.dir) is None, "the lock outlived its holder"
    os.unlink(os.path.join(str(tmp_path), "block"))
    capsys.readouterr()
    assert cli(c, "restore", "--from", b.path, "--yes") == 0, capsys.readouterr().err
    assert counts(c, "/k/") == [50]
    print(f"\nFIGURE orphan: node serves ended {left:.1f}s after their restore was SIGKILLed mid-step; "
          "the same command then resumed and finished")


def _wait_text(path: str, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        with open(path) as fh:
            got = fh.read()
        if text in got or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_ctrl_c_during_a_restore_says_what_it_does_and_a_second_one_stops_waiting(cluster_factory, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = make(cluster_factory)
    put_many(c, "/k/", 50)
    b = take_backup(c.cfg, member="m1")
    put_many(c, "/later/", 5)
    stuck = _block_snapshot_restore(c, str(tmp_path))
    err = str(tmp_path / "stderr")
    with open(err, "w") as errfh:
        proc = subprocess.Popen([AGENT, "-c", c.config_path, "restore", "--from", b.path, "--yes"],
                                stdout=subprocess.DEVNULL, stderr=errfh, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(stuck):
            assert proc.poll() is None and time.monotonic() < deadline, "no snapshot restore got stuck"
            time.sleep(0.05)
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        got = _wait_text(err, "Ctrl-C again", 15)
        assert "interrupted" in got and "waiting for" in got and "Ctrl-C again" in got, \
            "the first Ctrl-C said nothing within 15s:\n" + got[-1500:]
        proc.send_signal(signal.SIGINT)
        got = _wait_text(err, "restore rollback --yes", 15)
        assert "restore rollback --yes" in got, "the second Ctrl-C did not stop waiting within 15s:\n" + got[-1500:]
        proc.wait(120)  # its stuck host session ends STOP_GRACE after it is closed
        assert proc.returncode == 130, got[-1500:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in (open(stuck).read().split() if os.path.exists(stuck) else []):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
    os.unlink(os.path.join(str(tmp_path), "block"))
    capsys.readouterr()
    assert cli(c, "restore", "rollback", "--yes") == 0, capsys.readouterr().err
    assert counts(c, "/k/", "/later/") == [50, 5]  # the data from before, every member serving it
