"""Membership changes: ``member add/remove`` and this host's ``join/leave/reset``.

Every operation is split in two: a *pure* ``decide_*`` that turns an observed ``ClusterView``
into a ``Plan`` (or refuses with ``RefusedError``, exit 3, nothing touched), and an ``execute_*``
that takes the etcd lock ``MEMBERSHIP_LOCK``, observes again and re-decides under the lock (the
cluster may have changed since the plan was shown), then acts. ``plan_*`` = observe + decide, for
``--dry-run``. The pure half (``ClusterView``, ``Plan``, ``decide_*``, ``member_rows``) is
``scaleplan``'s; quorum arithmetic is ``member.quorum``'s; it is not re-derived here.

Data dirs are never deleted in place: ``leave`` renames the dir to ``<data_dir>.left-<UTC>`` and
keeps it; ``reset`` renames it to ``<data_dir>.reset-<UTC>`` first and deletes only that renamed
copy. The rename is atomic, so an interrupted reset leaves either the intact data dir or a clearly
named aside dir - never a half-deleted data dir that etcd would try to start from.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Optional
from urllib.parse import urlsplit

from etcd_agent.cluster.scaleplan import ClusterView, Plan, decide_add, decide_join, decide_leave, decide_remove
from etcd_agent.config import Config, Member
from etcd_agent.errors import (
    BusyError,
    EtcdError,
    EtcdMemberNotFound,
    OperationFailed,
    RefusedError,
)
from etcd_agent.etcd.client import EtcdClient, MemberInfo
from etcd_agent.member.local import (
    MEMBERSHIP_LOCK,
    LocalMember,
    add_member_idempotent,
    find_member,
)
from etcd_agent.member.quorum import has_quorum
from etcd_agent.state import markers
from etcd_agent.waiting import (
    MEMBERSHIP_TIMEOUT,
    MEMBERSHIP_TRANSIENT,
    NotYet,
    poll,
    retry_transient,
)

log = logging.getLogger(__name__)

# MEMBERSHIP_LOCK (defined in member.local, imported from here too) is the one etcd lock every
# membership change takes, CLI and daemon alike.
# How long a command waits for another agent's membership change before giving up (busy, exit 4).
LOCK_WAIT = 30.0


# ---------------------------------------------------------------- observation


def observe(client: EtcdClient, timeout: float = 2.0) -> ClusterView:
    """Member list plus a health probe of every started member (in parallel).

    Raises RefusedError when no endpoint answers: a membership change needs a live cluster.
    """
    try:
        members = client.members()
    except EtcdError as exc:
        raise RefusedError(f"the cluster is not reachable: {exc.message}") from None

    def probe(m: MemberInfo) -> bool:
        if not m.client_urls:
            return False  # added but never started
        url = m.client_urls[0]
        if m.is_learner:
            # a learner refuses linearizable reads; it is "healthy" when it answers status
            try:
                return not client.status(url, timeout=timeout).errors
            except EtcdError:
                return False
        ok, _why = client.healthy(url, timeout=timeout)
        return ok

    with ThreadPoolExecutor(max_workers=max(1, len(members))) as pool:
        results = list(pool.map(probe, members))
    return ClusterView(tuple(members), frozenset(m.id for m, ok in zip(members, results) if ok))



# ---------------------------------------------------------------- planning (observe + decide)


def plan_add(cfg: Config, client: EtcdClient, name: str, peer_url: Optional[str], learner: bool = False) -> Plan:
    return decide_add(cfg, observe(client), name, peer_url, learner=learner)


def plan_remove(cfg: Config, client: EtcdClient, name: str) -> Plan:
    return decide_remove(cfg, observe(client), name)


def plan_join(cfg: Config, client: EtcdClient, lm: LocalMember) -> Plan:
    return decide_join(cfg, observe(client), lm.member, has_data=lm.has_data())


def plan_leave(cfg: Config, client: EtcdClient, lm: LocalMember, *, reset: bool = False) -> Plan:
    return decide_leave(
        cfg, observe(client), lm.member,
        data_exists=os.path.exists(lm.data_dir), running=lm.backend.is_active(), now=time.time(), reset=reset,
    )


def others_client(cfg: Config, member: Member, timeout: float = 5.0) -> EtcdClient:
    """A client for the cluster that avoids ``member``'s own endpoint (it is about to go away)."""
    urls = [m.client_url for m in cfg.members if m.name != member.name]
    return EtcdClient.from_config(cfg, urls or None, timeout=timeout)


# ---------------------------------------------------------------- execution


@contextlib.contextmanager
def membership_lock(
    cfg: Config, view: ClusterView, *, exclude: Optional[int] = None, wait: float = LOCK_WAIT
) -> Iterator[None]:
    """Hold ``MEMBERSHIP_LOCK``; another agent holding it past ``wait`` is BusyError (exit 4).

    The lock goes through the members ``view`` saw healthy only: etcd3's multi-endpoint client
    fails a call whose endpoint is down (it fails over for the *next* call), and a cluster being
    scaled has configured members that are not running yet. ``exclude`` is the member about to be
    removed: releasing the lock through it would fail ("raft: stopped") and leave the lock held
    until its lease expires.
    """
    urls = [
        m.client_urls[0] for m in view.members if m.client_urls and view.is_healthy(m.id) and m.id != exclude
    ]
    if not urls:
        raise RefusedError("no healthy member to take the membership lock on")
    with contextlib.ExitStack() as stack:
        lock_client = stack.enter_context(EtcdClient(urls, tls=cfg.tls))
        try:
            stack.enter_context(lock_client.locked(MEMBERSHIP_LOCK, ttl=cfg.daemon.lock_ttl, timeout=wait))
        except BusyError:
            raise BusyError(f"another agent is changing the membership (lock {MEMBERSHIP_LOCK}); try again") from None
        log.debug("holding %s", MEMBERSHIP_LOCK)
        yield


