"""`etcd-agent demo` end to end: the README's first command, on real etcd, fixed demo ports."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from etcd_agent.cluster.demo import port_free, ports

# the demo binds its fixed ports: one test at a time holds them (conftest.demo_ports)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("demo_ports")]


def etcds_under(directory):
    out = []
    for p in psutil.process_iter(["name", "environ"]):
        try:
            env = p.info["environ"] or {}
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        if p.info["name"] == "etcd" and env.get("ETCD_DATA_DIR", "").startswith(directory):
            out.append(p.pid)
    return out


def start_demo(directory, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "etcd_agent.cli.main", "demo", "--dir", directory, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_line(proc, needle, timeout):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} not printed; got {''.join(seen)!r}; stderr {proc.stderr.read() if proc.poll() is not None else ''}")


def test_demo_three_members_then_ctrl_c(tmp_path):
    for i in range(3):
        for port in ports(i):
            assert port_free(port), f"demo port {port} busy: stop what runs there"
    d = str(tmp_path / "demo")
    proc = start_demo(d)
    try:
        out = wait_line(proc, "members healthy in", 90)
        assert "s1" in out and "s2" in out and "s3" in out
        assert len(etcds_under(d)) == 3
        res = subprocess.run([sys.executable, "-m", "etcd_agent.cli.main", "-c", f"{d}/agent.toml", "status"],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "http://127.0.0.1:32379" in res.stdout
        # the supervisor restarts a crashed member, like Restart=on-failure
        victim = [p for p in etcds_under(d) if psutil.Process(p).environ()["ETCD_NAME"] == "s2"][0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pids = etcds_under(d)
            if len(pids) == 3 and victim not in pids:
                break
            time.sleep(0.3)
        assert len(etcds_under(d)) == 3, "killed member was not restarted"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0, proc.stderr.read()
    assert etcds_under(d) == [], "Ctrl-C left etcd running"
    # the same dir resumes from the data
    proc = start_demo(d, "--exit-when-healthy")
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    assert "resumed from their data" in out
    assert etcds_under(d) == []
