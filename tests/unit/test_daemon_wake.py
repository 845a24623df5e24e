"""The daemon's wake on its etcd's exit (process backend): a real child process watched through
its pidfd, and the pacing that keeps an etcd dying as it starts at the cycle's pace."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time

import psutil

from etcd_agent.config import load
from etcd_agent.member.process import ProcessBackend
from etcd_agent.proctime import start_ticks
from tests.unit.test_security import write


def test_an_exit_wakes_the_loop_at_most_once_per_cycle(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent.daemon.loop import Daemon

    d = Daemon(write(tmp_path, "", 0o600), member="a")
    d._etcd_exited(4242)
    assert d._wake.is_set()  # a killed etcd: the next cycle now
    d._wake.clear()
    d._last_restart = time.monotonic()  # restarted just now, and gone again
    d._etcd_exited(4243)
    assert not d._wake.is_set()  # a crash loop is restarted at the cycle's pace


def test_the_process_backend_calls_back_when_its_etcd_exits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = load(write(tmp_path, "", 0o600))
    b = ProcessBackend(cfg, "a")
    os.makedirs(b.run_dir, exist_ok=True)
    # a stand-in named like the configured binary, so the pid file's identity checks hold
    fake = str(tmp_path / os.path.basename(cfg.etcd.binary))
    shutil.copy("/bin/sleep", fake)
    child = subprocess.Popen([fake, "60"], env={"ETCD_NAME": "a"})
    try:
        with open(b.pid_file, "w") as fh:
            json.dump({"pid": child.pid, "create_time": psutil.Process(child.pid).create_time(),
                       "start_ticks": start_ticks(child.pid), "binary": fake}, fh)
        exited = threading.Event()
        seen = []
        assert b.watch_exit(lambda pid: (seen.append(pid), exited.set())) == child.pid
        assert b.watch_exit(lambda pid: seen.append(-pid)) == child.pid  # one watcher per etcd
        assert not exited.is_set()
        child.kill()
        child.wait()
        assert exited.wait(10), "no call back after the exit"
        assert seen == [child.pid]
        assert b.watch_exit(lambda pid: None) is None  # none runs now
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
