"""`etcd-agent demo` end to end: the README's first command, on real etcd, fixed demo ports."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from etcd_agent.cluster.demo import port_free, ports
from etcd_agent.waiting import poll

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


def start_demo(directory, *extra, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "etcd_agent.cli.main", "demo", "--dir", directory, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def agent(config, *argv, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "etcd_agent.cli.main", "-c", config, *argv],
                          capture_output=True, text=True, timeout=timeout, env=env)


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
        # it runs the daemon's continuous backup: a full backup, then segments beside it
        poll(lambda: any(n.endswith(".tar") for n in os.listdir(f"{d}/backups")) and
             any(n.endswith(".seg") for n in os.listdir(f"{d}/backups")), timeout=60,
             what="the demo's first full backup and delta segment")
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


# A master's machine-wide places: every default of the config that the agent writes (config/model.py,
# config/paths.py), and the dirs around them. A demo writes none of them.
MACHINE_PATHS = (
    "/var/lib/etcd-agent", "/run/etcd-agent", "/var/lib/etcd_backup", "/var/lib/etcd-agent-drill",
    "/etc/etcd-agent", "/etc/etcd", "/var/lib/etcd", "/etc/systemd/system/etcd.service", "/etc/kubernetes",
    "/var/lib/node_exporter",
)


def listing(paths):
    """Every file and dir under ``paths`` with its mtime and size ("absent" for a missing path)."""
    out = {}
    for top in paths:
        if not os.path.lexists(top):
            out[top] = "absent"
            continue
        for root, _dirs, files in os.walk(top):
            for n in [root, *(os.path.join(root, f) for f in files)]:
                st = os.lstat(n)
                out[n] = (st.st_mtime_ns, st.st_size)
    return out


def stop_demo(proc):
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == 0, proc.stderr.read()


def test_two_demos_in_two_dirs_never_see_each_other(tmp_path):
    """Issue 24: after a restore in one demo, a fresh demo elsewhere started with conf-drift on
    every member (the restore's state went to /var/lib/etcd-agent, machine-wide). Two demos one
    after the other, a restore in the first: the second is clean from its first status, and
    nothing was written outside the two dirs."""
    for i in range(3):
        for port in ports(i):
            assert port_free(port), f"demo port {port} busy: stop what runs there"
    before = listing(MACHINE_PATHS)
    tmp = tmp_path / "tmp"  # the temp dir of every process: a demo leaves nothing in it either
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    d1, d2 = str(tmp_path / "one" / "demo"), str(tmp_path / "two" / "demo")
    proc = start_demo(d1, env=env)
    try:
        wait_line(proc, "members healthy in", 90)
        c1 = f"{d1}/agent.toml"
        for argv in (["backup"], ["restore", "--from", "latest", "--yes"]):
            res = agent(c1, *argv, env=env)
            deadline = time.monotonic() + 30
            # the demo's continuous backup takes its first full backup as the members come up:
            # a backup meanwhile is busy (exit 4, nothing touched) and is run again, as cron would
            while argv == ["backup"] and res.returncode == 4 and time.monotonic() < deadline:
                time.sleep(0.5)
                res = agent(c1, *argv, env=env)
            assert res.returncode == 0, res.stdout + res.stderr
        assert os.path.isfile(f"{d1}/state/lineage.json"), "the restore recorded no lineage in the demo's state dir"
    finally:
        stop_demo(proc)
    proc = start_demo(d2, env=env)
    try:
        wait_line(proc, "members healthy in", 90)
        res = agent(f"{d2}/agent.toml", "--json", "status", env=env, timeout=60)  # its first status
        assert res.returncode == 0, res.stdout + res.stderr
        members = json.loads(res.stdout)["members"]
        assert [m["name"] for m in members] == ["s1", "s2", "s3"]
        assert all(m["healthy"] and not m["errors"] for m in members), members
        assert not os.path.exists(f"{d2}/state/lineage.json")  # the first demo's restore is not its history
    finally:
        stop_demo(proc)
    assert etcds_under(str(tmp_path)) == []
    after = listing(MACHINE_PATHS)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert changed == [], f"the demos wrote outside their dirs: {changed}"
    assert os.listdir(tmp) == [], f"left in the temp dir: {os.listdir(tmp)}"
