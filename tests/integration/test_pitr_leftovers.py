"""A point-in-time restore of an encrypted chain killed (-9) mid-replay: no plaintext was ever
under the backup dir (it is copied off-host), ``status`` reports what the dead run left, and the
next command of any kind stops its throwaway etcd and removes its plaintext. Real daemons
writing an age-encrypted chain, a real replay, real processes."""
from __future__ import annotations

import json
import os
import signal
import time
from typing import List, Set

import psutil
import pytest

from tests.harness.procs import agent_run
from tests.integration.continuous import agent, put, rpc, start_all, wait_durable, wait_watching
from tests.integration.test_restore import AGENT

pytestmark = pytest.mark.integration


def _keyfile(tmp_path) -> tuple:  # type: ignore[no-untyped-def]
    from etcd_agent import age

    secret, recipient = age.generate_identity()
    path = tmp_path / "backup-key.txt"
    path.write_text(secret + "\n")
    os.chmod(path, 0o600)
    return str(path), recipient


def _under_backup_dir(top: str) -> Set[str]:
    """Every path below the backup dir that is a throwaway's work: the point-in-time dir's contents
    (but its lock file) and any staging dir of a decrypted backup."""
    out: Set[str] = set()
    for root, dirs, files in os.walk(top):
        rel = os.path.relpath(root, top)
        for n in dirs + files:
            p = n if rel == "." else os.path.join(rel, n)
            if (p.startswith(".pitr" + os.sep) and p != os.path.join(".pitr", ".lock")) or ".etcd-agent-stage-" in p:
                out.add(p)
    return out


def _scratch_etcds(tops: List[str]) -> List[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cwd", "name"]):
        cwd = p.info["cwd"] or ""
        if (p.info["name"] or "").startswith("etcd") and any(cwd.startswith(t) for t in tops):
            found.append(p)
    return found


def test_a_killed_encrypted_replay_leaves_no_plaintext_and_no_etcd(bed, tmp_path) -> None:  # type: ignore[no-untyped-def]
    key, recipient = _keyfile(tmp_path)
    d = bed(backup=f'encrypt_to = ["{recipient}"]\n')
    c = d.c
    start_all(d)
    wait_watching(c)
    r = rpc(c)
    for i in range(3000):
        put(r, f"/k/{i:05d}", b"v" * 200)
    top = put(r, "/k/top", b"v")
    wait_durable(c, top)
    backup_dir = c.cfg.backup.dir
    tops = [backup_dir, c.cfg.daemon.state_dir]
    seen: Set[str] = set()
    with agent_run([AGENT, "-c", c.config_path, "restore", "--from", "latest", "--to", "newest", "--identity", key,
                    "--dry-run"]) as proc:
        deadline = time.monotonic() + 180
        while not _scratch_etcds(tops):  # mid-replay: its throwaway etcd serves
            seen |= _under_backup_dir(backup_dir)
            assert proc.poll() is None, "the restore ended before its replay could be killed"
            assert time.monotonic() < deadline, "no replay started"
            time.sleep(0.02)
        seen |= _under_backup_dir(backup_dir)
        etcds = _scratch_etcds(tops)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    _, alive = psutil.wait_procs(etcds, timeout=15)  # the parent-death signal: they die with their run
    assert not alive, f"throwaway etcd(s) {[p.pid for p in alive]} outlived the replay killed with -9"
    assert not seen, f"plaintext staged under the backup dir during an encrypted replay: {sorted(seen)}"
    st = agent(c, "--json", "status")
    left = json.loads(st.stdout)["leftovers"]
    assert left, "status does not report what the killed replay left: " + st.stdout
    assert "LEFTOVER" in agent(c, "status").stdout
    res = agent(c, "backup", "list")  # any command: it cleans up before its own work
    assert res.returncode == 0, res.stderr
    assert not _scratch_etcds(tops), "a throwaway etcd of the killed replay is still running"
    private = os.path.join(c.cfg.daemon.state_dir, "decrypted")
    assert not [n for n in os.listdir(private) if not n.startswith(".")] if os.path.isdir(private) else True, \
        os.listdir(private)
    assert not _under_backup_dir(backup_dir)
    assert json.loads(agent(c, "--json", "status").stdout)["leftovers"] == []
    print(f"\nFIGURE pitr leftovers: killed mid-replay; its etcd died with it; status named {len(left)} leftover(s) "
          "(" + "; ".join(x.split(c.dir)[-1] for x in left) + "); `backup list` removed them; nothing was ever "
          "staged under the backup dir")
