"""The local member: bootstrap, join and health of the etcd member this host runs.

Backend-agnostic: a ``backend`` (process or systemd) writes the conf and runs etcd; the etcd
client talks to the cluster. The order of a join is the one etcd documents: ``member add`` first,
then start the new member with state=existing from an *empty* data dir (a leftover ``member/``
dir silently overrides every --initial-cluster flag).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, List, Optional, Protocol

from etcd_agent.config import Config, Member
from etcd_agent.errors import EtcdPeerExists, OperationFailed, RefusedError
from etcd_agent.etcd.client import EtcdClient, MemberInfo
from etcd_agent.topology import (
    Bootstrap,
    join_bootstrap,
    render_conf,
    render_unit,
    seed_bootstrap,
    static_bootstrap,
)
from etcd_agent.waiting import (
    MEMBERSHIP_TIMEOUT,
    MEMBERSHIP_TRANSIENT,
    NotYet,
    poll,
    retry_transient,
)

log = logging.getLogger(__name__)

# the etcd lock every agent takes around a membership change (join, replace, scale)
MEMBERSHIP_LOCK = "/etcd-agent/locks/membership"


class Backend(Protocol):
    """How etcd is run on this host: ``process`` (the agent's child) or ``systemd`` (a unit)."""

    kind: str

    def write_conf(self, text: str) -> bool: ...
    def write_unit(self, text: str) -> bool: ...
    def start(self) -> None: ...
    def stop(self, timeout: float = 15.0) -> None: ...
    def signal_stop(self) -> None: ...  # ask etcd to stop and return at once (``stop`` waits)
    def restart(self) -> None: ...
    def is_active(self) -> bool: ...
    def pid(self) -> Optional[int]: ...  # the etcd it runs: its proven pid file's, or the unit's MainPID
    def state(self) -> str: ...
    def describe(self) -> str: ...
    # call the function, from a thread of its own, the moment this etcd exits; the pid watched,
    # or None where the backend cannot tell (the daemon's next cycle notices then)
    def watch_exit(self, on_exit: Callable[[int], None]) -> Optional[int]: ...


def backend_for(cfg: Config, member: str) -> Backend:
    if cfg.etcd.service_manager == "process":
        from etcd_agent.member.process import ProcessBackend

        return ProcessBackend(cfg, member)
    from etcd_agent.member.systemd import SystemdBackend

    return SystemdBackend(cfg, member)


class LocalMember:
    """One member on this host."""

    def __init__(self, cfg: Config, member: Member, backend: Optional[Backend] = None) -> None:
        from etcd_agent.state.pins import pinned_config

        cfg = pinned_config(cfg, member.name)  # a rolling upgrade's binary, if one is pinned
        self.cfg = cfg
        self.member = member
        self.backend = backend or backend_for(cfg, member.name)
        self.data_dir = cfg.data_dir(member.name)

    # ------------------------------------------------------------ state

    def has_data(self) -> bool:
        """True when the data dir holds an etcd member (etcd would ignore --initial-cluster)."""
        return os.path.isdir(os.path.join(self.data_dir, "member"))

    def set_aside(self, tag: str) -> Optional[str]:
        """Move the data dir to ``<data_dir>.<tag>-<UTC time>`` (never delete); None if absent."""
        if not os.path.exists(self.data_dir):
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = f"{self.data_dir.rstrip('/')}.{tag}-{stamp}"
        n = 1
        while os.path.exists(target):
            n += 1
            target = f"{self.data_dir.rstrip('/')}.{tag}-{stamp}.{n}"
        os.rename(self.data_dir, target)
        log.warning("%s: data dir %s set aside as %s", self.member.name, self.data_dir, target)
        return target

    def render(self, boot: Bootstrap) -> bool:
        """Write etcd.conf (and the unit, for systemd) for ``boot``; True when anything changed."""
        changed = self.backend.write_conf(render_conf(self.cfg, self.member, boot))
        return self.backend.write_unit(self.unit_text()) or changed

    def unit_text(self) -> str:
        """etcd.service for this member, ExecStart= at its pinned release (read now, not at init)."""
        from etcd_agent.state.pins import pinned_binary

        return render_unit(self.cfg, self.member, pinned_binary(self.cfg, self.member.name))

    def client(self, timeout: float = 5.0) -> EtcdClient:
        return EtcdClient.from_config(self.cfg, timeout=timeout)

    def healthy(self, timeout: float = 3.0) -> bool:
        with EtcdClient.from_config(self.cfg, [self.member.client_url], timeout=timeout) as c:
            ok, _why = c.healthy(self.member.client_url, timeout=timeout)
            return ok

    def wait_healthy(self, timeout: float, cancel: Optional[Callable[[], bool]] = None) -> None:
        """Wait until this member answers a linearizable read; ``cancel()`` true aborts the wait."""
        with EtcdClient.from_config(self.cfg, [self.member.client_url], timeout=2.0) as c:

            def healthy() -> bool:
                ok, why = c.healthy(self.member.client_url, timeout=2.0)
                if ok:
                    return True
                if not self.backend.is_active():
                    raise OperationFailed(f"{self.member.name}: etcd exited while starting ({self.backend.describe()})")
                raise NotYet(why)

            poll(healthy, timeout=timeout, what=f"{self.member.name} healthy", cancel=cancel)

    # ------------------------------------------------------------ bootstrap

    def start_static(self) -> None:
        """Static bootstrap: render the full initial cluster (state=new) and start."""
        self._refuse_stale_data_for_new()
        self.render(static_bootstrap(self.cfg, self.member))
        self.backend.start()

    def start_seed(self) -> None:
        """Incremental bootstrap, first member: a one-member cluster."""
        self._refuse_stale_data_for_new()
        self.render(seed_bootstrap(self.cfg, self.member))
        self.backend.start()

    def start_existing(self) -> None:
        """Start from the data dir that is there (the initial-cluster flags do not matter then)."""
        if not self.has_data():
            raise RefusedError(f"{self.member.name}: no member data in {self.data_dir} to start from")
        self.backend.start()

    def _refuse_stale_data_for_new(self) -> None:
        if self.has_data():
            raise RefusedError(
                f"{self.member.name}: {self.data_dir} already holds member data; "
                "start it as it is, or move it aside to bootstrap anew"
            )

    def join(self, client: EtcdClient, *, learner: bool = False) -> MemberInfo:
        """Incremental join: ``member add`` (idempotent), render state=existing, start."""
        if self.has_data():
            raise RefusedError(
                f"{self.member.name}: {self.data_dir} already holds member data; a joining member "
                "must start from an empty data dir (move the old one aside first)"
            )
        info = add_member_idempotent(client, self.member, learner=learner)
        pairs = [(m.name, m.peer_urls[0]) for m in client.members() if m.peer_urls and m.id != info.id]
        boot = join_bootstrap(self.cfg, self.member, pairs)
        self.render(boot)
        self.backend.start()
        return info


def find_member(members: List[MemberInfo], member: Member) -> Optional[MemberInfo]:
    """The etcd member for a configured one: by peer URL (names are empty until first start)."""
    for m in members:
        if member.peer_url in m.peer_urls:
            return m
    for m in members:
        if m.name and m.name == member.name:
            return m
    return None


def add_member_idempotent(client: EtcdClient, member: Member, *, learner: bool = False) -> MemberInfo:
    """``member add`` that tolerates an earlier half-done attempt ("Peer URLs already exists")."""

    def _add() -> MemberInfo:
        existing = find_member(client.members(), member)
        if existing is not None:
            if existing.name and existing.name != member.name:
                raise RefusedError(
                    f"peer URL {member.peer_url} already belongs to member {existing.name!r} ({existing.hex_id})"
                )
            log.info("member %s already in the member list as %s; not adding again", member.name, existing.hex_id)
            return existing
        try:
            return client.add_member([member.peer_url], learner=learner)
        except EtcdPeerExists:
            found = find_member(client.members(), member)
            if found is None:
                raise
            return found

    return retry_transient(_add, timeout=MEMBERSHIP_TIMEOUT, what=f"member add {member.name}", errors=MEMBERSHIP_TRANSIENT)

