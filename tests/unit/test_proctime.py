"""proctime.start_ticks: a process told by its start in ticks since boot, whatever the wall clock
did. Real processes; the jumped clock is played by a record whose wall-clock time is a second off
(what /proc/stat's btime does after an NTP step, a VM resume, or a drift across a second's edge)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import psutil

from etcd_agent.config import parse_text
from etcd_agent.member.process import ProcessBackend
from etcd_agent.proctime import start_ticks
from etcd_agent.state import markers

TEXT = """
[cluster]
name = "k8s"
[etcd]
data_dir = "{d}/etcd/m1.etcd"
run_dir = "{d}/run"
[backup]
dir = "{d}/backups"
[daemon]
state_dir = "{d}/state"
[[member]]
name = "m1"
host = "127.0.0.1"
"""


def cfg(tmp_path: Any) -> Any:
    c, errors = parse_text(TEXT.format(d=tmp_path))
    assert c is not None and not errors, errors
    return c


def test_start_ticks_is_the_kernels_start_time_of_that_process() -> None:
    me = start_ticks(os.getpid())
    assert isinstance(me, int) and me == start_ticks(os.getpid())
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as fh:
        btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
    assert abs(me / hz + btime - psutil.Process().create_time()) < 1.5  # the same moment, in psutil's terms
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        theirs = start_ticks(child.pid)
        assert theirs is not None and theirs > me
    finally:
        child.kill()
        child.wait()
    assert start_ticks(child.pid) is None  # gone
    assert start_ticks(2 ** 22 + 12345) is None  # never was


def test_a_live_upgrade_marker_stays_live_when_the_clock_jumped(tmp_path: Any) -> None:
    c = cfg(tmp_path)
    path = markers.mark_upgrading(c, "m1", "3.5.30", "/usr/bin/etcd")
    with open(path) as fh:
        rec = json.load(fh)
    rec["pid_started"] -= 1.0  # btime moved by a second since the marker was written
    with open(path, "w") as fh:
        json.dump(rec, fh)
    got = markers.upgrading(c, "m1")
    assert got is not None and got.pid == os.getpid(), "a live upgrade's marker was taken for stale"
    rec["pid_start_ticks"] += 1  # another process under the same pid: stale, whatever the clock
    with open(path, "w") as fh:
        json.dump(rec, fh)
    assert markers.upgrading(c, "m1") is None and not os.path.exists(path)


def test_the_process_backend_knows_its_etcd_when_the_clock_jumped(tmp_path: Any) -> None:
    c = cfg(tmp_path)
    b = ProcessBackend(c, "m1")
    os.makedirs(c.etcd.run_dir, mode=0o700)
    # a stand-in named like the configured binary, so the pid file's checks hold for it
    etcd = os.path.join(str(tmp_path), os.path.basename(c.etcd.binary))
    os.symlink(sys.executable, etcd)
    child = subprocess.Popen([etcd, "-c", "import time; time.sleep(30)"], env={**os.environ, "ETCD_NAME": "m1"})
    try:
        deadline = time.monotonic() + 10
        # (an empty cmdline: forked, not yet exec'd - seen under load)
        while os.path.basename((psutil.Process(child.pid).cmdline() or [""])[0]) != os.path.basename(etcd):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        rec = {"pid": child.pid, "create_time": psutil.Process(child.pid).create_time() - 1.0,
               "start_ticks": start_ticks(child.pid), "binary": etcd}
        with open(b.pid_file, "w") as fh:
            json.dump(rec, fh)
        assert b.pid() == child.pid, "its own etcd taken for another process after the clock jumped"
        rec["start_ticks"] -= 1  # a recycled pid
        with open(b.pid_file, "w") as fh:
            json.dump(rec, fh)
        assert b.pid() is None
        del rec["start_ticks"]  # a pid file of an older agent: the wall-clock rule, as before
        rec["create_time"] += 1.0
        with open(b.pid_file, "w") as fh:
            json.dump(rec, fh)
        assert b.pid() == child.pid
    finally:
        child.kill()
        child.wait()
