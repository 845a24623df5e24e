"""Restore orchestration against scripted hosts: the real orchestrator, the real node protocol
client and server over pipes, real flocks for the host locks; no etcd, no SSH. Seconds, not
minutes: rollback, resume, busy, unreachable and stop-order cases that the real-component tiers
can only reach with real faults."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from typing import Dict, List, Sequence, Tuple

import pytest

from etcd_agent.config import Config, parse_text
from etcd_agent.errors import EXIT_BUSY, EXIT_FAILED, EXIT_REFUSED, AgentError, OperationFailed, RefusedError
from etcd_agent.etcd.snapdb import SnapshotIdentity
from etcd_agent.restore.orchestrator.commands import rollback_open
from etcd_agent.restore.orchestrator.options import Options
from etcd_agent.restore.orchestrator.orchestrate import Restore
from etcd_agent.restore.orchestrator.source import Source
from tests.harness.scripted import Script, ScriptedCluster, ScriptedHost, scripted_nodes

pytestmark = pytest.mark.component

CFG = """
[cluster]
name = "comp"
[etcd]
data_dir = "{d}/data/default.etcd"
[backup]
dir = "{d}/backups"
[daemon]
state_dir = "{d}/state"
[[member]]
name = "h1"
host = "10.0.0.1"
[[member]]
name = "h2"
host = "10.0.0.2"
[[member]]
name = "h3"
host = "10.0.0.3"
"""


def identity_of(cfg: Config) -> SnapshotIdentity:
    """A snapshot identity whose members are the config's (what a real snapshot's db would say)."""
    from etcd_agent.etcd.snapdb import Member as SnapshotMember
    from etcd_agent.etcd.snapdb import member_id_from

    members = tuple(SnapshotMember(member_id_from([m.peer_url], "comp"), m.name, (m.peer_url,), (), False)
                    for m in cfg.members)
    fields = {f.name: None for f in dataclasses.fields(SnapshotIdentity)}
    fields.update(size=4096, page_size=4096, txid=1, high_water=1, has_trailer=True, trailer_sha256=None,
                  trailer_verified=False, buckets=("key", "members", "meta"), members=members, removed_member_ids=(),
                  first_revision=None, last_revision=None, bucket_entries=None)
    return SnapshotIdentity(**fields)  # type: ignore[arg-type]


# h2 and h3 on one host (as on loopback), h1 on its own
SHARED = CFG.replace('host = "10.0.0.3"', 'host = "10.0.0.2"\nclient_url = "http://10.0.0.2:12379"\n'
                     'peer_url = "http://10.0.0.2:12380"').replace(
    'data_dir = "{d}/data/default.etcd"', 'data_dir = "{d}/data/{{name}}.etcd"\nconf_file = "{d}/conf/{{name}}.conf"')


class Bed:
    def __init__(self, tmp: str, leader: str = "h2", text: str = CFG) -> None:
        cfg, errors = parse_text(text.format(d=tmp), path=os.path.join(tmp, "agent.toml"))
        assert cfg is not None and not errors, errors
        self.cfg: Config = cfg
        self.script = Script(cfg)
        self.hosts: Dict[str, ScriptedHost] = {}
        for m in cfg.members:
            if m.ssh_host not in self.hosts:
                d = os.path.join(tmp, m.name, "backups")
                os.makedirs(d, mode=0o700)
                self.hosts[m.ssh_host] = ScriptedHost(m.name, self.script, cfg, d)
        self.cluster = ScriptedCluster(cfg, leader=leader)
        snap = os.path.join(tmp, "snap.db")
        with open(snap, "wb") as fh:
            fh.write(os.urandom(3 << 20))
        with open(snap, "rb") as fh:
            sha = hashlib.sha256(fh.read()).hexdigest()
        self.source = Source(snap, "agent", 3 << 20, sha, 42, "3.5.16", identity_of(cfg), snapshot_path=snap)

    def restore(self, here: Sequence[str] = (), **kw: object) -> Restore:
        """``here``: the hosts that are the master the restore runs on."""
        opts = Options(spec="latest", progress=lambda s: None, **kw)  # type: ignore[arg-type]
        return Restore(self.cfg, opts, nodes=scripted_nodes(self.script, self.hosts, here), cluster=self.cluster,
                       open_source=lambda cfg, spec, staging, now, meanwhile: self.source)

    def order(self, step: str) -> List[str]:
        return [m for _h, s, m in self.script.calls if s == step]


@pytest.fixture
def bed(tmp_path: object) -> Bed:
    return Bed(str(tmp_path))


def test_a_restore_runs_every_step_in_order_followers_before_the_leader(bed: Bed) -> None:
    out = bed.restore().run()
    assert out.done and out.downtime is not None
    for m in ("h1", "h2", "h3"):  # the followers halt (until their db is closed), then everyone stops
        assert bed.script.steps_of(m) == ["precheck", "begin", "receive", "restore", "fence"] + (
            [] if m == "h2" else ["halt"]) + ["stop", "aside", "install", "chown", "repair", "start", "serving", "unfence", "finish"]
    steps = [(s, m) for _h, s, m in bed.script.calls]
    assert max(steps.index(("halt", m)) for m in ("h1", "h3")) < steps.index(("stop", "h2"))  # the leader last
    assert set(bed.script.received.values()) == {bed.source.sha256}  # every member got the same bytes
    assert not bed.script.violations


def test_members_of_one_host_stop_together_and_the_leader_after_them(tmp_path: object) -> None:
    bed = Bed(str(tmp_path), leader="h1", text=SHARED)
    together = threading.Barrier(2, timeout=30)
    halted: List[str] = []

    def halt(member: str, args: object) -> Dict[str, object]:
        together.wait()  # h2 and h3 share a host: only halted at once do both get past this
        halted.append(member)
        return {"step": "halt", "member": member, "how": "db closed"}

    def stop(member: str, args: object) -> Dict[str, object]:
        assert member != "h1" or sorted(halted) == ["h2", "h3"], halted  # the leader once both have closed their db
        return {"step": "stop", "member": member}

    bed.script.steps["halt"] = halt
    bed.script.steps["stop"] = stop
    out = bed.restore().run()
    assert out.done and not bed.script.violations
    assert sorted(bed.order("halt")) == ["h2", "h3"] and sorted(bed.order("stop")) == ["h1", "h2", "h3"]
    for m in ("h1", "h2", "h3"):  # every member's stop (its exit) rides with its prepare steps
        assert bed.script.steps_of(m) == ["precheck", "begin", "receive", "restore", "fence"] + (
            [] if m == "h1" else ["halt"]) + ["stop", "aside", "install", "chown", "repair", "start", "serving", "unfence", "finish"]


def test_one_members_failure_among_its_hosts_names_it_the_others_steps_ran(tmp_path: object) -> None:
    bed = Bed(str(tmp_path), leader="h1", text=SHARED)
    bed.script.fail("aside", "h2", OperationFailed("h2: cannot rename the data dir: read-only file system"))
    with pytest.raises(OperationFailed) as ei:
        bed.restore().run()
    assert any(d.startswith("h2 (10.0.0.2): ") and "read-only" in d for d in ei.value.details), ei.value.details
    assert not any(d.startswith("h3") and "read-only" in d for d in ei.value.details)
    assert bed.script.steps_of("h3")[-2:] == ["repair", "rollback"]  # h3 finished its list, then rolled back
    assert "install" not in bed.script.steps_of("h2") and "start" not in bed.script.steps_of("h3")
    assert sorted(bed.order("rollback")) == ["h1", "h2", "h3"]


def test_a_failure_rolls_every_member_back_and_says_so(bed: Bed) -> None:
    bed.script.fail("restore", "h3", OperationFailed("h3: snapshot restore failed (exit 1): disk full"))
    with pytest.raises(OperationFailed) as ei:
        bed.restore().run()
    assert ei.value.exit_code == EXIT_FAILED
    assert "every member was rolled back" in ei.value.message
    assert any("disk full" in d for d in ei.value.details)
    assert sorted(bed.order("rollback")) == ["h1", "h2", "h3"]
    assert "start" not in bed.script.steps_of("h1")
    # the staged restore runs before the fence: a member that cannot restore stops nothing
    assert "fence" not in bed.script.steps_of("h1") and "stop" not in bed.script.steps_of("h1")


def test_healthy_but_served_by_an_old_etcd_is_no_restore(bed: Bed) -> None:
    # every member converged (the scripted cluster says so), but on h2 the old etcd still answers
    bed.script.fail("serving", "h2", OperationFailed("h2: the restored etcd is pid 42, yet pid 7 (/usr/bin/etcd) "
                                                     "listens on 10.0.0.2:2379"))
    with pytest.raises(OperationFailed) as ei:
        bed.restore().run()
    assert "every member was rolled back" in ei.value.message
    assert any("pid 7 (/usr/bin/etcd)" in d for d in ei.value.details), ei.value.details
    assert sorted(bed.order("rollback")) == ["h1", "h2", "h3"]
    assert "unfence" not in bed.script.steps_of("h1") and "finish" not in bed.script.steps_of("h1")


def test_a_host_lost_mid_restore_is_named_with_the_next_command(bed: Bed) -> None:
    h3 = bed.hosts["10.0.0.3"]
    h3.die_at = ("aside", "h3")  # the host vanishes during prepare

    def cut(member: str, args: object) -> Dict[str, object]:
        raise AssertionError("h3 must not answer after it vanished")

    orig_spawn = h3.spawn

    def spawn(argv: object) -> object:
        if h3.sessions and "serve" in argv:  # type: ignore[operator]
            h3.reachable = False  # it does not come back for the rollback either
        return orig_spawn(argv)  # type: ignore[arg-type]

    h3.spawn = spawn  # type: ignore[method-assign]
    with pytest.raises(OperationFailed) as ei:
        bed.restore().run()
    msg = ei.value.message
    assert "ROLLBACK INCOMPLETE" in msg and "etcd-agent restore rollback --yes" in msg
    assert any(d.startswith("h3") and "NOT rolled back" in d for d in ei.value.details), ei.value.details
    assert sorted(bed.order("rollback")) == ["h1", "h2"]
    # once h3 is back, `restore rollback` finishes it
    h3.reachable = True
    h3.spawn = orig_spawn  # type: ignore[method-assign]
    h3.die_at = None
    bed.script.facts["h3"] = {"journal": {"op": "the-op", "state": "running", "sha256": None, "token": "t",
                                          "backup": bed.source.path, "initial_cluster": "", "new_cluster": False,
                                          "steps": ["begin", "stop", "aside"]}}
    res = rollback_open(bed.cfg, nodes=scripted_nodes(bed.script, bed.hosts))
    assert res["rolled_back"]["the-op"]["ok"] and bed.order("rollback")[-1] == "h3"


def test_a_held_lock_is_busy_and_nothing_is_touched(bed: Bed) -> None:
    from etcd_agent.state.locks import Holder, OperationLock, SessionOwner, lock_path_for

    other = OperationLock(lock_path_for(bed.hosts["10.0.0.2"].cfg.backup.dir), "restore --from x",
                          holder=Holder(owner=SessionOwner("restore --from x", "master9", 77, "t")))
    with other:
        with pytest.raises(AgentError) as ei:
            bed.restore().run()
    assert ei.value.exit_code == EXIT_BUSY
    assert "master9 (pid 77)" in ei.value.message
    assert [s for _h, s, _m in bed.script.calls] == []  # not even a pre-check ran


def test_two_restores_at_once_exactly_one_wins(bed: Bed) -> None:
    results: List[Tuple[str, object]] = []
    go = threading.Barrier(2)

    def one(tag: str) -> None:
        r = bed.restore()
        go.wait()
        try:
            r.run()
            results.append((tag, "done"))
        except AgentError as exc:
            results.append((tag, exc.exit_code))

    threads = [threading.Thread(target=one, args=(t,)) for t in ("a", "b")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    outcomes = sorted(str(v) for _t, v in results)
    assert outcomes == [str(EXIT_BUSY), "done"], results
    assert bed.order("begin").count("h1") == 1  # the loser began nothing


def test_an_unreachable_host_refuses_with_every_hosts_report(bed: Bed) -> None:
    bed.hosts["10.0.0.3"].reachable = False
    with pytest.raises(RefusedError) as ei:
        bed.restore().run()
    assert ei.value.exit_code == EXIT_REFUSED and "nothing touched" in ei.value.message
    assert any(d.startswith("h3 (10.0.0.3): unreachable") and "connect timed out" in d for d in ei.value.details)
    # the others were still asked (read-only), so the report covers every host; nothing began
    assert sorted(m for _h, s, m in bed.script.calls) == ["h1", "h2"]
    assert {s for _h, s, _m in bed.script.calls} == {"precheck"}


def test_a_failed_precheck_refuses_with_a_per_host_report(bed: Bed) -> None:
    bed.script.facts["h2"] = {"free_bytes": 10}
    with pytest.raises(RefusedError) as ei:
        bed.restore().run()
    assert any(d.startswith("h2") and "bytes free" in d for d in ei.value.details), ei.value.details
    assert "begin" not in [s for _h, s, _m in bed.script.calls]


def test_a_journaled_restore_of_the_same_backup_resumes(bed: Bed) -> None:
    journal = {"op": "20261201T000000Z-abcd", "state": "running", "sha256": bed.source.sha256, "token": "tok-1",
               "backup": bed.source.path, "initial_cluster": "", "new_cluster": False, "steps": ["begin", "receive"]}
    for m in ("h1", "h2", "h3"):
        bed.script.facts[m] = {"journal": journal}
    out = bed.restore().run()
    assert out.plan.resuming and out.plan.op == journal["op"] and out.plan.token == "tok-1"
    assert bed.script.received == {}  # shipped already: not again
    assert not bed.script.violations


def test_the_cluster_not_converging_rolls_back(bed: Bed) -> None:
    bed.cluster.converge = False
    with pytest.raises(OperationFailed) as ei:
        bed.restore(health_timeout=1.0).run()
    assert "rolled back" in ei.value.message and sorted(bed.order("rollback")) == ["h1", "h2", "h3"]


def test_a_snapshot_of_another_cluster_is_refused_from_its_content(bed: Bed) -> None:
    # the hosts' data dirs hold a cluster whose member ids the snapshot's db does not have
    for m in ("h1", "h2", "h3"):
        bed.script.facts[m] = {"db_member_ids": ["abc1", "abc2", "abc3"], "data_dir_state": "member"}
    with pytest.raises(RefusedError) as ei:
        bed.restore().run()
    text = " ".join(ei.value.details)
    assert "--new-cluster" in text, ei.value.details
    assert "begin" not in [s for _h, s, _m in bed.script.calls]
    # the operator says so on purpose: it proceeds
    out = bed.restore(new_cluster=True).run()
    assert out.done


def test_a_snapshot_proven_ours_says_how(bed: Bed) -> None:
    ids = [f"{x:x}" for x in bed.source.identity.member_ids]  # type: ignore[union-attr]
    bed.script.facts["h1"] = {"bootstrap_member_id": ids[0]}
    out = bed.restore(dry_run=True).run()
    assert out.plan.ok and any(e.startswith("proven:") and ids[0] in e for e in out.plan.evidence), out.plan.evidence


def _journaled(bed: Bed, state: str, steps: Sequence[str], token: str = "tok-1") -> Dict[str, object]:
    ic = ",".join(f"{m.name}={m.peer_url}" for m in bed.cfg.members)
    return {"op": "20261201T000000Z-abcd", "state": state, "sha256": bed.source.sha256, "token": token,
            "backup": bed.source.path, "initial_cluster": ic, "new_cluster": False, "steps": list(steps)}


UNFENCED = ["begin", "receive", "restore", "fence", "halt", "stop", "aside", "install", "chown", "repair", "start",
            "unfence"]


def test_a_member_that_finished_is_left_alone_and_the_others_finished(bed: Bed) -> None:
    """Killed when h1 had journaled finish and h2, h3 had not: the re-run finishes h2 and h3 and
    never asks h1 for a step (its journal says done: a step there would be refused)."""
    bed.script.facts["h1"] = {"journal": _journaled(bed, "done", UNFENCED + ["finish"])}
    for m in ("h2", "h3"):
        bed.script.facts[m] = {"journal": _journaled(bed, "running", UNFENCED)}
    out = bed.restore().run()
    assert out.done and out.plan.resuming
    assert bed.script.steps_of("h1") == ["precheck"]
    for m in ("h2", "h3"):
        assert bed.script.steps_of(m)[-2:] == ["unfence", "finish"] and "rollback" not in bed.script.steps_of(m)


def test_a_resume_that_fails_after_a_member_finished_is_not_rolled_back(bed: Bed) -> None:
    bed.script.facts["h1"] = {"journal": _journaled(bed, "done", UNFENCED + ["finish"])}
    for m in ("h2", "h3"):
        bed.script.facts[m] = {"journal": _journaled(bed, "running", UNFENCED)}
    bed.cluster.converge = False
    with pytest.raises(OperationFailed) as ei:
        bed.restore(health_timeout=1.0).run()
    msg = ei.value.message
    assert "not finished" in msg and "not rolled back" in msg and "finished on h1" in msg, msg
    assert f"etcd-agent restore --from {bed.source.path} --yes" in msg
    assert bed.order("rollback") == []


def test_a_resume_whose_members_serve_the_restored_cluster_goes_only_forward(bed: Bed) -> None:
    """None finished, but h2's etcd answers with the ids the restore makes (its token and peer
    URLs): a failure now must not roll back."""
    from etcd_agent.restore.orchestrator.precheck import restored_ids

    for m in ("h1", "h2", "h3"):
        bed.script.facts[m] = {"journal": _journaled(bed, "running", UNFENCED[:-1])}
    ids, cluster = restored_ids(str(_journaled(bed, "running", [])["initial_cluster"]), "tok-1")
    bed.cluster.member_ids = lambda: {"h2": (f"{ids['h2']:x}", f"{cluster:x}")}  # type: ignore[method-assign]
    bed.script.fail("unfence", "h3", OperationFailed("h3: apiserver unit failed to start"))
    with pytest.raises(OperationFailed) as ei:
        bed.restore().run()
    assert "not rolled back" in ei.value.message and "served by h2" in ei.value.message, ei.value.message
    assert bed.order("rollback") == []
    # the same with no member serving it: every member rolled back, as before
    bed.script.calls.clear()
    bed.cluster.member_ids = lambda: {"h2": ("abc", "def")}  # type: ignore[method-assign]
    with pytest.raises(OperationFailed) as ei:
        bed.restore().run()
    assert "every member was rolled back" in ei.value.message
    assert sorted(bed.order("rollback")) == ["h1", "h2", "h3"]


def test_rollback_refused_when_a_member_finished_the_restore(bed: Bed) -> None:
    bed.script.facts["h1"] = {"journal": _journaled(bed, "done", UNFENCED + ["finish"])}
    for m in ("h2", "h3"):
        bed.script.facts[m] = {"journal": _journaled(bed, "running", UNFENCED)}
    for dry in (True, False):
        with pytest.raises(RefusedError) as ei:
            rollback_open(bed.cfg, dry_run=dry, nodes=scripted_nodes(bed.script, bed.hosts))
        assert ei.value.exit_code == EXIT_REFUSED
        assert any("finished on h1" in d and "h2, h3 alone would leave two clusters" in d for d in ei.value.details)
    assert bed.order("rollback") == []


def test_rollback_incomplete_names_only_hosts_that_did_not_answer(bed: Bed) -> None:
    bed.script.fail("restore", "h3", OperationFailed("h3: snapshot restore failed (exit 1): disk full"))
    bed.script.fail("rollback", "h2", OperationFailed("h2: cannot rename the data dir back: read-only file system"))
    with pytest.raises(OperationFailed) as ei:
        bed.restore().run()
    msg = ei.value.message
    assert "ROLLBACK INCOMPLETE" in msg and "answer again" not in msg, msg
    assert any(d.startswith("h2") and "NOT rolled back" in d and "read-only" in d for d in ei.value.details)


def test_rollback_names_members_left_in_two_clusters(bed: Bed) -> None:
    """No open journal, but one restore finished on h1, h2 and rolled back on h3 (what a re-run
    by an older agent left): not "no unfinished restore is journaled", but the split, named."""
    for m, state in (("h1", "done"), ("h2", "done"), ("h3", "rolled-back")):
        bed.script.facts[m] = {"journal": _journaled(bed, state, UNFENCED)}
    with pytest.raises(OperationFailed) as ei:
        rollback_open(bed.cfg, nodes=scripted_nodes(bed.script, bed.hosts))
    assert "two clusters" in ei.value.message
    assert any("finished on h1, h2 but was rolled back on h3" in d for d in ei.value.details), ei.value.details
