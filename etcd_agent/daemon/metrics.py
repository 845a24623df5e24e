"""The daemon's Prometheus endpoint (prometheus_client: its own registry and HTTP server).

Served on ``[daemon] metrics_address`` (host:port; keep it on loopback, e.g. 127.0.0.1:9479, and
let node_exporter or a local Prometheus agent scrape it: it has no auth). Gauges are refreshed
after every daemon cycle by ``update(daemon)``; what other processes did (``etcd-agent backup``
from cron, an upgrade run from a terminal) is read from what they leave behind: the backup
catalog and metrics file, ``<state_dir>/upgrade.json``. Durations and failures of operations run
inside this process (defrag, restore steps) are counted by ``observe_operation``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from etcd_agent.config import Config

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.daemon.loop import Daemon

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_METRICS: "Optional[AgentMetrics]" = None


class AgentMetrics:
    """One registry with every metric the daemon exports."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        r = self.registry = CollectorRegistry()
        p = "etcd_agent_"
        self.up = Gauge(p + "member_up", "1 if the member answers its status RPC.", ["member"], registry=r)
        self.healthy = Gauge(p + "member_healthy", "1 if the member serves a linearizable read.", ["member"], registry=r)
        self.leader = Gauge(p + "member_is_leader", "1 if the member is the raft leader.", ["member"], registry=r)
        self.learner = Gauge(p + "member_is_learner", "1 if the member is a learner.", ["member"], registry=r)
        self.has_leader = Gauge(p + "cluster_has_leader", "1 if some member reports a leader.", registry=r)
        self.healthy_members = Gauge(p + "cluster_healthy_members", "Configured members that are healthy.", registry=r)
        self.members = Gauge(p + "cluster_members", "Members in the config.", registry=r)
        self.db = Gauge(p + "db_size_bytes", "Backend db file size.", ["member"], registry=r)
        self.db_use = Gauge(p + "db_size_in_use_bytes", "Backend db bytes in use.", ["member"], registry=r)
        self.frag = Gauge(p + "db_fragmentation_ratio", "1 - db_size_in_use / db_size.", ["member"], registry=r)
        self.version = Gauge(p + "member_version_info", "Running etcd version (value 1).", ["member", "version"], registry=r)
        self.alarms = Gauge(p + "alarms", "Active etcd alarms by type.", ["alarm"], registry=r)
        self.backup_ts = Gauge(p + "backup_last_success_timestamp_seconds",
                               "Unix time of the newest complete backup in the catalog.", registry=r)
        self.backup_age = Gauge(p + "backup_age_seconds", "Age of the newest complete backup.", registry=r)
        self.backup_size = Gauge(p + "backup_last_size_bytes", "Size of the newest complete backup.", registry=r)
        self.backup_count = Gauge(p + "backup_count", "Complete backups in the catalog.", registry=r)
        self.backup_dur = Gauge(p + "backup_last_duration_seconds",
                                "Duration of the last backup run (from the backup metrics file).", registry=r)
        self.backup_fail = Gauge(p + "backup_failures",
                                 "Failed backup runs recorded in the backup metrics file.", registry=r)
        self.op_dur = Gauge(p + "operation_last_duration_seconds", "Duration of the last run of an operation.",
                            ["operation"], registry=r)
        self.op_fail = Counter(p + "operation_failures", "Failed runs of an operation in this daemon.",
                               ["operation"], registry=r)
        self.op_runs = Counter(p + "operation_runs", "Runs of an operation in this daemon.", ["operation"], registry=r)
        self.upg_total = Gauge(p + "upgrade_members_total", "Members the last upgrade had to step.", registry=r)
        self.upg_done = Gauge(p + "upgrade_members_done", "Members the last upgrade has stepped.", registry=r)
        self.upg_running = Gauge(p + "upgrade_in_progress", "1 while an upgrade runs.", registry=r)
        self.upg_failed = Gauge(p + "upgrade_failed", "1 if the last upgrade stopped on a failure.", registry=r)
        self.upg_target = Gauge(p + "upgrade_target_info", "Target of the last upgrade (value 1).", ["version"], registry=r)
        self.cycle_ts = Gauge(p + "last_cycle_timestamp_seconds", "Unix time of the last daemon cycle.", registry=r)
        from etcd_agent.drill.record import DrillCollector

        # restore drills, from this host's drill state (the daemon's drills and those run by hand)
        self.drill = DrillCollector()
        r.register(self.drill)
        for op in ("backup", "restore", "defrag", "upgrade"):
            self.op_fail.labels(op)
            self.op_runs.labels(op)
        self._server: Any = None

    # ------------------------------------------------------------ refresh

    def refresh(self, cfg: Config) -> None:
        """Re-read everything; each source failing only blanks its own metrics."""
        for name, fn in (("etcd", self._etcd), ("backups", self._backups), ("upgrade", self._upgrade),
                         ("drill", self._drill)):
            try:
                fn(cfg)
            except Exception as exc:  # noqa: BLE001 - a metrics source must never stop the daemon
                log.debug("metrics source %s failed: %s", name, exc)
        self.cycle_ts.set(time.time())

    def _etcd(self, cfg: Config) -> None:
        from etcd_agent.cluster.maintenance import fragmentation
        from etcd_agent.errors import EtcdError
        from etcd_agent.etcd.client import EtcdClient

        self.members.set(len(cfg.members))
        self.version.clear()
        healthy = 0
        leader_seen = False
        with EtcdClient.from_config(cfg, timeout=2.0) as c:
            for m in cfg.members:
                try:
                    st = c.status(m.client_url, timeout=2.0)
                except EtcdError:
                    for g in (self.up, self.healthy, self.leader):
                        g.labels(m.name).set(0)
                    continue
                ok, _ = c.healthy(m.client_url, timeout=2.0)
                healthy += int(ok)
                leader_seen = leader_seen or st.leader != 0
                self.up.labels(m.name).set(1)
                self.healthy.labels(m.name).set(int(ok))
                self.leader.labels(m.name).set(int(st.is_leader))
                self.learner.labels(m.name).set(int(st.is_learner))
                self.db.labels(m.name).set(st.db_size)
                self.db_use.labels(m.name).set(st.db_size_in_use)
                self.frag.labels(m.name).set(fragmentation(st))
                self.version.labels(m.name, st.version).set(1)
            counts: Dict[str, int] = {"NOSPACE": 0, "CORRUPT": 0}
            try:
                for _mid, kind in c.alarms():
                    counts[kind] = counts.get(kind, 0) + 1
            except EtcdError:
                pass
            for kind, n in counts.items():
                self.alarms.labels(kind).set(n)
        self.healthy_members.set(healthy)
        self.has_leader.set(int(leader_seen))

    def _backups(self, cfg: Config) -> None:
        from etcd_agent.backup.catalog import list_backups

        entries = [e for e in list_backups(cfg.backup.dir, utc=cfg.backup.utc) if e.complete]
        self.backup_count.set(len(entries))
        if entries:
            newest = entries[0].time.timestamp()
            self.backup_ts.set(newest)
            self.backup_age.set(max(0.0, time.time() - newest))
            self.backup_size.set(entries[0].size)
        if cfg.backup.metrics_file and os.path.exists(cfg.backup.metrics_file):
            from etcd_agent.backup.metrics import read_metrics

            vals = read_metrics(cfg.backup.metrics_file)
            if "last_duration_seconds" in vals:
                self.backup_dur.set(vals["last_duration_seconds"])
            self.backup_fail.set(vals.get("failures", 0.0))

    def _drill(self, cfg: Config) -> None:
        from etcd_agent.drill.record import load_state

        self.drill.state = load_state(cfg)

    def _upgrade(self, cfg: Config) -> None:
        from etcd_agent.cluster.upgrade import read_progress

        rec = read_progress(cfg)  # a damaged one raises: refresh() blanks nothing else
        if rec is None:
            return
        self.upg_total.set(float(rec.total))
        self.upg_done.set(float(rec.done))
        self.upg_running.set(int(rec.running))
        self.upg_failed.set(int(rec.state == "failed"))
        self.upg_target.clear()
        self.upg_target.labels(rec.target).set(1)

    # ------------------------------------------------------------ server

    def serve(self, address: str) -> Tuple[str, int]:
        from prometheus_client import start_http_server

        host, port = split_address(address)
        result = start_http_server(port, addr=host, registry=self.registry)
        # prometheus_client >= 0.19 returns (server, thread); older ones return None
        self._server = result[0] if isinstance(result, tuple) else None
        bound = self._server.server_address[1] if self._server is not None else port
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return host, bound

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def split_address(address: str) -> Tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def get() -> AgentMetrics:
    global _METRICS
    with _LOCK:
        if _METRICS is None:
            _METRICS = AgentMetrics()
        return _METRICS


