"""`etcd-agent restore` on an etcd 3.5 toolchain: etcd, etcdctl and etcdutl 3.5.16 (Debian trixie's,
laid out under /opt/etcd by ``packaging/install-deps.sh test``).

The 3.4 tests (test_restore.py) restore with `etcdctl snapshot restore`; here the snapshot tool is
etcdutl, as on 3.5+ masters, and etcdutl >= 3.5.10 bumps the revision and marks it compacted (the
Kubernetes-safe path). That etcdutl 3.5.0-3.5.9 get no such flags is plan logic
(tests/unit/test_restore_plan.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List

import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.cli.main import main
from etcd_agent.hosts.local import LocalHost
from etcd_agent.restore.plan import BUMP_REVISION, can_bump
from tests.harness.loopback import LoopbackCluster
from tests.harness.releases import DEFAULT, release

pytestmark = pytest.mark.integration

AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
EXTRA = f'[ssh]\nagent_path = "{AGENT}"\n'
KEYS, LATER = 1_000, 100


def tool_version(path: str) -> str:
    out = subprocess.run([path, "version"], capture_output=True, text=True, timeout=30, check=True).stdout
    return out.splitlines()[0].split(":", 1)[1].strip()  # "etcdutl version: 3.5.16"


def bump_tools() -> Dict[str, str]:
    """etcd/etcdctl/etcdutl of the default release, whose etcdutl has --bump-revision (3.5.10+)."""
    rel = release(DEFAULT)
    assert rel.etcdutl is not None and can_bump(tool_version(rel.etcdutl)), rel
    return {"etcd": rel.etcd, "etcdctl": rel.etcdctl, "etcdutl": rel.etcdutl}


def make(cluster_factory: Any, tools: Dict[str, str]) -> LoopbackCluster:
    c = cluster_factory(3, extra=EXTRA, version=DEFAULT)
    assert (c.cfg.etcd.binary, c.cfg.etcd.etcdctl, c.cfg.etcd.etcdutl) == (tools["etcd"], tools["etcdctl"], tools["etcdutl"])
    c.start_static()
    with c.client() as cl:
        assert {cl.status(m.client_url).version for m in c.cfg.members} == {tool_version(tools["etcdctl"])}
    return c


def revisions(c: LoopbackCluster) -> List[int]:
    with c.client() as cl:
        return [cl.status(m.client_url).revision for m in c.cfg.members]


def get_at(c: LoopbackCluster, key: str, rev: int) -> "subprocess.CompletedProcess[str]":
    """A real etcdctl read of ``key`` at an old revision (the agent's client has no ranged-rev read)."""
    argv = [c.cfg.etcd.etcdctl, f"--endpoints={c.cfg.members[0].client_url}", "get", key, f"--rev={rev}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"})


def disaster(c: LoopbackCluster, capsys: Any) -> Dict[str, Any]:
    """Keys, backup, later keys, dry run, data dirs deleted, restore --yes: what the test asserts on."""
    with c.client() as cl:
        for i in range(KEYS):
            cl.put(f"/k/{i:06d}", b"v" * 32)
    b = take_backup(c.cfg, member="m1")
    with c.client() as cl:
        for i in range(LATER):
            cl.put(f"/later/{i:06d}", b"w")
    before = revisions(c)
    capsys.readouterr()
    assert main(["-c", c.config_path, "restore", "--from", b.path, "--dry-run"]) == 0
    plan_text = capsys.readouterr().out
    argv_line = next(ln.strip() for ln in plan_text.splitlines() if ln.strip().startswith("$ ") and "--name=m1" in ln)
    c.stop()
    for m in c.cfg.members:
        shutil.rmtree(c.cfg.data_dir(m.name))
    assert main(["-c", c.config_path, "restore", "--from", b.path, "--yes"]) == 0, capsys.readouterr().err
    with c.client() as cl:
        counts = [cl.count_prefix("/k/"), cl.count_prefix("/later/")]
        health = [cl.healthy(m.client_url) for m in c.cfg.members]
    return {"backup": b, "before": before, "after": revisions(c), "plan": plan_text, "argv": argv_line,
            "counts": counts, "health": health}


def test_restore_bumped_and_compacted(cluster_factory, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tools = bump_tools()
    c = make(cluster_factory, tools)
    r = disaster(c, capsys)
    b = r["backup"]

    assert r["argv"].startswith(f"$ {tools['etcdutl']} snapshot restore ")
    assert r["argv"].endswith(f"--bump-revision={BUMP_REVISION} --mark-compacted"), r["argv"]
    assert "NOT bumped" not in r["plan"] and "revision bumped by" in r["plan"]
    assert r["counts"] == [KEYS, 0]
    assert all(ok for ok, _ in r["health"]), r["health"]
    after = r["after"]
    assert len(set(after)) == 1 and after[0] >= b.revision + BUMP_REVISION and after[0] > max(r["before"])
    # every revision up to the bumped one is compacted: an apiserver's watch from before the restore
    # gets "compacted" and relists instead of resuming on history that never happened
    old = get_at(c, "/k/000000", b.revision)
    assert old.returncode != 0 and "compacted" in old.stderr, (old.stdout, old.stderr)
    with capsys.disabled():
        print(f"\nFIGURE restore-etcd-bump: dry-run {r['argv']}")
        print(f"FIGURE restore-etcd-bump: backup revision {b.revision}, before restore {r['before']}, after {after}; "
              f"read at --rev={b.revision}: {old.stderr.strip().splitlines()[-1:]}")

    # `backup verify` and the backup's own check run `etcdutl snapshot status` (3.5 deprecates the etcdctl one)
    seen: List[List[str]] = []
    real_run = LocalHost.run

    def spy(self: LocalHost, argv: Any, **kw: Any) -> Any:  # records, then runs the real command
        seen.append(list(argv))
        return real_run(self, argv, **kw)

    monkeypatch.setattr(LocalHost, "run", spy)
    nb = take_backup(c.cfg, member="m2", full_verify=True)  # of the restored cluster (a new cluster id)
    capsys.readouterr()
    assert main(["-c", c.config_path, "backup", "verify", nb.path]) == 0, capsys.readouterr().out
    assert "snapshot status ok" in capsys.readouterr().out
    status_calls = [a for a in seen if a[1:3] == ["snapshot", "status"]]
    assert len(status_calls) >= 2 and all(a[0] == tools["etcdutl"] for a in status_calls), seen
