"""Pure restore logic: plan and argv per host, pre-check rules, journal resume, conf rewrite, cleanup."""
from __future__ import annotations

from typing import Any, Dict

from etcd_agent.config import parse_text
from etcd_agent.restore.host import conf as HC
from etcd_agent.restore.host import facts as HF
from etcd_agent.restore.host import setaside as HS
from etcd_agent.restore.host.journal import JournalSummary
from etcd_agent.restore.orchestrator import plan as P
from etcd_agent.restore.orchestrator import precheck as C
from etcd_agent.topology import Bootstrap, parse_conf

CFG_TEXT = """
[cluster]
name = "k8s"
[etcd]
data_dir = "/var/lib/etcd/default.etcd"
[kubernetes]
fence = "unit"
[[member]]
name = "master1"
host = "10.0.0.1"
[[member]]
name = "master2"
host = "10.0.0.2"
[[member]]
name = "master3"
host = "10.0.0.3"
"""


def cfg(text: str = CFG_TEXT) -> Any:
    c, errors = parse_text(text)
    assert not errors, errors
    return c


def manifest(**kw: Any) -> Dict[str, Any]:
    m = {
        "revision": 10001,
        "etcd_version": "3.4.23",
        "cluster": {"name": "k8s", "id": "abc"},
        "files": {"etcd_snapshot.db": {"sha256": "f" * 64, "size": 1000}},
        "members": [
            {"name": f"master{i}", "peer_urls": [f"http://10.0.0.{i}:2380"]} for i in (1, 2, 3)
        ],
    }
    m.update(kw)
    return m


def facts(c: Any, name: str, **kw: Any) -> HF.NodeFacts:
    m = c.member(name)
    d = {
        "member": name, "protocol": HF.NODE_PROTOCOL, "agent_version": "0.1.0", "etcd_version": "3.4.23",
        "etcdctl_version": "3.4.23", "etcdutl_version": None, "free_bytes": 10**10, "data_dir": c.data_dir(name),
        "data_dir_state": "member", "work_dir": HF.work_dir_for(c.data_dir(name), name), "conf_file": c.conf_file(name),
        "conf_present": True, "unit_present": True, "backend": "systemd", "running": True, "fence_ok": True,
        "fence_detail": "", "identity_match": True, "peer_url": m.peer_url, "client_url": m.client_url,
    }
    d.update(kw)
    return HF.NodeFacts.from_json(d, "test")


def check(c: Any, name: str, **kw: Any) -> list:
    return C.check_host(c, c.member(name), facts(c, name, **kw), snapshot_size=1000,
                        snapshot_version="3.4.23", agent_version="0.1.0", resuming=False)


def source() -> P.SourceFacts:
    m = manifest()
    return P.SourceFacts("agent", m["revision"], 1000, m["files"]["etcd_snapshot.db"]["sha256"], ("checked: test",))


def test_plan_argv_per_host() -> None:
    c = cfg()
    host_of = {m.name: m.ssh_host for m in c.members}
    plan = P.build_plan(c, op="op1", backup="/b/etcd-x.tar", source=source(), token="tok-1", host_of=host_of,
                        facts={m.name: facts(c, m.name) for m in c.members}, new_cluster=False, resuming=False)
    ic = "master1=http://10.0.0.1:2380,master2=http://10.0.0.2:2380,master3=http://10.0.0.3:2380"
    assert plan.initial_cluster == ic and plan.ok
    h2 = plan.hosts[1]
    restore = next(s for s in h2.steps if s.name == "restore")
    assert restore.argv == (
        "/usr/bin/etcdctl", "snapshot", "restore", "/var/lib/etcd/.etcd-agent-restore-master2/etcd_snapshot.db",
        "--name=master2", f"--initial-cluster={ic}", "--initial-cluster-token=tok-1",
        "--initial-advertise-peer-urls=http://10.0.0.2:2380", "--data-dir=/var/lib/etcd/default.etcd.restoring",
        "--skip-hash-check",  # the receiver checked etcd's trailer as the copy landed
    )
    names = [s.name for s in h2.steps]
    # the restore itself staged while etcd serves; only stop, aside, install, chown, repair, start after the fence
    assert names.index("receive") < names.index("restore") < names.index("fence") < names.index("stop")
    assert names.index("stop") < names.index("aside") < names.index("install") < names.index("start")
    chown = next(s for s in h2.steps if s.name == "chown")
    assert chown.argv == ("chown", "-R", "etcd:etcd", "/var/lib/etcd/default.etcd")
    assert not plan.bump and "etcd 3.4" in plan.bump_note
    text = P.render_plan(plan)
    assert "kube-apiserver.service" in text and "--name=master3" in text


