"""The version pin as the unit sees it, and the "upgrade in progress" marker the daemon obeys."""
import dataclasses
import json
import os
import subprocess
import sys

from etcd_agent import topology
from etcd_agent.config import parse_text
from etcd_agent.daemon import health as h
from etcd_agent.state import markers
from etcd_agent.state import pins as pin


def cfg(tmp_path):
    versions = tmp_path / "opt"
    c, errors = parse_text(
        '[cluster]\nname = "u"\ntoken = "t"\n[[member]]\nname = "m1"\nhost = "10.0.0.1"\n'
        f'[etcd]\nversions_dir = "{versions}"\n[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
    )
    assert errors == []
    return c


def install(c, version):
    d = os.path.join(c.etcd.versions_dir, version)
    os.makedirs(d)
    for tool in ("etcd", "etcdctl"):
        with open(os.path.join(d, tool), "w") as fh:
            fh.write("#!/bin/sh\n")
    return pin.release_tools(c, version)


def exec_start(c):
    unit = topology.render_unit(c, c.member("m1"), pin.pinned_binary(c, "m1"))
    return next(line for line in unit.splitlines() if line.startswith("ExecStart="))


def test_unit_follows_the_pin_even_from_a_config_read_before_it(tmp_path):
    c = cfg(tmp_path)  # the daemon's config, read before the upgrade
    assert exec_start(c) == "ExecStart=/usr/bin/etcd"
    tools = install(c, "3.5.1")
    pin.write_pin(c, "m1", "3.5.1", tools, previous="/usr/bin/etcd")
    assert exec_start(c) == f"ExecStart={tools['binary']}"
    assert oct(os.stat(pin.pin_path(c, "m1")).st_mode & 0o777) == "0o600"
    pin.restore_pin(c, "m1", None)  # a rollback of the first upgrade: no pin, the configured binary
    assert exec_start(c) == "ExecStart=/usr/bin/etcd"


def test_pin_to_a_missing_binary_falls_back_to_the_configured_one(tmp_path):
    c = cfg(tmp_path)
    tools = install(c, "3.5.1")
    pin.write_pin(c, "m1", "3.5.1", tools, previous="/usr/bin/etcd")
    os.unlink(tools["binary"])
    assert exec_start(c) == "ExecStart=/usr/bin/etcd"


def test_marker_of_a_live_process_pauses_and_a_dead_ones_is_removed(tmp_path):
    c = cfg(tmp_path)
    assert markers.upgrading(c, "m1") is None
    markers.mark_upgrading(c, "m1", "3.5.1", "/usr/bin/etcd")
    rec = markers.upgrading(c, "m1")
    assert rec is not None and rec.version == "3.5.1" and rec.pid == os.getpid()
    markers.clear_upgrading(c, "m1")
    assert markers.upgrading(c, "m1") is None
    # a step that died: its process is gone, the marker is stale and goes away
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = markers.upgrade_marker_path(c, "m1")
    with open(path, "w") as fh:
        json.dump({"member": "m1", "version": "3.5.1", "pid": int(dead.stdout), "pid_started": 1.0}, fh)
    assert markers.upgrading(c, "m1") is None and not os.path.exists(path)
    # a recycled pid (alive, but started at another time) is stale as well
    with open(path, "w") as fh:
        json.dump({"member": "m1", "version": "3.5.1", "pid": os.getpid(), "pid_started": 1.0}, fh)
    assert markers.upgrading(c, "m1") is None


def test_unreadable_marker_fails_closed(tmp_path):
    c = cfg(tmp_path)
    os.makedirs(c.daemon.state_dir)
    with open(markers.upgrade_marker_path(c, "m1"), "w") as fh:
        fh.write("{not json")
    rec = markers.upgrading(c, "m1")
    assert rec is not None and rec.error is not None and "unreadable" in rec.error


def test_daemon_waits_while_an_upgrade_steps_its_member():
    base = h.Observation(
        member="m1", bootstrap="static", is_seed=True, has_data=True, conf_present=True, unit_state="inactive",
        local_healthy=False, cluster_reachable=True, voters=3, healthy_voters=2, self_listed=True,
        self_started=True, failures=3, ever_bootstrapped=True,
    )
    assert h.decide(base).action == h.REPLACE  # what it would do without the marker
    d = h.decide(dataclasses.replace(base, upgrade_to="3.5.1"))
    assert d.action == h.WAIT and "3.5.1" in d.reason
    assert h.decide(dataclasses.replace(base, unit_state="failed", upgrade_to="3.5.1")).action == h.WAIT
