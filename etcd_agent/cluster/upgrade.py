"""Rolling etcd upgrade: one member at a time, followers first, the leader last.

Order of one run: lock (one upgrade per host at a time) -> every configured member healthy ->
skew check of the cluster's versions against the target (``etcd.versions``, pure) -> the target
release present and reporting its version on every host -> a verified backup -> for each member:
cluster healthy again, (for the leader: hand leadership to an upgraded member first), then the
member step on its own host. The member step stops etcd, pins the new binary (``member.pin``),
re-renders the unit's ExecStart, starts etcd and waits until it is healthy *on the new version*;
if it is not, it stops it, restores the old pin and unit, starts the old binary, waits for health
and the whole upgrade stops (exit 1, the cluster on a consistent, healthy mix that a re-run
resumes). Progress is written to ``<state_dir>/upgrade.json`` (read by the metrics endpoint).
While a member is stepped, its "upgrade in progress" marker (``member.pin``) pauses the daemon on
that host, which would otherwise restart the etcd the step stopped on purpose.

A member on another master is stepped by running ``etcd-agent upgrade-member`` there over SSH
(the same code); a member on this host (or a one-host cluster) is stepped in this process.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..config import Config, Member
from ..errors import (
    AgentError,
    ConfigError,
    EtcdError,
    Interrupted,
    OperationFailed,
    RefusedError,
)
from ..etcd.client import EndpointStatus, EtcdClient
from ..etcd.versions import check_cluster, parse
from ..fs import makedirs, write_atomic
from ..hosts.local import LocalHost
from ..locality import local_member, machine_identity
from ..state.markers import clear_upgrading, mark_upgrading
from ..state.pins import read_pin, release_tools, restore_pin, write_pin
from ..waiting import NotYet, poll
from .health import cluster_health, statuses, wait_cluster_healthy

log = logging.getLogger(__name__)


@dataclass
class MemberStep:
    name: str
    from_version: str
    to_version: str
    seconds: float = 0.0
    outcome: str = "pending"  # pending | upgraded | skipped | rolled back | failed

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "from": self.from_version, "to": self.to_version,
                "seconds": round(self.seconds, 2), "outcome": self.outcome}


@dataclass
class UpgradePlan:
    target: str
    path: Tuple[str, ...]
    versions: Dict[str, str]
    leader: Optional[str]
    to_upgrade: List[str]
    checks: List[str] = field(default_factory=list)

    def order(self) -> List[str]:
        """Followers first (config order), the leader last."""
        return [n for n in self.to_upgrade if n != self.leader] + [n for n in self.to_upgrade if n == self.leader]

    def text(self) -> str:
        lines = [f"upgrade to etcd {self.target}: " + " -> ".join(self.path)]
        lines += [f"  {n}: {v}{' (leader)' if n == self.leader else ''}" for n, v in self.versions.items()]
        lines += [f"  check: {c}" for c in self.checks]
        if not self.to_upgrade:
            lines.append("nothing to do: every member runs the target")
            return "\n".join(lines)
        lines.append("steps: verified backup, then one member at a time, each gated on the whole cluster healthy:")
        for i, n in enumerate(self.order(), 1):
            extra = " (leadership moved to an upgraded member first)" if n == self.leader else ""
            lines.append(f"  {i}. {n}: stop, point ExecStart at {self.target}, start, wait healthy on {self.target}{extra}")
        return "\n".join(lines)

    def to_json(self) -> Dict[str, Any]:
        return {"target": self.target, "path": list(self.path), "versions": self.versions, "leader": self.leader,
                "order": self.order(), "checks": self.checks}


@dataclass
class UpgradeReport:
    plan: UpgradePlan
    backup: Optional[str]
    steps: List[MemberStep]
    seconds: float

    def to_json(self) -> Dict[str, Any]:
        return {"plan": self.plan.to_json(), "backup": self.backup, "steps": [s.to_json() for s in self.steps],
                "seconds": round(self.seconds, 2)}


# ---------------------------------------------------------------- observe and plan


def plan_upgrade(cfg: Config, target: str, client: EtcdClient) -> UpgradePlan:
    """The plan, or RefusedError (unhealthy cluster, a skew rule broken: with the multi-hop path)."""
    try:
        parse(target)
    except ValueError as exc:
        raise RefusedError(str(exc)) from None
    ok, problems = cluster_health(cfg, client)
    if not ok:
        raise RefusedError("the cluster is not healthy; an upgrade starts only from a healthy cluster", details=problems)
    st = statuses(cfg, client, purpose="an upgrade")
    versions = {n: s.version for n, s in st.items()}
    verdict = check_cluster(list(versions.items()), target)
    if not verdict.ok:
        details = [f"{n}: {v}" for n, v in versions.items()]
        msg = f"refused: {verdict.reason}"
        if len(verdict.path) > 2:
            msg += f"; upgrade path: {verdict.path_text()} (one step per run)"
        raise RefusedError(msg, details=details)
    leader = next((n for n, s in st.items() if s.is_leader), None)
    return UpgradePlan(target, verdict.path, versions, leader, list(verdict.to_upgrade))


def runs_here(cfg: Config, member: Member) -> bool:
    """Is ``member`` stepped in this process (a one-host cluster, or this host's own member)?"""
    if len({m.host for m in cfg.members}) == 1:
        return True
    try:
        return local_member(cfg, machine_identity()).name == member.name
    except ConfigError:
        return False


def check_release(cfg: Config, plan: UpgradePlan) -> None:
    """The target release is installed and reports its version on every host still to upgrade."""
    from ..etcd.tools import version_of
    from ..hosts import open_host

    binary = os.path.join(cfg.etcd.versions_dir, plan.target, "etcd")
    bad = []
    for name in plan.to_upgrade:
        m = cfg.member(name)
        host = LocalHost(name) if runs_here(cfg, m) else open_host(cfg, m, None)
        try:
            got = version_of(host, binary)
            if parse(got).key != parse(plan.target).key:
                bad.append(f"{name}: {binary} reports {got}, not {plan.target}")
            else:
                plan.checks.append(f"{name}: {binary} reports {got}")
        except AgentError as exc:
            bad.append(f"{name}: {binary}: {exc.message}")
        finally:
            host.close()
    if bad:
        raise RefusedError(f"etcd {plan.target} is not installed everywhere (expected under {cfg.etcd.versions_dir}/{plan.target}/)",
                           details=bad)


# ---------------------------------------------------------------- one member (runs on its host)


def upgrade_member(cfg: Config, name: str, version: str, timeout: float) -> Dict[str, Any]:
    """Step this host's member ``name`` to ``version``; roll back to the old binary on failure."""
    from ..etcd.tools import version_of
    from ..member.local import LocalMember

    m = cfg.member(name)
    tools = release_tools(cfg, version)
    if not os.path.isfile(tools["binary"] or ""):
        raise RefusedError(f"{name}: {tools['binary']} missing: install etcd {version} there first")
    got = version_of(LocalHost(name), tools["binary"] or "")
    if parse(got).key != parse(version).key:
        raise RefusedError(f"{name}: {tools['binary']} reports {got}, not {version}")
    old_pin = read_pin(cfg, name)
    old = LocalMember(cfg, m)
    old_binary = old.cfg.etcd.binary
    if old_binary == tools["binary"] and old.healthy():
        return {"member": name, "version": version, "outcome": "skipped", "binary": old_binary}
    start = time.monotonic()
    # the daemon must not restart the etcd we stop on purpose (it would start the old unit)
    mark_upgrading(cfg, name, version, old_binary)
    try:
        old.backend.stop()
        write_pin(cfg, name, version, tools, previous=old_binary)
        new = LocalMember(cfg, m)  # now resolves the pinned binary
        try:
            new.backend.write_unit(new.unit_text())
            new.backend.start()
            try:
                new.wait_healthy(timeout, cancel=_crash_watch(new))
            except Interrupted:
                raise OperationFailed(f"{name}: etcd exited while starting ({new.backend.describe()})") from None
            with EtcdClient.from_config(cfg, [m.client_url], timeout=3.0) as c:
                running = c.status(m.client_url).version
            if parse(running).key != parse(version).key:
                raise OperationFailed(f"{name}: healthy but reports {running}, not {version}")
        except AgentError as exc:
            log.error("%s: etcd %s did not come back healthy (%s); rolling back to %s", name, version, exc.message, old_binary)
            _rollback(cfg, m, old_pin, timeout)
            raise OperationFailed(f"{name}: etcd {version} did not come back healthy: {exc.message}; "
                                  f"rolled back to {old_binary}") from None
    finally:
        clear_upgrading(cfg, name)
    secs = time.monotonic() - start
    log.info("%s: now on etcd %s (%.1fs)", name, version, secs)
    return {"member": name, "version": version, "outcome": "upgraded", "binary": tools["binary"], "seconds": secs}


def _crash_watch(member: Any) -> Callable[[], bool]:
    """For systemd: true once the new etcd exited and the unit waits to restart it
    (Restart=on-failure keeps it "activating"): waiting longer only loops a broken binary."""
    if getattr(member.backend, "kind", "") != "systemd":
        return lambda: False

    def crashed() -> bool:
        return bool(member.backend.show().get("SubState") == "auto-restart")

    return crashed


def _rollback(cfg: Config, m: Member, old_pin: Optional[Dict[str, Any]], timeout: float) -> None:
    from ..member.local import LocalMember

    LocalMember(cfg, m).backend.stop()
    restore_pin(cfg, m.name, old_pin)
    back = LocalMember(cfg, m)
    back.backend.write_unit(back.unit_text())
    back.backend.start()
    back.wait_healthy(timeout)
    log.warning("%s: rolled back to %s and healthy", m.name, back.cfg.etcd.binary)


def _step_remote(cfg: Config, m: Member, version: str, timeout: float) -> Dict[str, Any]:
    from ..hosts import open_host

    argv = [cfg.ssh.agent_path, "--json"]
    if cfg.path:
        argv += ["-c", cfg.path]
    argv += ["upgrade-member", "--member", m.name, "--to", version, "--timeout", str(int(timeout))]
    host = open_host(cfg, m, None)
    try:
        res = host.run(argv, timeout=timeout + 120, check=False)
    finally:
        host.close()
    try:
        data = json.loads(res.stdout)
    except ValueError:
        data = {}
    if res.returncode != 0:
        raise OperationFailed(f"{m.name}: {data.get('message') or res.stderr.strip()[-300:] or 'upgrade-member failed'}")
    return data  # type: ignore[no-any-return]


# ---------------------------------------------------------------- the whole cluster


def progress_path(cfg: Config) -> str:
    return os.path.join(cfg.daemon.state_dir, "upgrade.json")


def _progress(cfg: Config, plan: UpgradePlan, steps: List[MemberStep], state: str) -> None:
    makedirs(cfg.daemon.state_dir, 0o700)
    rec = {"target": plan.target, "state": state, "total": len(plan.to_upgrade),
           "done": sum(1 for s in steps if s.outcome == "upgraded"), "steps": [s.to_json() for s in steps],
           "updated": time.time()}
    write_atomic(progress_path(cfg), (json.dumps(rec) + "\n").encode(), mode=0o600)


def run_upgrade(
    cfg: Config,
    plan: UpgradePlan,
    client: EtcdClient,
    *,
    step_timeout: float = 120.0,
    health_timeout: float = 120.0,
    on_step: Optional[Callable[[MemberStep], None]] = None,
) -> UpgradeReport:
    """Execute ``plan``; OperationFailed (after rollback of the failing member) stops the run."""
    from ..backup.service import take_backup
    from ..state.locks import OperationLock

    t0 = time.monotonic()
    steps = [MemberStep(n, plan.versions[n], plan.target) for n in plan.order()]
    makedirs(cfg.daemon.state_dir, 0o700)
    with OperationLock(os.path.join(cfg.daemon.state_dir, "upgrade.lock"), "upgrade"):
        _progress(cfg, plan, steps, "backup")
        source = next(n for n in plan.versions if n != plan.leader) if len(plan.versions) > 1 else cfg.members[0].name
        backup = take_backup(cfg, member=source, full_verify=True, prune=False)
        log.info("verified backup %s taken before the upgrade", backup.path)
        remaining = [s for s in steps]
        while remaining:
            wait_cluster_healthy(cfg, client, health_timeout)
            st = statuses(cfg, client, purpose="an upgrade")
            # followers first: the leader may have changed since the plan
            step = next((s for s in remaining if not st[s.name].is_leader), remaining[0])
            if st[step.name].is_leader:
                _move_leadership(cfg, client, st, step.name, [s.name for s in steps if s.outcome == "upgraded"])
            m = cfg.member(step.name)
            _progress(cfg, plan, steps, f"upgrading {step.name}")
            began = time.monotonic()
            try:
                if runs_here(cfg, m):
                    out = upgrade_member(cfg, m.name, plan.target, step_timeout)
                else:
                    out = _step_remote(cfg, m, plan.target, step_timeout)
            except AgentError as exc:
                step.seconds = time.monotonic() - began
                step.outcome = "rolled back" if "rolled back" in exc.message else "failed"
                _progress(cfg, plan, steps, "failed")
                if on_step:
                    on_step(step)
                raise OperationFailed(f"upgrade stopped at {step.name}: {exc.message}",
                                      details=[f"backup taken before the upgrade: {backup.path}"]
                                      + [f"{s.name}: {s.outcome}" for s in steps]) from None
            step.seconds = time.monotonic() - began
            step.outcome = str(out.get("outcome", "upgraded"))
            if on_step:
                on_step(step)
            remaining.remove(step)
        wait_cluster_healthy(cfg, client, health_timeout)
        final = statuses(cfg, client, purpose="an upgrade")
        wrong = [f"{n}: {s.version}" for n, s in final.items() if parse(s.version).key != parse(plan.target).key]
        if wrong:
            _progress(cfg, plan, steps, "failed")
            raise OperationFailed(f"after the upgrade not every member runs {plan.target}", details=wrong)
        _progress(cfg, plan, steps, "done")
    return UpgradeReport(plan, backup.path, steps, time.monotonic() - t0)


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