def test_bump_only_with_etcdutl_3510() -> None:
    c = cfg(CFG_TEXT.replace("[etcd]", '[etcd]\netcdutl = "/usr/bin/etcdutl"'))
    # 3.5.0-3.5.9 reject --bump-revision as an unknown flag (seen with etcdutl 3.5.1)
    old = {m.name: facts(c, m.name, etcdutl_version="3.5.9") for m in c.members}
    plan = P.build_plan(c, op="o", backup="b", source=source(), token="t", host_of={m.name: "x" for m in c.members},
                        facts=old, new_cluster=False, resuming=False)
    argv = next(s for s in plan.hosts[0].steps if s.name == "restore").argv
    assert not plan.bump and "etcdutl 3.5.9 has no --bump-revision" in plan.bump_note
    assert argv is not None and argv[0] == "/usr/bin/etcdutl" and not any("bump" in a or "compacted" in a for a in argv)
    fs = {m.name: facts(c, m.name, etcdutl_version="3.5.10") for m in c.members}
    plan = P.build_plan(c, op="o", backup="b", source=source(), token="t", host_of={m.name: "x" for m in c.members},
                        facts=fs, new_cluster=False, resuming=False)
    argv = next(s for s in plan.hosts[0].steps if s.name == "restore").argv
    assert argv is not None and argv[0] == "/usr/bin/etcdutl"
    assert f"--bump-revision={P.BUMP_REVISION}" in argv and "--mark-compacted" in argv
    fs["master3"] = facts(c, "master3", etcdutl_version="3.4.0")
    plan = P.build_plan(c, op="o", backup="b", source=source(), token="t", host_of={m.name: "x" for m in c.members},
                        facts=fs, new_cluster=False, resuming=False)
    assert not plan.bump


def test_bump_follows_the_tools_the_hosts_run() -> None:
    """After a rolling upgrade agent.toml still names 3.4's etcdctl and no etcdutl; each host
    restores with its pinned release's tools, and those decide the bump - all hosts or none."""
    c = cfg()
    assert c.etcd.etcdutl is None
    pinned = {"etcd_version": "3.5.16", "etcdctl_version": "3.5.16", "etcdutl_version": "3.5.16",
              "etcdctl_path": "/opt/etcd/3.5.16/etcdctl", "etcdutl_path": "/opt/etcd/3.5.16/etcdutl"}
    fs = {m.name: facts(c, m.name, **pinned) for m in c.members}
    plan = P.build_plan(c, op="o", backup="b", source=source(), token="t", host_of={m.name: "x" for m in c.members},
                        facts=fs, new_cluster=False, resuming=False)
    assert plan.bump and "revision bumped by" in plan.bump_note
    for h in plan.hosts:
        argv = next(s for s in h.steps if s.name == "restore").argv
        assert argv is not None and argv[0] == "/opt/etcd/3.5.16/etcdutl" and argv[-2:] == ("--mark-compacted", "--skip-hash-check"), argv
    assert all(check(c, m.name, **pinned) == [] for m in c.members)
    # one host not upgraded (no pin): nobody bumps, and the note names it
    fs["master2"] = facts(c, "master2", etcdctl_path="/usr/bin/etcdctl")
    plan = P.build_plan(c, op="o", backup="b", source=source(), token="t", host_of={m.name: "x" for m in c.members},
                        facts=fs, new_cluster=False, resuming=False)
    assert not plan.bump and "master2 restore with etcdctl (etcd 3.4)" in plan.bump_note, plan.bump_note
    tools = {h.member: next(s for s in h.steps if s.name == "restore").argv for h in plan.hosts}
    assert tools["master2"][0] == "/usr/bin/etcdctl" and tools["master1"][0] == "/opt/etcd/3.5.16/etcdutl"
    assert not any("--mark-compacted" in a for argv in tools.values() for a in argv)
    # a pinned etcdutl that does not run is refused before anything is touched
    assert any("etcdutl /opt/etcd/3.5.16/etcdutl is configured but does not run" in p
               for p in check(c, "master1", **{**pinned, "etcdutl_version": None}))


