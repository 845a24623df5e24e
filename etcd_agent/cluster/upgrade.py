"""Rolling etcd upgrade across one or more releases: hop by hop, member by member, leader last.

``plan_upgrade`` reads every member's version, and plans the hops the skew rules require
(``etcd.versions.plan_hops``), through the operator's ``--via`` releases when given; a cluster
left half-way by an earlier run (some members on the first hop's release) resumes that hop. The
run then drives every host through its node session (``node.sessions``: the hosts' operation
locks are held for the whole run, so no restore or second upgrade can start meanwhile):

  check every hop's release is installed and reports its version on every host ->
  for each hop: a verified backup -> for each member still on the old release, followers first
  and the leader last (leadership handed to an upgraded member first), each gated on the whole
  cluster healthy: ``upgrade-member`` on its host (``member.upgrade``) -> every member on the hop's
  release.

The first failure stops the run; the failing member rolled itself back, so every member is on a
known release, and the report names each one's. Progress is written to
``<state_dir>/upgrade.json`` for the metrics endpoint.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from etcd_agent.cluster.health import cluster_health, statuses, wait_cluster_healthy
from etcd_agent.config import Config
from etcd_agent.errors import AgentError, EtcdError, OperationFailed, RefusedError
from etcd_agent.etcd.client import EndpointStatus, EtcdClient
from etcd_agent.etcd.versions import check_step, parse, plan_hops
from etcd_agent.fs import makedirs, write_atomic
from etcd_agent.node.client import new_owner
from etcd_agent.node.replies import BackupReply, ReleaseReply, UpgradeReply
from etcd_agent.node.sessions import (
    HostNode,
    close_sessions,
    group_hosts,
    local_node,
    message,
    node_of,
    open_sessions,
    parallel,
)
from etcd_agent.safejson import loads
from etcd_agent.typedjson import Document, JsonObject
from etcd_agent.waiting import NotYet, poll

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


@dataclass
class MemberStep:
    name: str
    from_version: str
    to_version: str
    seconds: float = 0.0
    outcome: str = "pending"  # pending | upgraded | skipped | rolled back | failed | not started

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "from": self.from_version, "to": self.to_version,
                "seconds": round(self.seconds, 2), "outcome": self.outcome}


@dataclass
class Hop:
    from_version: str
    to_version: str
    members: List[str]  # those still to step onto to_version
    backup: Optional[str] = None
    seconds: float = 0.0
    steps: List[MemberStep] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {"from": self.from_version, "to": self.to_version, "members": self.members, "backup": self.backup,
                "seconds": round(self.seconds, 2), "steps": [s.to_json() for s in self.steps]}


def _hop_json(plan: "UpgradePlan", h: Hop) -> Dict[str, Any]:
    return {**h.to_json(), "order": plan.order(h.members)}


@dataclass
class UpgradePlan:
    target: str
    versions: Dict[str, str]  # member -> what it runs now
    leader: Optional[str]
    hops: List[Hop]
    checks: List[str] = field(default_factory=list)

    @property
    def path(self) -> Tuple[str, ...]:
        start = self.hops[0].from_version if self.hops else self.target
        return (start,) + tuple(h.to_version for h in self.hops)

    @property
    def to_upgrade(self) -> List[str]:
        return sorted({m for h in self.hops for m in h.members})

    def order(self, members: List[str]) -> List[str]:
        """Followers first (config order), the leader last."""
        return [n for n in members if n != self.leader] + [n for n in members if n == self.leader]

    def text(self) -> str:
        lines = [f"upgrade to etcd {self.target}: " + " -> ".join(self.path)]
        lines += [f"  {n}: {v}{' (leader)' if n == self.leader else ''}" for n, v in self.versions.items()]
        lines += [f"  check: {c}" for c in self.checks]
        if not self.hops:
            lines.append("nothing to do: every member runs the target")
            return "\n".join(lines)
        for i, h in enumerate(self.hops, 1):
            lines.append(f"hop {i}: {h.from_version} -> {h.to_version}: a verified backup first, then one member at "
                         "a time, each gated on the whole cluster healthy:")
            for k, n in enumerate(self.order(h.members), 1):
                extra = " (leadership moved to an upgraded member first)" if n == self.leader else ""
                lines.append(f"  {i}.{k} {n}: stop, point ExecStart at {h.to_version}, start, wait healthy on "
                             f"{h.to_version}{extra}")
        return "\n".join(lines)

    def to_json(self) -> Dict[str, Any]:
        return {"target": self.target, "path": list(self.path), "versions": self.versions, "leader": self.leader,
                "hops": [_hop_json(self, h) for h in self.hops], "checks": self.checks}


@dataclass
class UpgradeReport:
    plan: UpgradePlan
    seconds: float
    versions: Dict[str, str]

    @property
    def backups(self) -> List[str]:
        return [h.backup for h in self.plan.hops if h.backup]

    def to_json(self) -> Dict[str, Any]:
        return {"plan": self.plan.to_json(), "backups": self.backups, "seconds": round(self.seconds, 2),
                "versions": self.versions, "steps": [s.to_json() for h in self.plan.hops for s in h.steps]}


# ---------------------------------------------------------------- plan


def plan_upgrade(cfg: Config, target: str, client: EtcdClient, via: Tuple[str, ...] = ()) -> UpgradePlan:
    """The plan, or RefusedError (unhealthy cluster, a skew rule broken: with the path it needs)."""
    try:
        for v in (target,) + via:
            parse(v)
    except ValueError as exc:
        raise RefusedError(str(exc)) from None
    ok, problems = cluster_health(cfg, client)
    if not ok:
        raise RefusedError("the cluster is not healthy; an upgrade starts only from a healthy cluster", details=problems)
    st = statuses(cfg, client, purpose="an upgrade")
    versions = {n: s.version for n, s in st.items()}
    leader = next((n for n, s in st.items() if s.is_leader), None)
    return UpgradePlan(target, versions, leader, plan_cluster_hops(versions, target, via))


def plan_cluster_hops(versions: Dict[str, str], target: str, via: Tuple[str, ...] = ()) -> List[Hop]:
    """Pure: the hops for a cluster whose members run ``versions``; one mix is allowed, the one an
    interrupted run leaves (some members already on the first hop's release)."""
    distinct = sorted({parse(v).key for v in versions.values()})
    shown = ", ".join(f"{n}={v}" for n, v in versions.items())
    if len(distinct) > 2:
        raise RefusedError(f"members run three or more releases ({shown}); bring them to one first")
    low = next(v for v in versions.values() if parse(v).key == distinct[0])
    # --via releases the whole cluster is already past were passed by an earlier run of this same
    # command: re-running it resumes (the failure message says so), it is not a descending --via
    via = tuple(v for v in via if parse(v).key > parse(low).key)
    plan = plan_hops(low, target, via)
    if not plan.ok:
        raise RefusedError(f"refused: {plan.reason}", details=[f"{n}: {v}" for n, v in versions.items()])
    if len(distinct) == 2:
        high = next(v for v in versions.values() if parse(v).key == distinct[1])
        if not plan.hops or parse(plan.hops[0]).key != parse(high).key or not check_step(parse(low), parse(high)).ok:
            raise RefusedError(f"members run {low} and {high} ({shown}), which is not a half-done step towards "
                               f"{target}; finish or undo that first")
    hops: List[Hop] = []
    prev = low
    for to in plan.hops:
        members = [n for n, v in versions.items() if parse(v).key < parse(to).key]
        if members:
            hops.append(Hop(prev, to, members))
        prev = to
    return hops


# ---------------------------------------------------------------- run


MAX_PROGRESS = 1 << 20
# seconds an upgrade step's reply may take beyond the host's own waits (stopping etcd, installing)
UPGRADE_REPLY_SLACK = 60.0


@dataclass(frozen=True)
class UpgradeProgress(Document):
    """``<state_dir>/upgrade.json``: where the last ``upgrade`` run is, for the metrics endpoint
    (every field may be absent: the reader of the previous version took defaults too)."""

    target: str = "?"
    state: str = ""  # "hop N: backup" | "hop N: upgrading <member>" | done | failed
    total: int = 0  # member steps planned
    done: int = 0  # of them upgraded
    steps: Tuple[JsonObject, ...] = ()  # MemberStep.to_json() each, as `upgrade --json` shows them
    hops: Tuple[JsonObject, ...] = ()  # Hop.to_json() each
    updated: Optional[float] = None

    @property
    def running(self) -> bool:
        return self.state not in ("done", "failed")


def progress_path(cfg: Config) -> str:
    return os.path.join(cfg.daemon.state_dir, "upgrade.json")


def read_progress(cfg: Config) -> Optional[UpgradeProgress]:
    """The last run's progress; None when no upgrade ran here. A damaged file raises (UnsafeJson,
    ProtocolError naming the field)."""
    try:
        with open(progress_path(cfg), "rb") as fh:
            raw = fh.read(MAX_PROGRESS + 1)
    except FileNotFoundError:
        return None
    return UpgradeProgress.from_json(loads(raw, max_bytes=MAX_PROGRESS), f"upgrade progress {progress_path(cfg)}")


def _progress(cfg: Config, plan: UpgradePlan, state: str) -> None:
    makedirs(cfg.daemon.state_dir, 0o700)
    steps = [s for h in plan.hops for s in h.steps]
    rec = UpgradeProgress(plan.target, state, sum(len(h.members) for h in plan.hops),
                          sum(1 for s in steps if s.outcome == "upgraded"), tuple(s.to_json() for s in steps),
                          tuple(h.to_json() for h in plan.hops), time.time())
    write_atomic(progress_path(cfg), (json.dumps(rec.to_json()) + "\n").encode(), mode=0o600)


class Upgrade:
    """One run of ``plan`` over the cluster's node sessions."""

    def __init__(self, cfg: Config, plan: UpgradePlan, client: EtcdClient, *, step_timeout: float = 120.0,
                 health_timeout: float = 120.0, say: Progress = lambda s: None,
                 on_step: Optional[Callable[[MemberStep], None]] = None) -> None:
        self.cfg, self.plan, self.client = cfg, plan, client
        self.step_timeout, self.health_timeout = step_timeout, health_timeout
        self.say = say
        self.on_step = on_step
        self.nodes: List[HostNode] = []

    def open(self) -> None:
        self.nodes = group_hosts(self.cfg)
        open_sessions(self.cfg, self.nodes, new_owner(f"upgrade --to {self.plan.target}"), self.say)

    def close(self) -> None:
        close_sessions(self.nodes)

    def check_releases(self) -> None:
        """Every hop's release is installed and reports its version on every host still to step
        onto it (one node call per host and release)."""
        bad: List[str] = []
        for h in self.plan.hops:
            hosts = {node_of(self.nodes, m).where: node_of(self.nodes, m) for m in h.members}

            def check(n: HostNode, version: str = h.to_version) -> ReleaseReply:
                return n.ask(ReleaseReply, "release-version", version=version)

            for n, got, err in parallel(check, list(hosts.values())):
                binary = os.path.join(self.cfg.etcd.versions_dir, h.to_version, "etcd")
                if err is not None or got is None:
                    bad.append(f"{n.where}: {binary}: {message(err) if err else 'no answer'}")
                    continue
                reported = got.binary
                names = ", ".join(m.name for m in n.members if m.name in h.members)
                if reported is None or parse(reported).key != parse(h.to_version).key:
                    bad.append(f"{names} ({n.where}): {binary} reports {reported or 'nothing (missing or broken)'}, "
                               f"not {h.to_version}")
                else:
                    self.plan.checks += [f"{m.name}: {binary} reports {reported}" for m in n.members if m.name in h.members]
        if bad:
            raise RefusedError(f"upgrade path {' -> '.join(self.plan.path)}: not every release on it is installed "
                               f"everywhere (expected under {self.cfg.etcd.versions_dir}/<version>/)", details=bad)

    def run(self) -> UpgradeReport:
        t0 = time.monotonic()
        try:
            for i, hop in enumerate(self.plan.hops, 1):
                self._hop(i, hop)
        except AgentError as exc:
            _progress(self.cfg, self.plan, "failed")
            now = self._versions()
            raise OperationFailed(
                f"upgrade stopped: {exc.message}",
                details=[f"{n}: now on {v}" for n, v in now.items()]
                + [f"backup taken before hop {h.from_version} -> {h.to_version}: {h.backup}" for h in self.plan.hops if h.backup]
                + ["re-run the same `etcd-agent upgrade` once the cause is fixed: it resumes from here"],
            ) from None
        _progress(self.cfg, self.plan, "done")
        return UpgradeReport(self.plan, time.monotonic() - t0, self._versions())

    def _versions(self) -> Dict[str, str]:
        out = {}
        for m in self.cfg.members:
            try:
                out[m.name] = self.client.status(m.client_url, timeout=3.0).version
            except EtcdError as exc:
                out[m.name] = f"unknown ({exc.message})"
        return out

    def _hop(self, index: int, hop: Hop) -> None:
        t = time.monotonic()
        _progress(self.cfg, self.plan, f"hop {index}: backup")
        wait_cluster_healthy(self.cfg, self.client, self.health_timeout)
        hop.backup = self._backup()
        self.say(f"hop {index} ({hop.from_version} -> {hop.to_version}): verified backup {hop.backup}")
        hop.steps = [MemberStep(n, self.plan.versions.get(n, hop.from_version), hop.to_version)
                     for n in self.plan.order(hop.members)]
        remaining = list(hop.steps)
        while remaining:
            wait_cluster_healthy(self.cfg, self.client, self.health_timeout)
            st = statuses(self.cfg, self.client, purpose="an upgrade")
            # followers first: the leader may have changed since the plan
            step = next((s for s in remaining if not st[s.name].is_leader), remaining[0])
            if st[step.name].is_leader:
                done = [s.name for h in self.plan.hops for s in h.steps if s.outcome == "upgraded"]
                _move_leadership(self.cfg, self.client, st, step.name, done)
            _progress(self.cfg, self.plan, f"hop {index}: upgrading {step.name}")
            began = time.monotonic()
            try:
                # the host waits up to step_timeout for the member to serve, and as long again for
                # the old release after a rollback; the reply is awaited past both
                out = node_of(self.nodes, step.name).ask(UpgradeReply, "upgrade-member", member=step.name,
                                                         to=hop.to_version, serve_seconds=self.step_timeout,
                                                         timeout=2 * self.step_timeout + UPGRADE_REPLY_SLACK)
            except AgentError as exc:
                step.seconds = time.monotonic() - began
                step.outcome = "rolled back" if "rolled back" in exc.message else "failed"
                for s in remaining[1:]:
                    s.outcome = "not started"
                if self.on_step:
                    self.on_step(step)
                raise OperationFailed(f"hop {hop.from_version} -> {hop.to_version} stopped at {step.name}: "
                                      f"{exc.message}") from None
            step.seconds = time.monotonic() - began
            step.outcome = out.outcome
            self.plan.versions[step.name] = hop.to_version
            if self.on_step:
                self.on_step(step)
            remaining.remove(step)
        wait_cluster_healthy(self.cfg, self.client, self.health_timeout)
        wrong = [f"{n}: {s.version}" for n, s in statuses(self.cfg, self.client, purpose="an upgrade").items()
                 if parse(s.version).key < parse(hop.to_version).key]
        if wrong:
            raise OperationFailed(f"after hop {hop.from_version} -> {hop.to_version} not every member runs it",
                                  details=wrong)
        hop.seconds = time.monotonic() - t

    def _backup(self) -> str:
        """A verified backup from a follower, written on this host (through its own session,
        which holds this host's lock; directly when this host runs no member)."""
        source = next((n for n in self.cfg.members if n.name != self.plan.leader), self.cfg.members[0]).name
        local = local_node(self.nodes)
        if local is not None:
            return local.ask(BackupReply, "backup", member=source, timeout=max(600.0, self.step_timeout)).path
        from etcd_agent.backup.service import take_backup
        from etcd_agent.bucket.copier import off_host

        return take_backup(self.cfg, member=source, full_verify=True, prune=False, off_host=off_host(self.cfg)).path


def run_upgrade(cfg: Config, plan: UpgradePlan, client: EtcdClient, *, step_timeout: float = 120.0,
                health_timeout: float = 120.0, say: Progress = lambda s: None,
                on_step: Optional[Callable[[MemberStep], None]] = None) -> UpgradeReport:
    """Check the releases, then execute ``plan`` (with the hosts' locks held throughout)."""
    up = Upgrade(cfg, plan, client, step_timeout=step_timeout, health_timeout=health_timeout, say=say, on_step=on_step)
    up.open()
    try:
        up.check_releases()
        return up.run()
    finally:
        up.close()


def check_releases(cfg: Config, plan: UpgradePlan, say: Progress = lambda s: None) -> None:
    """The release check alone (``--dry-run``): sessions without changing anything."""
    up = Upgrade(cfg, plan, EtcdClient.from_config(cfg), say=say)
    up.open()
    try:
        up.check_releases()
    finally:
        up.close()
        up.client.close()


def _move_leadership(cfg: Config, client: EtcdClient, st: Dict[str, EndpointStatus], leader: str, upgraded: List[str]) -> None:
    """Hand leadership to an upgraded member (else any follower); best effort: a restart elects anyway."""
    candidates = upgraded + [n for n in st if n != leader and n not in upgraded]
    if not candidates:
        return
    target = candidates[0]
    try:
        client.move_leader(cfg.member(leader).client_url, st[target].member_id)
    except EtcdError as exc:
        log.warning("moving leadership from %s to %s failed (%s); the restart will elect a new leader", leader, target, exc.message)
        return

    def moved() -> bool:
        try:
            return client.status(cfg.member(target).client_url).is_leader
        except EtcdError as exc:
            raise NotYet(exc.message) from None

    try:
        poll(moved, timeout=10.0, what=f"leadership on {target}")
        log.info("leadership moved from %s to %s", leader, target)
    except OperationFailed as exc:
        log.warning("%s; the restart will elect a new leader", exc.message)
