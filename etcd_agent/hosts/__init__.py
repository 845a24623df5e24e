"""Hosts the agent acts on: this machine (LocalHost) or another master (SshHost). Transport only:
which members a host runs is ``locality``'s question, how to drive them ``node.sessions``'."""
from __future__ import annotations

from etcd_agent.hosts.base import Host, Result, Session

__all__ = ["Host", "Result", "Session"]