def test_a_newer_minor_backup_is_refused_with_the_way_out() -> None:
    c = cfg()
    probs = C.check_host(c, c.member("master1"), facts(c, "master1"), snapshot_size=1000,
                         snapshot_version="3.5.16", agent_version="0.1.0", resuming=False)
    assert probs == [
        "the backup is from etcd 3.5.16, this host has etcd 3.4.23 and etcdctl 3.4.23: restoring it would downgrade "
        "the cluster to an older minor release, which etcd does not support; install etcd 3.5 here and upgrade "
        "the cluster to it first (etcd-agent upgrade --to 3.5.x), or restore a backup taken on the release this host runs"
    ]
    # older and newer patches of one minor, and any older minor, restore
    newer = {"etcd_version": "3.5.30", "etcdctl_version": "3.5.30", "etcdutl_version": "3.5.30"}
    for snap in ("3.5.30", "3.5.1", "3.4.23"):
        assert C.check_host(c, c.member("master1"), facts(c, "master1", **newer), snapshot_size=1000,
                            snapshot_version=snap, agent_version="0.1.0", resuming=False) == [], snap


def test_fence_once_per_host() -> None:
    c = cfg()
    assert P.fence_owners(c, {"master1": "local", "master2": "local", "master3": "h3"}) == {
        "master1": True, "master2": False, "master3": True,
    }


def test_host_rules() -> None:
    c = cfg()
    assert check(c, "master1") == []
    assert any("node protocol" in p for p in check(c, "master1", protocol=99))
    assert any("bytes free" in p for p in check(c, "master1", free_bytes=10))
    assert any("configs differ" in p for p in check(c, "master1", data_dir="/elsewhere"))
    assert any("wrong ssh_host" in p for p in check(c, "master1", identity_match=False))
    assert any("fencing" in p for p in check(c, "master1", fence_ok=False, fence_detail="no unit"))
    assert any("neither etcdutl nor etcdctl" in p for p in check(c, "master1", etcdctl_version=None))
    assert any("this host has etcdctl 3.3.1: restoring it would downgrade" in p for p in check(c, "master1", etcdctl_version="3.3.1"))
    assert any("TLS file" in p for p in check(c, "master1", tls_missing=["/x.crt"]))
    assert any("unfinished restore" in p for p in check(c, "master1", journal=_journal("x").to_json()))
    assert check(c, "master1", journal=_journal("x", "done").to_json()) == []


def _journal(op: str, state: str = "running", backup: str = "/b/x.tar", sha: "str | None" = "s") -> JournalSummary:
    return JournalSummary(op, state, sha, "t", backup, "a=http://a:2380", False, ("begin", "fence"))


def test_resume_decision() -> None:
    assert C.resume_decision({"a": None, "b": _journal("o", "done")}, "/b/x.tar", "s") == (None, [])
    j = _journal("o1")
    got, problems = C.resume_decision({"a": j, "b": None}, "/b/x.tar", "s")
    assert got is not None and got.token == "t" and problems == []
    got, problems = C.resume_decision({"a": j}, "/b/x.tar", "other")  # same file, other bytes
    assert got is None and "resume" in problems[0]
    got, problems = C.resume_decision({"a": j}, "/b/y.tar", "s")  # another backup
    assert got is None and "rollback --yes" in problems[0]
    got, problems = C.resume_decision({"a": j, "b": _journal("o2")}, "/b/x.tar", "s")
    assert got is None and "different unfinished" in problems[0]
    # a runbook restore journals no sha256 until the snapshot has been shipped: same file resumes
    got, problems = C.resume_decision({"a": _journal("o3", sha=None)}, "/b/x.tar", None)
    assert got is not None and got.op == "o3"


def test_resume_forward_from_the_hosts() -> None:
    """A re-run goes only forward when a member finished the restore (its journal) or its etcd
    answers as the restored cluster (the ids etcd derives from the peer URLs and the token)."""
    ic = "a=http://a:2380,b=http://b:2380,c=http://c:2380"
    ids, cluster = C.restored_ids(ic, "tok")
    assert set(ids) == {"a", "b", "c"} and len(set(ids.values())) == 3
    other_ids, other_cluster = C.restored_ids(ic, "old-token")  # the old cluster: another token
    assert other_cluster != cluster
    live = {"a": (f"{ids['a']:x}", f"{cluster:x}"), "b": (f"{other_ids['b']:x}", f"{other_cluster:x}"),
            "c": (f"{ids['b']:x}", f"{cluster:x}")}  # c answers with another member's id: not c of the restore
    assert C.serving_restored(live, ic, "tok") == ["a"]
    journals = {"a": _journal("o", "done"), "b": _journal("o"), "c": _journal("o"), "d": _journal("x", "done")}
    r = C.resume_state(journals, live, "o", ic, "tok")
    assert r.finished == ("a",) and r.serving == ("a",) and r.forward
    assert "finished on a" in r.describe()
    back = C.resume_state({"a": _journal("o"), "b": _journal("o")}, {"b": live["b"]}, "o", ic, "tok")
    assert not back.forward and back.describe() == "no member serves the restored cluster yet"
    # another backup given while a member finished: resuming is the only way out, not a rollback
    got, problems = C.resume_decision(journals, "/b/y.tar", "s")
    assert got is None and "finished it" in problems[0] and "rollback" not in problems[0]
    # a rollback cut off half-way (a rolled back, b not): never forward, the rollback finished first
    got, problems = C.resume_decision({"a": _journal("o", "rolled-back"), "b": _journal("o")}, "/b/x.tar", "s")
    assert got is None and "was being rolled back (rolled back on a, not on b)" in problems[0], problems
    assert "etcd-agent restore rollback --yes" in problems[0]


