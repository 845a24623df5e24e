"""``etcd-agent run``: observe, decide (pure), act, log one sentence; repeat.

Signal handlers only set flags: SIGTERM/SIGINT stop the loop after the current cycle, SIGHUP
reloads the config before the next one (a config that fails validation is logged and the old
one kept). So does the exit of the process backend's etcd (the backend's watcher thread): the
next cycle starts at once instead of up to ``interval`` later, at most once per ``interval``
so that an etcd that dies as it starts is still restarted at the cycle's pace. Membership
changes (join, replace) happen under etcd's own lock so only one agent of the cluster changes
membership at a time.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

from etcd_agent.config import Config, Member, load, security_warnings, with_local
from etcd_agent.daemon import health
from etcd_agent.errors import (
    AgentError,
    BusyError,
    ConfigError,
    EtcdError,
    OperationFailed,
    RefusedError,
)
from etcd_agent.etcd.client import EtcdClient, MemberInfo
from etcd_agent.locality import local_member, machine_identity
from etcd_agent.member.local import MEMBERSHIP_LOCK, LocalMember, find_member
from etcd_agent.member.quorum import can_add, can_remove
from etcd_agent.state import bootstrap, markers
from etcd_agent.topology import EXISTING, Bootstrap, join_bootstrap, parse_conf, static_bootstrap

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.continuous.supervisor import DeltaSupervisor

log = logging.getLogger(__name__)

# automatic defrag / NOSPACE handling runs at most this often, one agent of the cluster at a time
MAINTENANCE_EVERY = 60.0
MAINTENANCE_LOCK = "/etcd-agent/locks/maintenance"


@dataclass
class CycleReport:
    observation: health.Observation
    decision: health.Decision
    outcome: str

    def sentence(self) -> str:
        return f"member {self.observation.member}: {self.decision.reason} -> {self.decision.action}: {self.outcome}"


class Daemon:
    """Converges this host's member to the config, one cycle at a time."""

    def __init__(self, config_path: str, member: Optional[str] = None, cfg: Optional[Config] = None) -> None:
        self.config_path = config_path
        self.member_override = member
        self._stop = False
        self._reload = False
        self._wake = threading.Event()
        self.failures = 0
        self._last_action = health.NONE
        self._last_maintenance = -MAINTENANCE_EVERY
        self._last_restart = float("-inf")  # monotonic time of the last RESTART action
        self._watched: Optional[int] = None  # the etcd pid whose exit wakes the loop
        from etcd_agent.drill.schedule import DrillScheduler

        self.drills = DrillScheduler()  # [drill] every: restore drills, one master at a time
        self.delta: "Optional[DeltaSupervisor]" = None  # continuous backup, while run() runs
        self._apply(cfg or load(config_path))

    # ------------------------------------------------------------ config

    def _apply(self, cfg: Config) -> None:
        name = self.member_override or local_member(cfg, machine_identity()).name
        cfg = with_local(cfg, name)
        self.cfg = cfg
        self.me: Member = cfg.member(name)
        self.local = LocalMember(cfg, self.me)
        for w in security_warnings(cfg):  # at start and on every reload: the journal says it
            log.warning("%s", w)

    def reload(self) -> None:
        try:
            cfg = load(self.config_path)
            self._apply(cfg)
            log.info("config %s reloaded", self.config_path)
        except ConfigError as exc:
            log.error("config reload refused, keeping the running config: %s %s", exc.message, "; ".join(exc.details))

    # ------------------------------------------------------------ signals

    def install_signal_handlers(self) -> None:
        def stop(signum: int, _frame: object) -> None:
            self._stop = True
            self._wake.set()

        def hup(signum: int, _frame: object) -> None:
            self._reload = True
            self._wake.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, hup)

    def request_stop(self) -> None:
        self._stop = True
        self._wake.set()

    def _watch_etcd(self) -> None:
        """Have the backend wake the loop the moment its etcd exits (the process backend)."""
        pid = self.local.backend.watch_exit(self._etcd_exited)
        if pid is not None and pid != self._watched:
            self._watched = pid
            log.info("member %s: watching etcd pid %d: its exit starts the next cycle at once", self.me.name, pid)

    def _etcd_exited(self, pid: int) -> None:
        """From the backend's watcher thread: a flag, as a signal handler sets one."""
        if time.monotonic() - self._last_restart < self.cfg.daemon.interval:
            # restarted early less than a cycle ago and gone again: the cycle's pace, so that a
            # crash loop is not spun, and the restarts counted toward a replace keep their spacing
            log.info("member %s: etcd pid %d exited; restarted less than a cycle ago, so the next cycle "
                     "looks at it", self.me.name, pid)
            return
        log.info("member %s: etcd pid %d exited; checking at once", self.me.name, pid)
        self._wake.set()

    # ------------------------------------------------------------ observe

    def observe(self) -> health.Observation:
        cfg, me, lm = self.cfg, self.me, self.local
        state = lm.backend.state()
        running = state in ("active", "activating", "reloading")
        local_healthy = False
        local_status = None
        if running:
            with EtcdClient.from_config(cfg, [me.client_url], timeout=2.0) as c:
                local_healthy, _ = c.healthy(me.client_url, timeout=2.0)
                if local_healthy:
                    try:
                        local_status = c.status(me.client_url, timeout=2.0)
                    except EtcdError:
                        pass
        ever = bootstrap.ever_bootstrapped(cfg, me.name)
        if local_healthy and local_status is not None and not ever:
            bootstrap.remember(cfg, me.name, local_status.cluster_id, local_status.member_id)
            ever = True
        if local_healthy:
            self.failures = 0
        elif self._last_action == health.RESTART and not running:
            self.failures += 1

        restore = markers.read_restore(cfg, me.name) or markers.RestoreMarker()
        upgrade = markers.upgrading(cfg, me.name) or markers.UpgradeMarker()
        members = self._member_list(local_healthy)
        if self.delta is not None:  # its full backup follows the membership: this list, asked once
            self.delta.saw_members(members)
        voters = healthy_voters = 0
        self_info: Optional[MemberInfo] = None
        if members is not None:
            self_info = find_member(members, me)
            voting = [m for m in members if not m.is_learner]
            voters = len(voting)
            healthy_voters = self._count_healthy(voting, me, local_healthy)
        return health.Observation(
            member=me.name,
            bootstrap=cfg.cluster.bootstrap,
            is_seed=cfg.members[0].name == me.name,
            has_data=lm.has_data(),
            conf_present=os.path.exists(cfg.conf_file(me.name)),
            unit_state=state,
            local_healthy=local_healthy,
            cluster_reachable=members is not None,
            voters=voters,
            healthy_voters=healthy_voters,
            self_listed=self_info is not None,
            self_started=bool(self_info and self_info.started),
            self_learner=bool(self_info and self_info.is_learner),
            failures=self.failures,
            ever_bootstrapped=ever,
            left=markers.has_left(cfg, me.name),
            restore_op=restore.op or "",
            restore_backup=restore.backup or "",
            upgrade_to=upgrade.version or "",
        )

    def _others(self) -> List[str]:
        return [m.client_url for m in self.cfg.members if m.name != self.me.name]

    def _member_list(self, local_healthy: bool) -> Optional[List[MemberInfo]]:
        endpoints = ([self.me.client_url] if local_healthy else []) + self._others()
        if not endpoints:
            return None
        with EtcdClient.from_config(self.cfg, endpoints, timeout=2.0) as c:
            try:
                return c.members()
            except EtcdError:
                return None

    def _answers(self, url: str) -> bool:
        with EtcdClient.from_config(self.cfg, [url], timeout=2.0) as c:
            return c.healthy(url, timeout=2.0)[0]

    def _count_healthy(self, voting: List[MemberInfo], me: Member, local_healthy: bool) -> int:
        def probe(m: MemberInfo) -> bool:
            if me.peer_url in m.peer_urls:
                return local_healthy
            if not m.client_urls:
                return False  # added, never started
            with EtcdClient.from_config(self.cfg, list(m.client_urls), timeout=2.0) as c:
                return any(c.healthy(u, timeout=2.0)[0] for u in m.client_urls)

        with ThreadPoolExecutor(max_workers=max(1, len(voting))) as pool:
            return sum(1 for ok in pool.map(probe, voting) if ok)

    # ------------------------------------------------------------ act

    def act(self, obs: health.Observation, d: health.Decision) -> str:
        lm = self.local
        a = d.action
        if a in (health.NONE, health.WAIT):
            return "nothing done"
        if a == health.RESTART:
            self._last_restart = time.monotonic()
            lm.backend.start()
            return f"started {lm.backend.kind} etcd (attempt {self.failures + 1})"
        if a == health.START_STATIC:
            lm.start_static()
            return "started with state=new"
        if a == health.START_SEED:
            lm.start_seed()
            return "seed started with state=new"
        if a == health.RENDER:
            return self._render_existing()
        if a == health.PROMOTE:
            from etcd_agent.member.learner import promote_when_ready

            endpoints = [u for u in self._others() if self._answers(u)] or self._others()
            with EtcdClient.from_config(self.cfg, endpoints, timeout=5.0) as c:
                try:
                    info = promote_when_ready(self.cfg, c, self.me.name, timeout=5.0)
                except OperationFailed as exc:
                    return f"not promoted yet: {exc.message}"  # still catching up: next cycle
            return f"promoted to a voting member ({info.hex_id})"
        if a in (health.JOIN, health.REPLACE):
            return self._membership_change(obs, a)
        raise AssertionError(f"unknown action {a}")

    def _render_existing(self) -> str:
        """The member has data but no etcd.conf: render one with state=existing (a state=new conf
        would be the trap ``settle_conf`` removes, even for one cycle) and the token the cluster
        was really made with (a restore sets a new one)."""
        cfg, me = self.cfg, self.me
        token = bootstrap.effective_token(cfg, me.name)
        if cfg.cluster.bootstrap == "static":
            boot = Bootstrap(me.name, EXISTING, static_bootstrap(cfg, me).initial_cluster, token)
        else:
            members = self._member_list(False) or []
            pairs = [(m.name, m.peer_urls[0]) for m in members if m.peer_urls and m.name]
            boot = dataclasses.replace(join_bootstrap(cfg, me, pairs), token=token)
        self.local.render(boot)
        return f"rendered {cfg.conf_file(me.name)} (etcd reads its data dir; the initial-cluster flags no longer matter)"

    def settle_conf(self) -> Optional[str]:
        """Once the member runs healthy, rewrite a state=new conf as state=existing.

        A conf that still says state=new is a trap after bootstrap: if the data dir is lost and
        systemd's Restart= (or a boot with the data disk unmounted) starts etcd before this
        daemon notices, a seed creates a second one-member cluster and a static member a fresh
        raft log under the old member id. With state=existing such an etcd refuses to start
        ("already bootstrapped"), and the next cycle replaces the member. etcd ignores the
        initial-cluster flags while its data dir exists, so the rewrite needs no restart.
        """
        path = self.cfg.conf_file(self.me.name)
        try:
            with open(path, encoding="utf-8") as fh:
                state = parse_conf(fh.read()).get("ETCD_INITIAL_CLUSTER_STATE")
        except OSError:
            return None
        if state == EXISTING or not self.local.has_data():
            return None
        members = self._member_list(True)
        if not members or find_member(members, self.me) is None:
            return None
        pairs = [(m.name, m.peer_urls[0]) for m in members if m.peer_urls and m.name]
        boot = join_bootstrap(self.cfg, self.me, pairs)
        self.local.render(dataclasses.replace(boot, token=bootstrap.effective_token(self.cfg, self.me.name)))
        return f"{path} switched to state=existing (a restart on an empty data dir must not bootstrap anew)"

    def _membership_change(self, obs: health.Observation, action: str) -> str:
        lm, me = self.local, self.me
        # talk to the members that answer: a dead endpoint first in line would fail the lock
        endpoints = [u for u in self._others() if self._answers(u)] or self._others() or [me.client_url]
        with EtcdClient.from_config(self.cfg, endpoints, timeout=5.0) as c:
            with c.locked(MEMBERSHIP_LOCK, ttl=self.cfg.daemon.lock_ttl, timeout=30):
                members = c.members()  # fresh, under the lock
                info = find_member(members, me)
                voting = [m for m in members if not m.is_learner]
                healthy = self._count_healthy(voting, me, False)
                done = []
                if action == health.REPLACE:
                    lm.backend.stop()
                    aside = lm.set_aside("replaced")
                    if aside:
                        done.append(f"old data moved to {aside}")
                    if info is not None:
                        ok, why = can_remove(len(voting), healthy, target_is_voter=not info.is_learner, target_healthy=False)
                        if not ok:
                            raise RefusedError(f"not removing stale member {info.hex_id}: {why}")
                        c.remove_member(info.id)
                        done.append(f"stale member {info.hex_id} removed")
                        voting = [m for m in voting if m.id != info.id]
                    info = None
                learner = self.cfg.cluster.learner_joins
                if info is None:
                    ok, why = can_add(len(voting), healthy, learner=learner)
                    if not ok:
                        raise RefusedError(f"not adding this member: {why}")
                if learner:
                    from etcd_agent.member.learner import join_as_learner

                    new = join_as_learner(lm, c, timeout=2 * self.cfg.etcd.start_timeout)
                    done.append(f"joined as learner {new.hex_id} with state=existing, promoted once caught up")
                else:
                    new = lm.join(c)
                    done.append(f"joined as {new.hex_id} with state=existing")
        return "; ".join(done)

    # ------------------------------------------------------------ loop

    def cycle(self) -> CycleReport:
        obs = self.observe()
        d = health.decide(obs)
        try:
            outcome = self.act(obs, d)
        except AgentError as exc:
            outcome = f"failed: {exc.message}"
        if d.action == health.NONE and obs.local_healthy:
            try:
                settled = self.settle_conf()
            except AgentError as exc:
                settled = f"switching etcd.conf to state=existing failed: {exc.message}"
            if settled:
                log.info("member %s: %s", obs.member, settled)
        if d.action == health.NONE and obs.local_healthy:
            self.maintain()
            started = self.drills.tick(self.cfg, self.me.name)
            if started:
                log.info("member %s: %s", self.me.name, started)
        self._last_action = d.action
        report = CycleReport(obs, d, outcome)
        level = logging.DEBUG if d.action == health.NONE else logging.INFO
        if outcome.startswith("failed"):
            level = logging.WARNING
        log.log(level, "%s", report.sentence())
        return report

    def maintain(self, now: Optional[float] = None) -> Optional[str]:
        """``[maintenance] auto_disarm_nospace`` / ``auto_defrag``: at most once per
        MAINTENANCE_EVERY seconds, under the cluster-wide maintenance lock, so one agent of the
        cluster does it at a time (defragmenting blocks the member it runs on)."""
        mt = self.cfg.maintenance
        if not (mt.auto_defrag or mt.auto_disarm_nospace):
            return None
        now = time.monotonic() if now is None else now
        if now - self._last_maintenance < MAINTENANCE_EVERY:
            return None
        self._last_maintenance = now
        from etcd_agent.cluster import maintenance

        done: List[str] = []
        try:
            with EtcdClient.from_config(self.cfg, timeout=5.0) as c:
                alarms = [a for a in maintenance.list_alarms(self.cfg, c) if a["alarm"] == "NOSPACE"]
                wanted = bool(alarms) and mt.auto_disarm_nospace
                if not wanted and mt.auto_defrag:
                    wanted = any(it.defrag for it in maintenance.defrag(self.cfg, c, dry_run=True))
                if not wanted:
                    return None
                with c.locked(MAINTENANCE_LOCK, ttl=max(self.cfg.daemon.lock_ttl, int(mt.defrag_timeout)), timeout=1):
                    if alarms and mt.auto_disarm_nospace:
                        done += maintenance.clear_nospace(self.cfg, c).actions
                    elif mt.auto_defrag:
                        from etcd_agent.daemon import metrics

                        for i in maintenance.defrag(self.cfg, c):
                            if i.defrag and i.seconds is not None:
                                metrics.observe_operation("defrag", i.seconds, True)
                                done.append(f"defragmented {i.name}: {i.db_size} -> {i.size_after} bytes")
        except BusyError:
            return None  # another agent is doing it
        except AgentError as exc:
            log.warning("member %s: automatic maintenance failed: %s", self.me.name, exc.message)
            return f"failed: {exc.message}"
        if done:
            log.info("member %s: automatic maintenance: %s", self.me.name, "; ".join(done))
        return "; ".join(done) or None

    def run(self) -> None:
        log.info("etcd-agent daemon for member %s (%s backend, every %.0fs)", self.me.name,
                 self.local.backend.kind, self.cfg.daemon.interval)
        from etcd_agent.daemon import (
            metrics,  # Prometheus endpoint on [daemon] metrics_address; no-op when unset
        )

        metrics.start(self)
        # continuous backup ([backup.delta]) on threads of its own: a cycle never waits for it
        from etcd_agent.continuous.status import DeltaCollector
        from etcd_agent.continuous.supervisor import DeltaSupervisor

        self.delta = DeltaSupervisor(lambda: (self.cfg, self.me))
        if self.cfg.daemon.metrics_address:
            from etcd_agent.bucket.copier import BucketCollector

            metrics.get().registry.register(DeltaCollector(self.delta.status))
            metrics.get().registry.register(BucketCollector(self.delta.copies))
        self.delta.start()
        try:
            while not self._stop:
                if self._reload:
                    self._reload = False
                    self.reload()
                try:
                    self.cycle()
                    self._watch_etcd()
                except Exception:  # one bad cycle must not kill the daemon; the next one retries
                    log.exception("cycle failed")
                self._wake.wait(self.cfg.daemon.interval)
                self._wake.clear()
        finally:
            self.delta.stop()
            self.drills.stop()
        if self.local.backend.kind == "process":
            # the process backend's etcd is our child: it stops with us (systemd's etcd does not)
            self.local.backend.stop()
        log.info("etcd-agent daemon for member %s stopped", self.me.name)
