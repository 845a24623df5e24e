"""One member's rolling-upgrade step, run on the member's own host (node step ``upgrade-member``).

Stop etcd, pin the new release (``state.pins``), re-render the unit's ExecStart, start, and wait
until the member is healthy *on the new version*; if it is not, stop it, put the old pin and
unit back, start the old binary and wait for health, then fail (the cluster is left on a known,
healthy mix). While it runs, the "upgrade in progress" marker keeps this host's daemon from
restarting the etcd the step stopped on purpose.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, Optional

from etcd_agent.config import Config, Member
from etcd_agent.errors import AgentError, Interrupted, OperationFailed, RefusedError
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.etcd.versions import parse
from etcd_agent.hosts.local import LocalHost
from etcd_agent.node.replies import UpgradeReply
from etcd_agent.state.markers import clear_upgrading, mark_upgrading
from etcd_agent.state.pins import Pin, read_pin, release_tools, restore_pin, write_pin

log = logging.getLogger(__name__)


def upgrade_member(cfg: Config, name: str, version: str, timeout: float) -> UpgradeReply:
    """Step this host's member ``name`` to ``version``; roll back to the old binary on failure."""
    from etcd_agent.etcd.tools import version_of
    from etcd_agent.member.local import LocalMember

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
        return UpgradeReply(name, version, "skipped", binary=old_binary)
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
    return UpgradeReply(name, version, "upgraded", binary=tools["binary"], seconds=secs)


def _crash_watch(member: Any) -> Callable[[], bool]:
    """For systemd: true once the new etcd exited and the unit waits to restart it
    (Restart=on-failure keeps it "activating"): waiting longer only loops a broken binary."""
    if getattr(member.backend, "kind", "") != "systemd":
        return lambda: False

    def crashed() -> bool:
        return bool(member.backend.show().get("SubState") == "auto-restart")

    return crashed


def _rollback(cfg: Config, m: Member, old_pin: Optional[Pin], timeout: float) -> None:
    from etcd_agent.member.local import LocalMember

    LocalMember(cfg, m).backend.stop()
    restore_pin(cfg, m.name, old_pin)
    back = LocalMember(cfg, m)
    back.backend.write_unit(back.unit_text())
    back.backend.start()
    back.wait_healthy(timeout)
    log.warning("%s: rolled back to %s and healthy", m.name, back.cfg.etcd.binary)


def release_versions(cfg: Config, version: str) -> Dict[str, Optional[str]]:
    """What the tools of release ``version`` in ``[etcd] versions_dir`` report (None: missing or broken)."""
    from etcd_agent.etcd.tools import version_of

    out: Dict[str, Optional[str]] = {}
    for tool, path in release_tools(cfg, version).items():
        try:
            out[tool] = version_of(LocalHost(), path) if path and os.path.isfile(path) else None
        except AgentError:
            out[tool] = None
    return out
