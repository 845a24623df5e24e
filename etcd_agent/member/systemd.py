"""The systemd backend: etcd runs as ``etcd.service`` reading the rendered ``/etc/etcd/etcd.conf``.

The unit's ``Restart=on-failure`` is the first line of healing; the daemon is the second. Starts
use ``--no-block``: with ``Type=notify`` a member of a forming cluster reports ready only once a
quorum is up, and the agent must not sit inside ``systemctl start`` while the others wait for it.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Dict, Optional

from etcd_agent.config import Config
from etcd_agent.errors import CommandError
from etcd_agent.fs import missing_dirs
from etcd_agent.hosts.base import Host
from etcd_agent.hosts.local import LocalHost

log = logging.getLogger(__name__)

SYSTEMCTL = "systemctl"


class SystemdBackend:
    """One etcd member as a systemd unit on ``host`` (this machine by default)."""

    kind = "systemd"

    def __init__(self, cfg: Config, member: str, host: Optional[Host] = None) -> None:
        self.cfg = cfg
        self.member = member
        self.host: Host = host or LocalHost()
        self.unit = cfg.etcd.unit
        self.conf_file = cfg.conf_file(member)
        self.unit_file = cfg.etcd.unit_file

    def _systemctl(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        return self.host.run([SYSTEMCTL, *args], timeout=timeout, check=check).stdout

    def _write_if_changed(self, path: str, text: str, mode: int) -> bool:
        data = text.encode()
        try:
            if self.host.read(path) == data:
                return False
        except FileNotFoundError:
            pass
        # every missing dir with an exact 0755 (`mkdir -p -m` gives the mode to the last one only,
        # the umask to the others); existing ones are left alone
        missing = missing_dirs(os.path.dirname(path), self.host.exists)
        if missing:
            self.host.run(["mkdir", "-m", "0755", "--", *missing], timeout=30)
        self.host.write_atomic(path, data, mode=mode)
        log.info("%s: wrote %s", self.member, path)
        return True

    def write_conf(self, text: str) -> bool:
        # readable by the etcd user; it holds paths and URLs, no secrets
        return self._write_if_changed(self.conf_file, text, 0o644)

    def write_unit(self, text: str) -> bool:
        changed = self._write_if_changed(self.unit_file, text, 0o644)
        if changed:
            self._systemctl("daemon-reload")
        return changed

    def start(self) -> None:
        # a unit that hit its start limit or failed stays "failed" until reset
        self._systemctl("reset-failed", self.unit, check=False)
        self._systemctl("start", "--no-block", self.unit)

    def stop(self, timeout: float = 90.0) -> None:
        self._systemctl("stop", self.unit, timeout=timeout)

    def signal_stop(self) -> None:
        """A stop job queued, not waited for: ``stop`` then joins the same job and waits."""
        self._systemctl("stop", "--no-block", self.unit)

    def watch_exit(self, on_exit: Callable[[int], None]) -> Optional[int]:
        """Not here: the unit's etcd is systemd's child; the daemon's next cycle sees its exit."""
        return None

    def restart(self) -> None:
        self._systemctl("reset-failed", self.unit, check=False)
        self._systemctl("restart", "--no-block", self.unit)

    def show(self) -> Dict[str, str]:
        out = self._systemctl(
            "show", self.unit, "-p", "ActiveState,SubState,NRestarts,ExecMainStatus,ExecMainPID,MainPID,LoadState",
            check=False,
        )
        props: Dict[str, str] = {}
        for line in out.splitlines():
            if "=" in line:
                k, v = line.split("=", 1)
                props[k] = v
        return props

    def state(self) -> str:
        """active | activating | deactivating | failed | inactive | unknown."""
        try:
            return self.show().get("ActiveState", "unknown") or "unknown"
        except CommandError:
            return "unknown"

    def is_active(self) -> bool:
        return self.state() in ("active", "activating", "reloading")

    def pid(self) -> Optional[int]:
        """The unit's main process (what the unit runs: etcd), None when it has none."""
        try:
            pid = int(self.show().get("MainPID", "0") or "0")
        except (CommandError, ValueError):
            return None
        return pid or None

    def describe(self) -> str:
        p = self.show()
        return f"{self.unit} {p.get('ActiveState', '?')}/{p.get('SubState', '?')} (restarts {p.get('NRestarts', '?')}, last exit {p.get('ExecMainStatus', '?')})"
