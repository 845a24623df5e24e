"""Scale, leave, reset and join through the CLI, on real etcd clusters on loopback.

The commands run in-process (``main([...])``) so every etcd the agent starts is a child of the
test process and is stopped by PID by ``cluster_factory``; the no-terminal refusal runs as a real
subprocess with stdin from /dev/null.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

import pytest

from etcd_agent.cli.main import main
from etcd_agent.waiting import poll
from tests.harness.loopback import LoopbackCluster

pytestmark = pytest.mark.integration


def cli(capsys: Any, c: LoopbackCluster, *args: str) -> Tuple[int, Dict[str, Any]]:
    """Run ``etcd-agent -c <cluster config> --json ARGS`` in-process; (exit code, JSON output)."""
    capsys.readouterr()
    rc = main(["-c", c.config_path, "--json", *args])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else {}


def member_list(c: LoopbackCluster) -> List[Tuple[int, str, Tuple[str, ...], bool]]:
    with c.client() as cl:
        return sorted((m.id, m.name, m.peer_urls, m.is_learner) for m in cl.members())


def assert_healthy(c: LoopbackCluster, names: List[str]) -> None:
    """Exactly ``names`` are members, all started, and every one answers a linearizable read."""
    with c.client() as cl:
        members = cl.members()
        assert sorted(m.name for m in members) == sorted(names)
        for name in names:
            ok, why = cl.healthy(c.cfg.member(name).client_url, timeout=5)
            assert ok, f"{name}: {why}"


def lm(c: LoopbackCluster, name: str) -> Any:
    return next(m for m in c.members if m.member.name == name)


def test_scale_3_to_5_to_3(cluster_factory, capsys):
    c = cluster_factory(5)
    c.start_static(count=3)
    assert_healthy(c, ["m1", "m2", "m3"])
    with c.client() as cl:
        cl.put("scale/k", b"v")
    times: Dict[str, float] = {}
    t_all = time.monotonic()
    names = ["m1", "m2", "m3"]
    for name in ("m4", "m5"):
        peer = c.cfg.member(name).peer_url
        before = member_list(c)
        rc, out = cli(capsys, c, "member", "add", name, "--peer-url", peer, "--dry-run")
        assert rc == 0 and out["executed"] is False and out["plan"]["action"] == "add"
        assert f"{name}={peer}" in out["plan"]["initial_cluster"]
        assert member_list(c) == before  # the dry run changed nothing
        t = time.monotonic()
        rc, out = cli(capsys, c, "member", "add", name, "--peer-url", peer, "--yes")
        assert rc == 0, out
        rc, out = cli(capsys, c, "join", "--member", name)
        assert rc == 0, out
        times[f"add+join {name}"] = time.monotonic() - t
        names.append(name)
        assert_healthy(c, names)
    # the same peer URL again is a refusal, and so is a second join of a started member
    assert cli(capsys, c, "member", "add", "m5", "--yes")[0] == 3
    assert cli(capsys, c, "join", "--member", "m5")[0] == 3
    with c.client() as cl:
        assert cl.get("scale/k") == b"v"
        assert cl.status(c.cfg.member("m5").client_url).revision >= 2

    for name in ("m5", "m4"):
        before = member_list(c)
        rc, out = cli(capsys, c, "member", "remove", name, "--dry-run")
        assert rc == 0 and out["executed"] is False
        assert member_list(c) == before
        t = time.monotonic()
        rc, out = cli(capsys, c, "member", "remove", name, "--yes")
        assert rc == 0, out
        names.remove(name)
        assert_healthy(c, names)
        times[f"remove {name}"] = time.monotonic() - t
        # a removed etcd exits by itself
        poll(lambda name=name: not lm(c, name).backend.is_active(), timeout=15, what=f"{name} stopped")
    times["3->5->3"] = time.monotonic() - t_all
    assert_healthy(c, ["m1", "m2", "m3"])
    print("scale times: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))


def test_removal_that_would_lose_quorum_is_refused(cluster_factory, capsys):
    c = cluster_factory(4)
    c.start_static(count=3)
    lm(c, "m3").backend.kill()
    before = member_list(c)
    rc, out = cli(capsys, c, "member", "remove", "m1", "--yes")
    assert rc == 3 and out["error"] == "RefusedError" and "quorum needs 2" in out["message"]
    # a new voter with only a bare majority healthy is refused too
    rc, out = cli(capsys, c, "member", "add", "m4", "--yes")
    assert rc == 3 and "need 3 healthy" in out["message"]
    assert cli(capsys, c, "member", "remove", "nobody", "--yes")[0] == 3
    # removing the dead member keeps quorum: allowed (dry run only here)
    rc, out = cli(capsys, c, "member", "remove", "m3", "--dry-run")
    assert rc == 0 and out["plan"]["member_id"]
    assert member_list(c) == before
    rc, out = cli(capsys, c, "member", "list")
    assert rc == 0
    flags = {r["name"]: (r["started"], r["healthy"]) for r in out["members"]}
    assert flags == {"m1": (True, True), "m2": (True, True), "m3": (True, False)}


def test_last_member_removal_is_refused(cluster_factory, capsys):
    c = cluster_factory(1)
    c.start_static()
    before = member_list(c)
    for args in (("member", "remove", "m1", "--yes"), ("leave", "--member", "m1", "--yes"),
                 ("reset", "--member", "m1", "--yes")):
        rc, out = cli(capsys, c, *args)
        assert rc == 3 and "last member" in out["message"], (args, out)
    assert member_list(c) == before
    assert c.members[0].backend.is_active() and c.members[0].has_data()


def test_leave_moves_data_aside_and_join_brings_the_member_back(cluster_factory, capsys):
    c = cluster_factory(3)
    c.start_static()
    m3 = lm(c, "m3")
    before = member_list(c)
    rc, out = cli(capsys, c, "leave", "--member", "m3", "--dry-run")
    assert rc == 0 and out["plan"]["listed"] and out["plan"]["aside_dir"].startswith(m3.data_dir + ".left-")
    assert member_list(c) == before and m3.backend.is_active()

    t = time.monotonic()
    rc, out = cli(capsys, c, "leave", "--member", "m3", "--yes")
    took_leave = time.monotonic() - t
    assert rc == 0, out
    assert not os.path.exists(m3.data_dir) and not m3.backend.is_active()
    aside = glob.glob(m3.data_dir + ".left-*")
    assert aside == [out["plan"]["aside_dir"]]
    assert os.path.isdir(os.path.join(aside[0], "member", "wal"))  # renamed, not deleted
    assert_healthy(c, ["m1", "m2"])
    # leaving again is a no-op: not a member, nothing running, no data
    rc, out = cli(capsys, c, "leave", "--member", "m3", "--yes")
    assert rc == 0 and out["plan"]["steps"] == []

    t = time.monotonic()
    rc, out = cli(capsys, c, "join", "--member", "m3")
    took_join = time.monotonic() - t
    assert rc == 0, out
    assert_healthy(c, ["m1", "m2", "m3"])
    print(f"leave {took_leave:.1f}s, join back {took_join:.1f}s")


def test_reset_asks_refuses_without_a_terminal_and_wipes_with_yes(cluster_factory, capsys):
    c = cluster_factory(3)
    c.start_static()
    m3 = lm(c, "m3")
    before = member_list(c)
    res = subprocess.run(
        [sys.executable, "-m", "etcd_agent.cli.main", "-c", c.config_path, "reset", "--member", "m3"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert "plan: reset m3" in res.stderr and "pass --yes" in res.stderr
    assert member_list(c) == before and m3.backend.is_active() and m3.has_data()

    rc, out = cli(capsys, c, "reset", "--member", "m3", "--yes")
    assert rc == 0, out
    assert not os.path.exists(m3.data_dir) and not glob.glob(m3.data_dir + ".*")
    assert not m3.backend.is_active()
    assert_healthy(c, ["m1", "m2"])
