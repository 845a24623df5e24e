"""A backup of a newer etcd minor than the hosts run is refused before anything is touched.

Cluster A runs 3.5.16 and is backed up; cluster B runs 3.4.23 on loopback with its own data (a
3.4 standby being seeded from production, say). Restoring A's backup onto B would run B on a store
3.5 wrote: a downgrade, which etcd does not support - though 3.4.23 starts on a 3.5.16 snapshot
restored by etcdctl 3.4 without complaint, so the refusal must come from the agent, at the
pre-check. The other direction (a 3.4.23 backup onto members upgraded to 3.5.16) restores:
tests/integration/test_upgrade.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List

import pytest

from etcd_agent.backup import archive
from etcd_agent.backup.service import take_backup
from etcd_agent.restore.host.facts import work_dir_for
from tests.harness.loopback import LoopbackCluster
from tests.harness.releases import DEFAULT, LEGACY

pytestmark = pytest.mark.integration

AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
EXTRA = f'[ssh]\nagent_path = "{AGENT}"\n'


def state(c: LoopbackCluster) -> Dict[str, object]:
    """What a refused restore must leave as it was: etcd pids, data dir entries, work dirs."""
    out: Dict[str, object] = {}
    for lm in c.members:
        d = c.cfg.data_dir(lm.member.name)
        out[lm.member.name] = (lm.backend.pid(), os.stat(d).st_ino, sorted(os.listdir(d)),
                               sorted(os.listdir(os.path.join(d, "member"))),
                               os.path.exists(work_dir_for(d, lm.member.name)))
    out["data"] = sorted(os.listdir(os.path.dirname(c.cfg.data_dir("m1"))))
    return out


def restore(c: LoopbackCluster, *args: str) -> "subprocess.CompletedProcess[str]":
    return subprocess.run([AGENT, "-c", c.config_path, "restore", *args], capture_output=True, text=True, timeout=300)


def test_backup_of_35_onto_34_refused_before_anything_is_touched(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    a = cluster_factory(3, extra=EXTRA, version=DEFAULT)
    a.start_static()
    with a.client() as cl:
        cl.put("/from-a", b"35")
    b35 = take_backup(a.cfg, member="m1")
    assert archive.read_manifest(b35.path)["etcd_version"] == DEFAULT

    b = cluster_factory(3, extra=EXTRA, version=LEGACY)
    b.start_static()
    with b.client() as cl:
        for i in range(20):
            cl.put(f"/b/{i}", b"34")
    before = state(b)

    lines: List[str] = []
    for args in (["--new-cluster"], []):  # seeding B from A's data; and in place, as if B were A
        res = restore(b, "--from", b35.path, "--yes", *args)
        assert res.returncode == 3, res.stdout + res.stderr
        err = res.stderr
        assert "restore refused by pre-checks; nothing touched" in err, err
        for m in b.cfg.members:
            assert f"{m.name} (local): pre-check FAILED: the backup is from etcd {DEFAULT}, this host has etcd " \
                   f"{LEGACY} and etcdctl {LEGACY}: restoring it would downgrade the cluster" in err, err
        assert "upgrade --to 3.5.x" in err
        assert state(b) == before, "a refused restore stopped or moved something"
        lines.append(next(ln for ln in err.splitlines() if "m1 (local): pre-check FAILED" in ln))
        if not args:  # in place, the layout/identity checks object as well: every reason is listed
            assert "foreign cluster" in err, err
    # the dry run refuses the same way (exit 3), and B still serves its own data on 3.4.23
    res = restore(b, "--from", b35.path, "--dry-run", "--new-cluster")
    assert res.returncode == 3 and "pre-check FAILED: the backup is from etcd 3.5.16" in res.stderr, res.stderr
    with b.client() as cl:
        assert cl.count_prefix("/b/") == 20 and cl.get("/from-a") is None
        assert {cl.status(m.client_url).version for m in b.cfg.members} == {LEGACY}
    assert state(b) == before
    with capsys.disabled():
        print(f"\nFIGURE cross-version refusal: backup of etcd {DEFAULT} onto etcd {LEGACY} hosts: exit 3, etcd pids, "
              f"data dirs and work dirs unchanged; {lines[0].split(': ', 1)[-1]}")
