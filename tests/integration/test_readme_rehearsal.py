"""The README's quick start, verbatim: `make demo`, then its rehearsal block line by line in a
second shell - a backup and a restore, then a point-in-time restore from the demo's continuous
backup. A newcomer's first contact with the product must work as written."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from typing import List

import pytest

from etcd_agent.cluster.demo import port_free, ports
from etcd_agent.waiting import poll

# the demo binds its fixed ports: one test at a time holds them (conftest.demo_ports)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("demo_ports")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_DIR = os.path.join(ROOT, "etcd-agent-demo")


def rehearsal_block() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    m = re.search(r"<!-- rehearsal -->\s*```sh\n(.*?)```\s*<!-- /rehearsal -->", text, re.S)
    assert m, "the README lost its rehearsal block"
    return m.group(1)


def test_readme_rehearsal_runs_verbatim_on_make_demo() -> None:
    for i in range(3):
        for p in ports(i):
            assert port_free(p), f"port {p} is in use: stop the other etcd/demo before this test"
    assert not os.path.exists(DEMO_DIR), f"{DEMO_DIR} exists (a demo of yours?): move it away for this test"
    demo = subprocess.Popen(["make", "--no-print-directory", "demo"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    lines: List[str] = []
    healthy = threading.Event()

    def drain() -> None:  # the demo keeps talking while it supervises: never let its pipe fill
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line)
            if "members healthy in" in line:
                healthy.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert healthy.wait(180), "make demo did not bring the cluster up:\n" + "".join(lines)
        script = rehearsal_block()
        before = len(lines)
        t = time.monotonic()
        res = subprocess.run(["bash", "-e", "-x", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t
        assert res.returncode == 0, res.stdout + res.stderr
        out = res.stdout.strip().splitlines()
        # the point-in-time restore: the good write (before T) back, the bad one (after T) gone
        assert out[-4:] == ["/rehearsal/before", "yes", "/rehearsal/good", "yes"], res.stdout + res.stderr
        assert "/rehearsal/bad" not in out, res.stdout
        # the plain restore before it: the write after the backup gone, and never back
        assert "/rehearsal/after" not in out, res.stdout
        assert sum(line.startswith("restored from") for line in out) == 2, res.stdout
        assert any(".pitr/" in line for line in out if line.startswith("restored from")), res.stdout
        during = "".join(lines[before:])
        # the supervisor kept its hands off while the restore stopped the members, as the daemon
        # does. It looks once a second: a restore of the demo's small db can begin and end between
        # two looks, so "hands off" is printed only when a look fell inside it.
        assert "restarting it" not in during, during
        if "supervising again" in during:
            assert during.index("hands off") < during.index("supervising again"), during
        print(f"\nFIGURE README rehearsal on make demo: {took:.1f}s for its {len(script.splitlines())} lines")
    finally:
        os.killpg(demo.pid, signal.SIGINT)
        try:
            demo.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
        poll(lambda: all(port_free(p) for i in range(3) for p in ports(i)), timeout=30, what="the demo's ports free")
        shutil.rmtree(DEMO_DIR, ignore_errors=True)
