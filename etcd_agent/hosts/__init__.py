"""Hosts the agent acts on: this machine (LocalHost) or another master (SshHost)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .base import Host, Result

if TYPE_CHECKING:  # config is cheap, but keep this module import-light for `--help`
    from ..config import Config, Member

__all__ = ["Host", "Result", "open_host"]


def open_host(cfg: "Config", member: "Member", local_name: Optional[str]) -> Host:
    """LocalHost for the local member, else an SshHost to ``member.ssh_host``.

    paramiko is imported only here, on first remote use, so CLI start-up stays fast.
    """
    if local_name is not None and member.name == local_name:
        from .local import LocalHost

        return LocalHost(member.name)
    from .ssh import SshHost

    return SshHost(member.name, member.ssh_host, cfg.ssh)