def execute_add(cfg: Config, client: EtcdClient, plan: Plan) -> MemberInfo:
    """``member add`` under the lock, after re-checking; returns the new (unstarted) member."""
    assert plan.action == "add" and plan.peer_url
    with membership_lock(cfg, observe(client)):
        decide_add(cfg, observe(client), plan.target, plan.peer_url, learner=plan.learner)
        new = Member(plan.target, urlsplit(plan.peer_url).hostname or "", "", plan.peer_url, "")
        info = add_member_idempotent(client, new, learner=plan.learner)
    log.info("added member %s (%s) with peer URL %s", plan.target, info.hex_id, plan.peer_url)
    return info


def _remove(client: EtcdClient, member_id: int) -> None:
    def _do() -> None:
        try:
            client.remove_member(member_id)
        except EtcdMemberNotFound:
            # an earlier attempt went through but its answer was lost
            log.info("member %x is already gone", member_id)

    retry_transient(_do, timeout=MEMBERSHIP_TIMEOUT, what=f"member remove {member_id:x}", errors=MEMBERSHIP_TRANSIENT)


def execute_remove(cfg: Config, client: EtcdClient, plan: Plan) -> None:
    """``member remove`` under the lock, after re-checking quorum with a fresh view."""
    assert plan.action == "remove" and plan.member_id is not None
    with membership_lock(cfg, observe(client), exclude=plan.member_id):
        view = observe(client)
        fresh = decide_remove(cfg, view, plan.target)
        if fresh.member_id != plan.member_id:
            raise RefusedError(f"member {plan.target!r} changed since the plan was made; plan again")
        _remove(client, plan.member_id)
    log.info("removed member %s (%x)", plan.target, plan.member_id)
    wait_settled(client, plan.member_id, _healthy_after(view, plan.member_id))


def _healthy_after(view: ClusterView, removed: int) -> int:
    target = next((m for m in view.members if m.id == removed), None)
    lost = 1 if target is not None and not target.is_learner and view.is_healthy(removed) else 0
    return view.healthy_voters - lost


def wait_settled(client: EtcdClient, removed: int, expect_healthy: int, timeout: float = 20.0) -> bool:
    """After a removal, wait until the rest of the cluster has quorum again (removing the leader
    costs an election); True when it has. Not settling in time is logged, not raised: the removal
    itself is done and `status` shows the rest."""

    def settled() -> bool:
        try:
            view = observe(client, timeout=1.0)
        except RefusedError as exc:
            raise NotYet(exc.message) from None
        # a linearizable read needs a leader: as many healthy as before the removal = settled
        return (
            all(m.id != removed for m in view.members)
            and has_quorum(view.voters, view.healthy_voters)
            and view.healthy_voters >= expect_healthy
        )

    try:
        return poll(settled, timeout=timeout, what=f"cluster settled after removing {removed:x}", interval=0.3)
    except OperationFailed as exc:
        log.warning("%s: check `etcd-agent status`", exc.message)
        return False


def execute_join(cfg: Config, client: EtcdClient, lm: LocalMember, *, learner: bool = False) -> MemberInfo:
    """Add (or reuse) this host's member and start it, under the lock; waits until healthy.
    ``learner``: add it as a learner and promote it once it has caught up (member/learner.py).

    The wait is inside the lock: right after the add the cluster counts the new voter, and the
    lock is released (a raft write) more reliably once the new member is up.
    """
    with membership_lock(cfg, observe(client)):
        decide_join(cfg, observe(client), lm.member, has_data=lm.has_data())
        markers.clear_left(cfg, lm.member.name)  # an operator's join undoes an earlier leave: the daemon may manage it again
        if learner:
            from etcd_agent.member.learner import join_as_learner

            info = join_as_learner(lm, client, timeout=2 * cfg.etcd.start_timeout)
        else:
            info = lm.join(client)
            lm.wait_healthy(cfg.etcd.start_timeout)
    log.info("%s joined the cluster as %s", lm.member.name, info.hex_id)
    return info


def execute_leave(cfg: Config, client: EtcdClient, lm: LocalMember, *, reset: bool = False) -> Plan:
    """Remove this host's member (if listed) under the lock, stop etcd, move its data dir aside;
    ``reset`` then deletes the moved-aside copy. Returns the plan that was carried out."""
    with contextlib.ExitStack() as stack:
        view = observe(client)
        listed = find_member(list(view.members), lm.member)
        if listed is not None:
            stack.enter_context(membership_lock(cfg, view, exclude=listed.id))
            view = observe(client)  # again, under the lock
        plan = decide_leave(
            cfg, view, lm.member,
            data_exists=os.path.exists(lm.data_dir), running=lm.backend.is_active(), now=time.time(), reset=reset,
        )
        if not reset:
            # before anything irreversible: the daemon must not rejoin a member that left on purpose
            markers.mark_left(cfg, lm.member.name)
        if plan.listed and plan.member_id is not None:
            _remove(client, plan.member_id)
    if plan.listed and plan.member_id is not None:
        wait_settled(client, plan.member_id, _healthy_after(view, plan.member_id))
    # a removed etcd exits by itself within seconds; stop it anyway (and a systemd unit with it)
    lm.backend.stop()
    # rename only (never copy, never delete in place); the name gets the time of the move
    moved = lm.set_aside("reset" if reset else "left")
    plan.aside_dir = moved
    if moved is not None and reset:
        try:
            shutil.rmtree(moved)
        except OSError as exc:
            raise OperationFailed(f"{lm.member.name}: data dir moved to {moved} but not deleted: {exc}") from None
        log.info("deleted %s", moved)
    return plan
