"""Which members run on this machine: the one answer every part of the agent uses.

``machine_identity()`` reads this machine's host names and IP addresses (no DNS: a resolver that
is down during an outage would stall every lookup for its full timeout). The rules themselves are
pure: ``[local] name`` wins; otherwise a member is this machine's when its ``host`` is one of our
addresses or names. A host may run several members (the one-host demo): with ``[local] name`` set,
every member on the same host as the named one is local too.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import List, Optional, Tuple

from etcd_agent.config import Config, Member
from etcd_agent.errors import ConfigError


@dataclass(frozen=True)
class MachineIdentity:
    """What this machine calls itself: host names and IP addresses."""

    names: Tuple[str, ...]
    addresses: Tuple[str, ...]

    def is_me(self, host: str) -> bool:
        """``host`` (an address or a name from the config) is this machine."""
        return host in self.addresses or host in self.names


def machine_identity() -> MachineIdentity:
    """Host names and IP addresses of this machine."""
    import psutil

    names = {socket.gethostname()}
    names |= {n.split(".")[0] for n in list(names)}
    addrs = set()
    for entries in psutil.net_if_addrs().values():
        for a in entries:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                addrs.add(a.address.split("%")[0])
    return MachineIdentity(tuple(sorted(n for n in names if n)), tuple(sorted(addrs)))


def local_member(cfg: Config, me: MachineIdentity) -> Member:
    """The member this machine runs: ``[local] name``, else the one whose host matches this machine."""
    if cfg.local.name is not None:
        return cfg.member(cfg.local.name)
    matches = [m for m in cfg.members if m.name in me.names or me.is_me(m.host)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ConfigError(
            "local member not found: no [[member]] name or host matches this machine "
            f"(names {', '.join(me.names) or '-'}; addresses {', '.join(me.addresses) or '-'}); "
            "set [local] name"
        )
    raise ConfigError(
        f"local member is ambiguous: {', '.join(m.name for m in matches)} all match this machine; "
        "set [local] name"
    )


def is_local(cfg: Config, member: Member, me: Optional[MachineIdentity]) -> bool:
    """Does ``member`` run on this machine? ``me`` may be None when ``[local] name`` is set."""
    if cfg.local.name is not None:
        return member.name == cfg.local.name or member.host == cfg.member(cfg.local.name).host
    if me is None:
        raise ValueError("is_local needs the machine identity when [local] name is not set")
    return me.is_me(member.host) or member.name in me.names


def local_members(cfg: Config, me: Optional[MachineIdentity] = None) -> List[Member]:
    """Every member this machine runs (several on a one-host cluster), in config order."""
    if me is None and cfg.local.name is None:
        me = machine_identity()
    return [m for m in cfg.members if is_local(cfg, m, me)]