def test_rollback_refused_when_a_member_finished() -> None:
    assert C.rollback_refusal({"a": _journal("o"), "b": _journal("o"), "c": None}) == []
    assert C.rollback_refusal({"a": _journal("o"), "b": _journal("old", "done")}) == []  # another restore
    got = C.rollback_refusal({"a": _journal("o", "done"), "b": _journal("o", "done"), "c": _journal("o")})
    assert len(got) == 1 and "finished on a, b" in got[0] and "rolling back c alone would leave two clusters" in got[0]
    assert "etcd-agent restore --from /b/x.tar --yes" in got[0]
    # what an older agent's re-run could leave: finished here, rolled back there - two clusters
    assert C.split_by_restore({"a": _journal("o", "done"), "b": _journal("o", "rolled-back")}) == [
        "restore o finished on a but was rolled back on b: they are in two clusters; restore a backup again to put "
        "every member on one"]
    assert C.split_by_restore({"a": _journal("o", "done"), "b": _journal("p", "rolled-back"), "c": None}) == []


def test_rewrite_conf_keeps_tuning() -> None:
    c = cfg()
    m = c.member("master2")
    old = "# archive conf of master1\nETCD_NAME=master1\nETCD_HEARTBEAT_INTERVAL=250\nETCD_LISTEN_PEER_URLS=http://10.0.0.1:2380\nETCD_NAME=dup\n"
    values = HC.restore_conf_values(c, m, Bootstrap("master2", "existing", "master1=a,master2=b", "tok"))
    new = parse_conf(HC.rewrite_conf(old, values))
    assert new["ETCD_NAME"] == "master2" and new["ETCD_HEARTBEAT_INTERVAL"] == "250"
    assert new["ETCD_LISTEN_PEER_URLS"] == m.peer_url and new["ETCD_ADVERTISE_CLIENT_URLS"] == m.client_url
    assert new["ETCD_INITIAL_CLUSTER_TOKEN"] == "tok" and new["ETCD_INITIAL_CLUSTER"] == "master1=a,master2=b"
    assert HC.rewrite_conf(old, values).count("ETCD_NAME=") == 1


def test_cleanup_keeps_newest() -> None:
    entries = [
        "default.etcd", "default.etcd.pre-restore-20240101T000000Z", "default.etcd.pre-restore-20240301T000000Z",
        "default.etcd.failed-restore-20240201T000000Z", "other.etcd.pre-restore-20240401T000000Z", ".etcd-agent-restore-m1",
    ]
    d = HS.cleanup_plan("/var/lib/etcd/default.etcd", entries, keep=1)
    assert [(x.path.rsplit("/", 1)[1], x.keep) for x in d] == [
        ("default.etcd.pre-restore-20240301T000000Z", True),
        ("default.etcd.failed-restore-20240201T000000Z", False),
        ("default.etcd.pre-restore-20240101T000000Z", False),
    ]
    assert all(not x.keep for x in HS.cleanup_plan("/var/lib/etcd/default.etcd", entries, keep=0))


def test_tokens() -> None:
    assert C.token_problem(C.default_token("k8s", "20240101T000000Z")) is None
    assert C.token_problem("bad token;rm") is not None


def test_two_restores_of_one_backup_in_the_same_second_get_different_ids() -> None:
    """A retry right after a rolled-back restore is a new restore: its journal is not the old one's."""
    from etcd_agent.restore.orchestrator.options import new_op_id

    ids = {new_op_id("20261201T160000Z", "ab" * 32) for _ in range(50)}
    assert len(ids) == 50
    assert all(i.startswith("20261201T160000Z-abababab-") for i in ids)
    assert new_op_id("20261201T160000Z", None).startswith("20261201T160000Z-runbook-")