def start(daemon: "Daemon") -> Optional[Tuple[str, int]]:
    """Serve ``[daemon] metrics_address`` (if set) and refresh the gauges every daemon interval.

    The refresh runs on its own thread so a slow scrape source never delays a cycle; it stops
    when the daemon stops. Never fails the daemon: a bad address is logged.
    """
    if not daemon.cfg.daemon.metrics_address:
        return None
    try:
        bound = get().serve(daemon.cfg.daemon.metrics_address)
    except OSError as exc:
        log.error("metrics endpoint %s not started: %s", daemon.cfg.daemon.metrics_address, exc)
        return None

    def refresher() -> None:
        while not daemon._stop:
            update(daemon)
            daemon._wake.wait(min(daemon.cfg.daemon.interval, 15.0))
        stop()

    threading.Thread(target=refresher, name="metrics-refresh", daemon=True).start()
    return bound


def update(daemon: "Daemon") -> None:
    """Refresh from the daemon's current config (only when the endpoint is enabled)."""
    if daemon.cfg.daemon.metrics_address:
        get().refresh(daemon.cfg)


def stop() -> None:
    if _METRICS is not None:
        _METRICS.shutdown()


def observe_operation(operation: str, seconds: float, ok: bool) -> None:
    m = get()
    m.op_runs.labels(operation).inc()
    m.op_dur.labels(operation).set(seconds)
    if not ok:
        m.op_fail.labels(operation).inc()


def samples(text: str) -> List[Tuple[str, Dict[str, str], float]]:
    """Parse an exposition text (tests, `status`): (name, labels, value) per sample."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(text) for s in fam.samples]
