"""Learner joins: add a new member as a non-voting learner, promote it once it has caught up.

A learner receives the log but does not count toward quorum, so a slow catch-up (a big db over
a thin link) never leaves the cluster with an even, fragile voter count. etcd refuses the
promotion ("can only promote a learner member which is in sync with leader") until the learner is
close enough to the leader; the agent retries that refusal, and only that, within a deadline.
"""
from __future__ import annotations

import logging
from typing import Optional

from etcd_agent.config import Config
from etcd_agent.errors import EtcdError, EtcdMemberNotFound, EtcdUnavailable, OperationFailed
from etcd_agent.etcd.client import EtcdClient, MemberInfo
from etcd_agent.member.local import LocalMember, find_member
from etcd_agent.waiting import SYSTEM_CLOCK, Clock, NotYet, poll

log = logging.getLogger(__name__)

_NOT_READY = ("in sync with leader", "not ready", "learner member which is in sync")


def _find(cfg: Config, client: EtcdClient, name: str) -> MemberInfo:
    members = client.members()
    try:
        hit = find_member(members, cfg.member(name))
    except Exception:  # not in the config: by name or hex id as etcd lists it
        hit = next((m for m in members if m.name == name or m.hex_id == name.lower()), None)
    if hit is None:
        raise EtcdMemberNotFound(f"no member {name!r} in etcd's member list")
    return hit


def promote_when_ready(
    cfg: Config, client: EtcdClient, name: str, timeout: float = 120.0, clock: Clock = SYSTEM_CLOCK
) -> MemberInfo:
    """Promote learner ``name``; retries etcd's "not in sync yet" refusal until ``timeout``."""

    def promote() -> Optional[MemberInfo]:
        info = _find(cfg, client, name)
        if not info.is_learner:
            return info
        try:
            client.promote_member(info.id)
        except EtcdUnavailable as exc:
            raise NotYet(exc.message) from None
        except EtcdError as exc:
            if not any(s in exc.message.lower() for s in _NOT_READY):
                raise
            log.info("learner %s not caught up yet (%s); retrying", name, exc.message)
            raise NotYet(exc.message) from None
        return _wait_voter(cfg, client, name, clock=clock)

    promoted = poll(promote, timeout=timeout, what=f"learner {name} promoted", interval=0.5, clock=clock)
    assert promoted is not None  # poll returns only a true value
    return promoted


def join_as_learner(lm: LocalMember, client: EtcdClient, timeout: float = 120.0, clock: Clock = SYSTEM_CLOCK) -> MemberInfo:
    """``member add --learner``, start this member, wait until it answers, promote it."""
    info = lm.join(client, learner=True)
    deadline = clock.monotonic() + timeout

    def answers() -> bool:
        # a learner refuses linearizable reads: "started" means it answers status
        try:
            with EtcdClient.from_config(lm.cfg, [lm.member.client_url], timeout=2.0) as c:
                c.status(lm.member.client_url, timeout=2.0)
            return True
        except EtcdError as exc:
            if not lm.backend.is_active():
                raise OperationFailed(f"{lm.member.name}: etcd exited while starting as a learner ({lm.backend.describe()})") from exc
            raise NotYet(exc.message) from None

    poll(answers, timeout=timeout, what=f"learner {lm.member.name} answering", clock=clock)

    def left() -> float:  # the rest of the one budget
        return max(1.0, deadline - clock.monotonic())

    promoted = promote_when_ready(lm.cfg, client, lm.member.name, timeout=left(), clock=clock)
    lm.wait_healthy(max(5.0, left()))
    log.info("%s joined as learner %s and was promoted", lm.member.name, info.hex_id)
    return promoted


def _wait_voter(cfg: Config, client: EtcdClient, name: str, timeout: float = 10.0, clock: Clock = SYSTEM_CLOCK) -> MemberInfo:
    """The member list as another member serves it may lag the promotion by a raft apply: wait
    until it shows the member as a voter (seen: a list read right after the promote said learner).
    Past the deadline the member is returned as listed: the promotion itself succeeded."""
    try:
        voter = poll(lambda: _voter(cfg, client, name), timeout=timeout, what=f"{name} listed as a voter",
                     interval=0.1, clock=clock)
        assert voter is not None  # poll returns only a true value
        return voter
    except OperationFailed:
        return _find(cfg, client, name)


def _voter(cfg: Config, client: EtcdClient, name: str) -> Optional[MemberInfo]:
    info = _find(cfg, client, name)
    return None if info.is_learner else info
