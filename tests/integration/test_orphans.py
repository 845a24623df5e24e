"""No child outlives its run, no lock outlives its holder: real processes on a loopback cluster.

A restore whose orchestrator is killed (-9) while a host's node session is stuck in a step (here:
``etcdutl snapshot restore`` that never returns, a wrapper around the real one) leaves no
``node serve`` and no helper running, and no lock: the next restore resumes and ends."""
from __future__ import annotations

import os
import signal
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
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
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
