"""The cluster-wide restore: every member's host driven through its node session.

One ``NodeClient`` session per host (this one through a child process, the others over SSH),
opened in parallel; then the hosts' operation locks are taken one host at a time in a fixed
order, so of two restores started together exactly one gets them all and the other is refused
(exit 4) having touched nothing. Every lock lives as long as its session.

Phases: read the archive -> lock every host -> pre-checks everywhere (nothing touched; exit 3
with a per-host report; a point-in-time source's replay runs while the hosts are locked and
pre-checked: ``meanwhile``) -> begin (journals; the daemons go hands-off) -> ship the snapshot to
every member while etcd still serves (hashed as it is sent and as it lands) -> fence the
apiservers -> stop the followers, then the leader -> set aside, restore, chown, repair -> start
-> wait until every member is healthy at one revision -> unfence -> finish. Simple steps go to a
host in one ``steps`` call for all its members, which it runs at once; the leader's stop rides in
the same call as everyone's set-aside and restore (it only has to follow its followers' stop).
Any failure after
``begin`` rolls every member back and reports what is true afterwards; when a host cannot be
rolled back the error names it and the command to run once it is back. A resumed restore that a
member finished, or whose restored cluster a member serves, only goes forward (``Resume``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from etcd_agent.backup.identity import Evidence, HostIds, Verdict, judge
from etcd_agent.config import Config, Member
from etcd_agent.errors import (
    AgentError,
    HostUnreachable,
    Interrupted,
    OperationFailed,
    RefusedError,
    UsageError,
    error_from_json,
)
from etcd_agent.fs import ensure_private_dir
from etcd_agent.node.client import NodeClient, new_owner
from etcd_agent.node.protocol import Owner
from etcd_agent.node.replies import RollbackReply, StepReply, StepsReply
from etcd_agent.node.sessions import (
    HostNode,
    StopWaiting,
    close_sessions,
    group_hosts,
    message,
    no_answer,
    open_sessions,
    parallel,
)
from etcd_agent.restore.host.facts import NodeFacts
from etcd_agent.restore.host.journal import JournalSummary
from etcd_agent.restore.orchestrator import plan as P
from etcd_agent.restore.orchestrator.finish import finish, folded, load_tail, served, unfence
from etcd_agent.restore.orchestrator.live import EtcdCluster, LiveCluster
from etcd_agent.restore.orchestrator.meanwhile import HostsAhead, Meanwhile
from etcd_agent.restore.orchestrator.options import LEFT_AS_IS, Options, Outcome, new_op_id
from etcd_agent.restore.orchestrator.precheck import (
    Resume,
    check_host,
    default_token,
    resume_decision,
    resume_state,
    set_aside_problems,
    token_problem,
)
from etcd_agent.restore.orchestrator.ship import Standby
from etcd_agent.restore.orchestrator.source import Source, source_for
from etcd_agent.restore.orchestrator.stage import stage

log = logging.getLogger(__name__)

PREPARE = ["aside", "install", "chown", "repair"]  # a stopped member's steps before it starts


# ---------------------------------------------------------------- restore


class Restore:
    """One restore run. ``nodes`` (the hosts and how to reach them), ``cluster`` (the running
    cluster's client view) and ``open_source`` default to the real ones; the component tier
    passes scripted hosts and a scripted cluster to drive the orchestration without etcd."""

    def __init__(self, cfg: Config, opts: Options, *, nodes: Optional[Callable[[Config], List[HostNode]]] = None,
                 cluster: Optional[LiveCluster] = None,
                 open_source: Optional[Callable[[Config, str, str, bool, Meanwhile], Source]] = None) -> None:
        # open_source(cfg, --from spec, staging parent dir, hash now, meanwhile): the backup resolved
        # and read; ``meanwhile.start`` once its own checks passed opens the hosts while it goes on
        self.cfg = cfg
        self.opts = opts
        self.say = opts.progress
        self.nodes: List[HostNode] = []
        self.op = ""
        self.owner: Optional[Owner] = None
        self._make_nodes = nodes or group_hosts
        self.unreachable: Dict[str, str] = {}
        self.resume = Resume()  # a resumed restore: who finished it, who serves the restored cluster
        self.unanswered: List[str] = []  # the hosts the last rollback could not reach
        self.rolled_back = False  # the last rollback put every member back
        self.timings: Dict[str, float] = {}  # phase -> seconds, reported in the Outcome
        self.evidence: "Optional[Future[Evidence]]" = None  # asked while the hosts pre-check
        self.standby: Optional[Standby] = None  # receivers started ahead (``restore.ship``)
        self.cluster: LiveCluster = cluster or EtcdCluster(cfg)
        self._open_source = open_source or source_for(opts)

    def open_all(self, command: str) -> None:
        """Sessions to every host, each holding its lock, for ``command`` (e.g. "restore
        rollback"): what the rollback command needs before it can read journals and roll back."""
        self.nodes = self._make_nodes(self.cfg)
        self.owner = new_owner(command)
        open_sessions(self.cfg, self.nodes, self.owner, self.say)

    def close_all(self) -> None:
        close_sessions(self.nodes)

    def open_reachable(self, command: str) -> None:
        """Sessions to every host that answers, each holding its lock (the others in
        ``unreachable``), for ``command``: a dry run's pre-checks before there is a snapshot."""
        self.nodes = self._make_nodes(self.cfg)
        self.owner = new_owner(command)
        self.unreachable = open_sessions(self.cfg, self.nodes, self.owner, self.say, require_all=False)

    def node_of(self, member: str) -> HostNode:
        return next(n for n in self.nodes if any(m.name == member for m in n.members))

    def run(self) -> Outcome:
        t0 = time.monotonic()
        cfg = self.cfg
        ensure_private_dir(cfg.backup.dir)
        hosts = HostsAhead(self)  # opened while the source is read (``meanwhile``)
        source: Optional[Source] = None
        try:
            try:
                source = self._open_source(cfg, self.opts.spec, cfg.backup.dir, self.opts.dry_run, hosts.meanwhile)
            except BaseException as exc:
                hosts.instead_of(exc)  # the hosts' refusal, when the source stopped for it
                raise
            self.timings["read"] = time.monotonic() - t0
            self.timings.update((f"read: {k}", v) for k, v in source.timings.items())
            self.say(f"read {source.path}")
            facts, host_problems = hosts.result(source.path)
            return self._run(source, t0, facts, host_problems)
        finally:
            t = time.monotonic()
            hosts.close()
            if self.nodes:
                self.timings["close"] = time.monotonic() - t  # after the outcome's duration
            if source is not None:
                source.close()

    def open_hosts(self, name: str) -> None:
        """Sessions to every host that answers, each holding its lock (the others in
        ``unreachable``), for a restore of ``name``; with ``--yes`` the receivers start as the
        sessions open."""
        t = time.monotonic()
        self.nodes = self._make_nodes(self.cfg)
        self.owner = new_owner(self.opts.command or f"restore --from {os.path.basename(name)}")
        self.standby = self._standby()
        self.unreachable = open_sessions(self.cfg, self.nodes, self.owner, self.say, require_all=False,
                                         opened=self.standby.start if self.standby else None)
        self.timings["sessions"] = time.monotonic() - t

    def close_hosts(self) -> None:
        self._close_standby()
        close_sessions(self.nodes)

    def _standby(self) -> Optional[Standby]:
        """Unattended (``--yes``), the receivers on the other masters start as soon as their
        host's session is open; asked to confirm, or a dry run, the restore starts none before it
        needs them."""
        if self.opts.dry_run or self.opts.confirm is not None:
            return None
        away = sum(len(n.members) for n in self.nodes if not n.local)
        return Standby(self.cfg, away) if away else None

    def _close_standby(self) -> None:
        if self.standby is not None:
            self.standby.close()
            self.standby = None

    def _run(self, source: Source, t0: float, facts: Dict[str, NodeFacts], host_problems: Dict[str, List[str]]) -> Outcome:
        t = time.monotonic()
        plan = self._plan(source, facts, host_problems)
        self.timings["plan"] = time.monotonic() - t
        outcome = Outcome(plan, timings=self.timings)
        for hp in plan.hosts:
            self.say(f"{hp.member} ({hp.host}): pre-check {'ok' if not hp.problems else 'FAILED: ' + '; '.join(hp.problems)}")
        if plan.resuming:
            self.resume = self._resume_state(plan, facts)
            self.say(f"resuming restore {plan.op}: {self.resume.describe()}; " + (
                "it only goes forward (finishing the others), never back" if self.resume.forward else
                "a failure rolls every member back"))
        if self.opts.dry_run:
            outcome.duration = time.monotonic() - t0
            return outcome
        if not plan.ok:
            details = plan.problems + [f"{h.member} ({h.host}): {p}" for h in plan.hosts for p in h.problems]
            raise RefusedError("restore refused by pre-checks; nothing touched", details=details)
        if self.opts.confirm is not None and not self.opts.confirm(P.render_plan(plan)):
            raise RefusedError("restore not confirmed; nothing touched")
        self._execute(plan, source, facts, outcome)
        outcome.done = True
        outcome.duration = time.monotonic() - t0
        self.say(f"restore {plan.op} done in {outcome.duration:.1f}s (etcd down {outcome.downtime or 0:.1f}s): every "
                 f"member healthy at revision {sorted(set(outcome.revisions.values()))}")
        return outcome

    def precheck(self) -> Tuple[Dict[str, NodeFacts], Dict[str, List[str]]]:
        """Every reachable host's facts (read-only); a problem line for every member that has none."""
        facts: Dict[str, NodeFacts] = {}
        problems: Dict[str, List[str]] = {}

        def precheck(n: HostNode) -> Dict[str, NodeFacts]:
            return {m.name: n.ask(NodeFacts, "precheck", member=m.name) for m in n.members}

        for n in self.nodes:
            if n.where in self.unreachable:
                for m in n.members:
                    problems[m.name] = [f"unreachable: {self.unreachable[n.where]}"]
        for n, got, err in parallel(precheck, [n for n in self.nodes if n.where not in self.unreachable]):
            if err is not None or got is None:
                for m in n.members:
                    problems[m.name] = [f"pre-check failed: {message(err) if err else 'no answer'}"]
            else:
                facts.update(got)
        return facts, problems

    def _op(self, source: Source, resume: Optional[JournalSummary], problems: List[str]) -> Tuple[str, str, bool]:
        """(op id, token, new cluster?) of this run: a resumed one's, or new ones."""
        if resume is not None:
            if self.opts.new_token and self.opts.new_token != resume.token:
                problems.append(f"resuming restore {resume.op} with token {resume.token}; --new-token "
                                f"{self.opts.new_token} cannot change it midway")
            return resume.op, resume.token, resume.new_cluster or self.opts.new_cluster
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        token = self.opts.new_token or default_token(self.cfg.cluster.name, stamp)
        return new_op_id(stamp, source.sha256), token, self.opts.new_cluster

    def _plan(self, source: Source, facts: Dict[str, NodeFacts], host_problems: Dict[str, List[str]]) -> P.Plan:
        """The plan with every refusal filled in: resume conflicts, identity, each host's checks."""
        from etcd_agent import __version__

        cfg = self.cfg
        journals: Dict[str, Optional[JournalSummary]] = {m: f.journal for m, f in facts.items()}
        resume, rproblems = resume_decision(journals, source.path, source.sha256)
        self.op, token, new_cluster = self._op(source, resume, rproblems)
        bad_token = token_problem(token)
        if bad_token:
            raise UsageError(bad_token)
        verdict = self._identity(source, facts, new_cluster) if resume is None else None
        lines = tuple(verdict.lines()) if verdict is not None else (
            "resuming: the backup's identity was judged when this restore began",)
        plan = P.build_plan(cfg, op=self.op, backup=source.path, source=source.facts(lines), token=token,
                            host_of={m.name: n.where for n in self.nodes for m in n.members}, facts=facts,
                            new_cluster=new_cluster, resuming=resume is not None)
        plan.problems += rproblems + (list(verdict.refused) if verdict is not None else [])
        if source.tail is not None and not plan.bump:
            plan.problems.append(
                f"the point-in-time tail is loaded into the restored members at revisions above any the cluster "
                f"reached, which needs the revision bumped on every member ({plan.bump_note}); set [backup.delta] "
                "point_in_time_load = \"scratch\" to replay it in a throwaway etcd instead")
        for hp in plan.hosts:
            hp.problems += host_problems.get(hp.member, [])
            if hp.member in facts:
                hp.problems += check_host(cfg, cfg.member(hp.member), facts[hp.member], snapshot_size=source.size,
                                            snapshot_version=source.etcd_version, agent_version=__version__,
                                            resuming=resume is not None)
                if self.node_of(hp.member).local and resume is None:
                    dd = facts[hp.member].data_dir
                    kept = [(label, p, os.path.realpath(p)) for label, p in
                            (("the backup", source.path), ("the backup dir", cfg.backup.dir))]
                    hp.problems += set_aside_problems(dd, os.path.realpath(dd), kept)
        return plan

    # ------------------------------------------------------------ the steps

    def _identity(self, source: Source, facts: Dict[str, NodeFacts], new_cluster: bool) -> Verdict:
        """Whose snapshot is this, from its own db, against everything of the current cluster
        that could be found: the running cluster (if any member answers), each host's data dir db
        and bootstrap record, and every restore lineage recorded on the hosts or in etcd."""
        if source.identity is None:
            raise RefusedError(f"{source.path}: the snapshot's members could not be read; nothing touched")
        ev = self.evidence.result() if self.evidence is not None else self.cluster.evidence()
        hosts = list(ev.hosts)
        lineage = list(ev.lineage)
        for name, f in facts.items():
            if f.db_member_ids:
                hosts.append(HostIds(f"{name}'s data dir ({f.data_dir})", frozenset(int(x, 16) for x in f.db_member_ids)))
            if f.bootstrap_member_id:
                hosts.append(HostIds(f"{name}'s bootstrap record", frozenset({int(f.bootstrap_member_id, 16)})))
            lineage += [frozenset(int(x, 16) for x in ids) for ids in f.lineage if ids]
        notes = list(ev.notes) + [f"{n}: {f.db_note}" for n, f in facts.items() if f.db_note]
        evidence = dataclasses.replace(ev, hosts=tuple(hosts), lineage=tuple(lineage), notes=tuple(notes))
        return judge(source.identity, self.cfg, evidence, new_cluster=new_cluster)

    def _resume_state(self, plan: P.Plan, facts: Dict[str, NodeFacts]) -> Resume:
        """What the hosts show of the restore being resumed: the members that finished it (their
        journals) and those whose running etcd answers as the restored cluster (its ids)."""
        return resume_state({m: f.journal for m, f in facts.items()}, self.cluster.member_ids(), plan.op,
                            plan.initial_cluster, plan.token)

    def active(self) -> List[Member]:
        """Every member but those that finished this restore already (a resumed one)."""
        return [m for n in self.nodes for m in n.members if m.name not in self.resume.finished]

    def phase(self, name: str, fn: Callable[[Member], Any], members: Optional[Sequence[Member]] = None) -> None:
        """``fn`` for every member (that has not finished): hosts in parallel, a host's own members
        one after another."""
        t = time.monotonic()
        todo = list(members) if members is not None else self.active()
        by_host: Dict[str, List[Member]] = {}
        for m in todo:
            by_host.setdefault(self.node_of(m.name).where, []).append(m)

        def per_host(ms: List[Member]) -> None:
            for m in ms:
                fn(m)

        failed = [f"{ms[0].name if len(ms) == 1 else ', '.join(m.name for m in ms)} ({w}): {message(e)}"
                  for (w, ms), _r, e in parallel(lambda item: per_host(item[1]), list(by_host.items())) if e is not None]
        self.timings[name] = self.timings.get(name, 0.0) + time.monotonic() - t
        if failed:
            raise OperationFailed(f"restore failed at {name}", details=failed)

    def batch(self, name: str, plan: Sequence[Tuple[Member, Sequence[str]]], timing: Optional[str] = None) -> None:
        """Simple steps, each member's list in order: one ``steps`` call per host carrying all its
        members, which the host runs at once; the hosts in parallel. A member that fails stops
        only its own list; the phase then fails naming every member that did. ``timing``: the
        name its time is counted under, when not ``name``."""
        t = time.monotonic()
        by_host: Dict[str, List[Tuple[Member, Sequence[str]]]] = {}
        for m, names in plan:
            if names:
                by_host.setdefault(self.node_of(m.name).where, []).append((m, names))

        def per_host(items: List[Tuple[Member, Sequence[str]]]) -> List[str]:
            n = self.node_of(items[0][0].name)
            res = n.ask(StepsReply, "steps", op=self.op, members=[{"member": m.name, "steps": list(s)} for m, s in items])
            by_name = {a.member: a for a in res.members}
            failed = []
            for m, _names in items:
                a = by_name.get(m.name)
                if a is None:
                    failed.append(f"{m.name} ({n.where}): no answer for this member")
                    continue
                for r in a.steps:
                    self.said(m, r, "?")
                if a.error is not None:
                    failed.append(f"{m.name} ({n.where}): {error_from_json(a.error).message}")
            return failed

        failed: List[str] = []
        for (w, items), lines, e in parallel(lambda item: per_host(item[1]), list(by_host.items())):
            if e is not None:
                failed.append(f"{', '.join(m.name for m, _n in items)} ({w}): {message(e)}")
            failed += lines or []
        key = timing or name
        self.timings[key] = self.timings.get(key, 0.0) + time.monotonic() - t
        if failed:
            raise OperationFailed(f"restore failed at {name}", details=failed)

    def call(self, m: Member, step: str, **args: Any) -> StepReply:
        res = self.node_of(m.name).ask(StepReply, step, member=m.name, op=self.op, **args)
        self.said(m, res, step)
        return res

    def said(self, m: Member, r: StepReply, step: str) -> None:
        """One progress line for a step's result."""
        extra = r.note()
        self.say(f"{m.name} ({self.node_of(m.name).where}): {r.step or step} ok" + (f" - {extra}" if extra else ""))

    def _execute(self, plan: P.Plan, source: Source, facts: Dict[str, NodeFacts], outcome: Outcome) -> None:
        began: List[Member] = []
        try:
            self._through(plan, source, facts, outcome, began)
        except BaseException as exc:
            try:
                self._failed(plan, exc, began)
            finally:
                if self.rolled_back:  # nothing is left to resume
                    source.keep_record = False
        finish(self, plan, source)
        source.keep_record = False  # done: nothing is left to resume

    def _through(self, plan: P.Plan, source: Source, facts: Dict[str, NodeFacts], outcome: Outcome,
                 began: List[Member]) -> None:
        """begin, stage, fence, stop, prepare, start, until every member serves the restored
        cluster and the apiservers run again; ``began``: the members whose journal exists."""
        owners = P.fence_owners(self.cfg, {m.name: n.where for n in self.nodes for m in n.members})

        def begin(m: Member) -> None:
            self.call(m, "begin", token=plan.token, initial_cluster=plan.initial_cluster, sha256=source.sha256,
                      size=source.size, backup=plan.backup, bump=P.BUMP_REVISION if plan.bump else None,
                      fence_owner=owners[m.name], new_cluster=plan.new_cluster)
            began.append(m)
            source.keep_record = True  # its journal names the record: `--from <record>` resumes it

        self.phase("begin", begin)
        stage(self, source, facts)
        if source.tail is not None:  # a chain that cannot be folded is refused before anything live is touched
            t = time.monotonic()
            folded(source)
            self.timings["fold (its wait)"] = time.monotonic() - t
        t = time.monotonic()
        followers = self._followers()
        self.timings["leader"] = time.monotonic() - t
        fenced_at = time.monotonic()
        everyone = self.active()
        self.batch("fence", [(m, ["fence"]) for m in everyone])
        # the followers first, until each has closed its data (``halt``: its exit takes etcd
        # 3.5 another second); then the leader, which finds them gone and stops at once. Each
        # member's data is touched only after its own exit (``stop``, then the prepare steps)
        self.batch("stop", [(m, ["halt"]) for m in followers])
        self.batch("prepare", [(m, ["stop"] + PREPARE) for m in everyone])
        self.batch("start", [(m, ["start"]) for m in everyone])
        healthy_within = self.opts.health_timeout or max(60.0, self.cfg.etcd.start_timeout * 2)
        t = time.monotonic()
        outcome.revisions = self.cluster.converged(healthy_within, self.say)
        outcome.timings["wait"] = time.monotonic() - t
        if source.tail is not None:  # the apiservers still fenced
            load_tail(self, plan, source, outcome)
            t = time.monotonic()  # what the members serve now, the tail in
            outcome.revisions = self.cluster.converged(healthy_within, self.say)
            outcome.timings["wait"] += time.monotonic() - t
        served(self, plan, source)
        t = time.monotonic()
        self.cluster.record_lineage(list(source.member_ids))
        outcome.cleanup = self.cluster.k8s_cleanup()
        outcome.timings["lineage"] = time.monotonic() - t
        for line in outcome.cleanup:
            self.say(f"kubernetes: {line}")
        unfence(self, outcome)
        outcome.downtime = time.monotonic() - fenced_at

    def _failed(self, plan: P.Plan, exc: BaseException, began: List[Member]) -> NoReturn:
        """``exc`` stopped the restore after ``begin``: every member rolled back (or, when members
        serve the restored cluster already, nothing: the restore only goes forward), and the error
        saying what is true now."""
        if isinstance(exc, StopWaiting):
            raise Interrupted(f"restore {self.op} interrupted twice: " + LEFT_AS_IS) from exc
        details = exc.details if isinstance(exc, AgentError) else [message(exc)]
        if self.resume.forward:  # members serve the restored cluster: rolling back would split it
            raise self.unfinished(plan, exc, details) from exc
        if isinstance(exc, KeyboardInterrupt):
            self.say("interrupted: rolling every member back")
        try:
            ok, lines = self.rollback(began or [m for n in self.nodes for m in n.members])
        except StopWaiting:
            raise Interrupted(f"restore {self.op}: its rollback interrupted twice: " + LEFT_AS_IS) from exc
        self.rolled_back = ok
        raise OperationFailed(self._rolled_back(exc, ok), details=list(details) + lines) from exc

    def _rolled_back(self, exc: BaseException, ok: bool) -> str:
        """The failed restore's message once its rollback ran: complete, or what to do next."""
        if ok:
            return f"restore {self.op} failed ({message(exc)}); every member was rolled back to its data from before"
        if self.unanswered:
            return (f"restore {self.op} failed ({message(exc)}); ROLLBACK INCOMPLETE - once "
                    f"{', '.join(self.unanswered)} answer again, run `etcd-agent restore rollback --yes` on any master")
        return (f"restore {self.op} failed ({message(exc)}); ROLLBACK INCOMPLETE - see why below; once that is "
                "fixed, run `etcd-agent restore rollback --yes` on any master")

    def unfinished(self, plan: P.Plan, exc: BaseException, details: Sequence[str]) -> OperationFailed:
        """A restore that can only go forward stopped short: nothing is rolled back (members serve
        the restored cluster); the same command finishes it."""
        return OperationFailed(
            f"restore {self.op} not finished ({message(exc)}); not rolled back: {self.resume.describe()}, and "
            f"rolling back the others would leave two clusters - run `etcd-agent restore --from {plan.backup} --yes` "
            "again to finish it (below: what stopped it)", details=list(details))

    def _followers(self) -> List[Member]:
        """The members halted before the leader is stopped (stopping the leader together with
        its followers stalls while it hands leadership to peers that are going); every member
        when no leader answers."""
        leader = self.cluster.leader()
        return [m for m in self.cfg.members if m.name != leader and m.name not in self.resume.finished]

    # ------------------------------------------------------------ rollback

    def rollback(self, members: List[Member]) -> Tuple[bool, List[str]]:
        """Roll every member back; (all succeeded, one line per member saying what is true now)."""
        self.say("rolling back every member")
        lines: List[str] = []
        ok = True
        self.unanswered = []

        def one(m: Member) -> RollbackReply:
            n = self.node_of(m.name)
            try:
                return n.ask(RollbackReply, "rollback", member=m.name, op=self.op)
            except HostUnreachable:
                # the session broke (the host was cut off, or timed out): a fresh one may work
                self._reopen(n)
                return n.ask(RollbackReply, "rollback", member=m.name, op=self.op)

        for m, res, err in parallel(one, members):
            where = self.node_of(m.name).where
            if err is not None or res is None:
                if isinstance(err, RefusedError) and "no journal" in err.message:
                    continue  # this member never began
                ok = False
                if no_answer(err):
                    self.unanswered.append(where)
                lines.append(f"{m.name} ({where}): NOT rolled back: {message(err) if err else 'no answer'}")
            else:
                state = "etcd running" if res.running else (
                    "etcd stopped (it was not running before)" if not res.was_running else "etcd NOT running")
                lines.append(f"{m.name} ({where}) rolled back: {'; '.join(res.did) or res.skipped or ''}; now {state}")
            self.say(lines[-1])
        return ok, lines

    def _reopen(self, n: HostNode) -> None:
        assert self.owner is not None
        if n.client is not None:
            n.client.close()
        n.client = NodeClient(self.cfg, n.host, n.where, local=n.local, owner=self.owner, lock=True)
        n.client.open()


def restore(cfg: Config, opts: Options) -> Outcome:
    return Restore(cfg, opts).run()
