"""What a membership change may do, decided without touching anything: the pure half of ``scale``.

A ``ClusterView`` (the member list and who answered a health probe) goes in; a ``Plan`` (the
checks that allow the change and the steps it takes) comes out, or ``RefusedError`` / ``UsageError``
says why not. ``scale`` observes the cluster and carries a plan out, re-deciding under the lock;
quorum arithmetic is ``member.quorum``'s.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Tuple
from urllib.parse import urlsplit

from etcd_agent.config import NAME_RE, Config, Member
from etcd_agent.config.validation import url_problem
from etcd_agent.errors import RefusedError, UsageError
from etcd_agent.etcd.client import MemberInfo
from etcd_agent.member.local import MEMBERSHIP_LOCK, find_member
from etcd_agent.member.quorum import can_add, can_remove, has_quorum
from etcd_agent.topology import initial_cluster

# ---------------------------------------------------------------- what a decision reads


@dataclass(frozen=True)
class ClusterView:
    """The member list and which members answered a health probe, at one moment."""

    members: Tuple[MemberInfo, ...]
    healthy: FrozenSet[int] = frozenset()

    @property
    def voters(self) -> int:
        return sum(1 for m in self.members if not m.is_learner)

    @property
    def healthy_voters(self) -> int:
        return sum(1 for m in self.members if not m.is_learner and m.id in self.healthy)

    def is_healthy(self, member_id: int) -> bool:
        return member_id in self.healthy

    def summary(self) -> str:
        learners = len(self.members) - self.voters
        extra = f" (+{learners} learner{'s' if learners != 1 else ''})" if learners else ""
        return f"{self.voters} voting members{extra}, {self.healthy_voters} healthy"


# ---------------------------------------------------------------- plans


@dataclass
class Plan:
    """What an operation will do and why it is allowed; printed by ``--dry-run`` and before asking."""

    action: str  # add | remove | join | leave | reset
    target: str
    peer_url: Optional[str] = None
    member_id: Optional[int] = None
    learner: bool = False
    listed: bool = False  # the target is in etcd's member list (remove/join/leave/reset)
    data_dir: Optional[str] = None
    aside_dir: Optional[str] = None  # where leave/reset move the data dir
    initial_cluster: Optional[str] = None  # what a joining member starts with
    checks: List[str] = field(default_factory=list)
    steps: List[str] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {
            "action": self.action,
            "target": self.target,
            "peer_url": self.peer_url,
            "member_id": None if self.member_id is None else f"{self.member_id:x}",
            "learner": self.learner,
            "listed": self.listed,
            "data_dir": self.data_dir,
            "aside_dir": self.aside_dir,
            "initial_cluster": self.initial_cluster,
            "checks": list(self.checks),
            "steps": list(self.steps),
        }

    def text(self) -> str:
        ident = f" ({self.member_id:x})" if self.member_id is not None else ""
        lines = [f"plan: {self.action} {self.target}{ident}"]
        lines += ["  checks:"] + [f"    - {c}" for c in self.checks]
        if self.steps:
            lines += ["  steps:"] + [f"    {i}. {s}" for i, s in enumerate(self.steps, 1)]
        else:
            lines.append("  nothing to do")
        return "\n".join(lines)


def _utc_stamp(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


def _by_name(view: ClusterView, cfg: Config, name: str) -> Optional[MemberInfo]:
    """The etcd member called ``name``; an unstarted one (no name yet) by its configured peer URL."""
    named = [m for m in view.members if m.name == name]
    if len(named) > 1:
        raise RefusedError(
            f"{len(named)} members are called {name!r} ({', '.join(m.hex_id for m in named)}): "
            "remove by hand with etcdctl member remove ID"
        )
    if named:
        return named[0]
    for m in cfg.members:
        if m.name == name:
            return find_member(list(view.members), m)
    return None


def _lock_step() -> str:
    return f"take the etcd lock {MEMBERSHIP_LOCK} (one membership change at a time)"


def _pairs_without(view: ClusterView, peer_url: str) -> List[Tuple[str, str]]:
    """(name, peer URL) of every member except the one with ``peer_url``; unstarted ones have no
    name yet and are listed by their id so the operator sees them."""
    return [(m.name or m.hex_id, m.peer_urls[0]) for m in view.members if m.peer_urls and peer_url not in m.peer_urls]


def decide_add(cfg: Config, view: ClusterView, name: str, peer_url: Optional[str], *, learner: bool = False) -> Plan:
    """Plan ``member add``: a new name and peer URL, and enough healthy voters (``can_add``)."""
    if not NAME_RE.match(name):
        raise UsageError(f"member name {name!r} is not a safe name (letters, digits, _ . -; max 63)")
    configured = next((m for m in cfg.members if m.name == name), None)
    if peer_url is None:
        if configured is None:
            raise UsageError(f"{name!r} is not in the config: give its --peer-url")
        peer_url = configured.peer_url
    problem = url_problem(peer_url)
    if problem:
        raise UsageError(f"--peer-url: {problem}")
    want = "https" if cfg.tls.peer_enabled else "http"
    if urlsplit(peer_url).scheme != want:
        raise UsageError(f"--peer-url {peer_url!r} must use {want} ({'peer TLS is' if want == 'https' else 'no peer TLS'} configured)")
    if configured is not None and configured.peer_url != peer_url:
        raise RefusedError(f"member {name!r} is configured with peer URL {configured.peer_url}, not {peer_url}")
    other = next((m for m in cfg.members if m.peer_url == peer_url and m.name != name), None)
    if other is not None:
        raise RefusedError(f"peer URL {peer_url} is configured for member {other.name!r}, not {name!r}")
    for m in view.members:
        if peer_url in m.peer_urls:
            state = f"member {m.name!r}" if m.started else "a member added earlier but never started"
            raise RefusedError(
                f"peer URL {peer_url} already belongs to {state} ({m.hex_id})"
                + ("" if m.started else f": start it with `etcd-agent join` on its host, or `member remove {name}`")
            )
        if m.name == name:
            raise RefusedError(f"a member called {name!r} already exists ({m.hex_id})")
    ok, why = can_add(view.voters, view.healthy_voters, learner=learner)
    if not ok:
        raise RefusedError(
            f"refusing to add {name!r}: {why}", details=[f"now: {view.summary()}"]
            + ([] if learner else ["a learner (--learner) does not count toward quorum"])
        )
    ic = initial_cluster(_pairs_without(view, peer_url) + [(name, peer_url)])
    return Plan(
        action="add",
        target=name,
        peer_url=peer_url,
        learner=learner,
        initial_cluster=ic,
        checks=[f"now: {view.summary()}", why, f"name {name!r} and peer URL {peer_url} are new to the cluster"],
        steps=[
            _lock_step(),
            f"etcd member add {name} --peer-urls={peer_url}{' --learner' if learner else ''}",
            f"then start {name} from an empty data dir with ETCD_INITIAL_CLUSTER_STATE=existing and "
            f"ETCD_INITIAL_CLUSTER={ic} (`etcd-agent join` on its host does exactly that)",
        ],
    )


def decide_remove(cfg: Config, view: ClusterView, name: str) -> Plan:
    """Plan ``member remove``: a known member, never the last, and quorum kept (``can_remove``)."""
    target = _by_name(view, cfg, name)
    if target is None:
        known = ", ".join(m.name or m.hex_id for m in view.members)
        raise RefusedError(f"no member {name!r} in the cluster (members: {known})")
    if len(view.members) <= 1:
        raise RefusedError(f"refusing to remove {name!r}: it is the last member of the cluster")
    healthy = view.is_healthy(target.id)
    ok, why = can_remove(view.voters, view.healthy_voters, target_is_voter=not target.is_learner, target_healthy=healthy)
    if not ok:
        raise RefusedError(f"refusing to remove {name!r}: {why}", details=[f"now: {view.summary()}"])
    return Plan(
        action="remove",
        target=name,
        peer_url=target.peer_urls[0] if target.peer_urls else None,
        member_id=target.id,
        learner=target.is_learner,
        listed=True,
        checks=[f"now: {view.summary()}; {name} is {'healthy' if healthy else 'not healthy'}", why],
        steps=[
            _lock_step(),
            f"etcd member remove {target.hex_id}",
            "the removed etcd stops by itself; its data dir on its host is stale from then on "
            "(`etcd-agent leave` there moves it aside)",
        ],
    )


def decide_join(cfg: Config, view: ClusterView, member: Member, *, has_data: bool) -> Plan:
    """Plan ``join`` of this host's member (incremental path).

    A join starts the new member right after adding it, so the check is that the cluster has
    quorum now and will have it once the new member runs; the short gap in between is the
    documented incremental join (a bare ``member add`` must pass the stricter ``can_add``).
    """
    existing = find_member(list(view.members), member)
    if existing is not None and existing.started:
        raise RefusedError(
            f"{member.name} is already started in the cluster as {existing.hex_id}: nothing to join"
        )
    if has_data:
        raise RefusedError(
            f"{member.name}: {cfg.data_dir(member.name)} already holds member data; a joining member "
            "must start from an empty data dir (`etcd-agent leave` moves it aside)"
        )
    voters, healthy = view.voters, view.healthy_voters
    if not has_quorum(voters, healthy):
        raise RefusedError(f"refusing to join: the cluster has no quorum ({view.summary()})")
    after = voters if existing is not None else voters + 1
    if not has_quorum(after, healthy + 1):
        raise RefusedError(
            f"refusing to join: even with {member.name} running, {healthy + 1} of {after} voters "
            "would be healthy - fix the unhealthy members first",
            details=[f"now: {view.summary()}"],
        )
    ic = initial_cluster(_pairs_without(view, member.peer_url) + [(member.name, member.peer_url)])
    add = (
        f"reuse the member added earlier ({existing.hex_id}) for {member.peer_url}"
        if existing is not None
        else f"etcd member add {member.name} --peer-urls={member.peer_url}"
    )
    return Plan(
        action="join",
        target=member.name,
        peer_url=member.peer_url,
        member_id=existing.id if existing is not None else None,
        listed=existing is not None,
        data_dir=cfg.data_dir(member.name),
        initial_cluster=ic,
        checks=[f"now: {view.summary()}", f"{healthy + 1} of {after} voters healthy once {member.name} runs",
                f"{cfg.data_dir(member.name)} holds no member data"],
        steps=[
            _lock_step(),
            add,
            f"render {cfg.conf_file(member.name)} with ETCD_INITIAL_CLUSTER_STATE=existing, ETCD_INITIAL_CLUSTER={ic}",
            f"start etcd ({cfg.etcd.service_manager} backend) and wait until it is healthy",
        ],
    )


def decide_leave(
    cfg: Config,
    view: ClusterView,
    member: Member,
    *,
    data_exists: bool,
    running: bool,
    now: float,
    reset: bool = False,
) -> Plan:
    """Plan ``leave`` (remove self, stop, move the data dir aside) or ``reset`` (same, then delete
    the moved-aside copy). Removal must keep quorum and never removes the last member."""
    action = "reset" if reset else "leave"
    data_dir = cfg.data_dir(member.name)
    aside = f"{data_dir.rstrip('/')}.{'reset' if reset else 'left'}-{_utc_stamp(now)}"
    target = find_member(list(view.members), member)
    checks = [f"now: {view.summary()}"]
    steps: List[str] = []
    if target is not None:
        if len(view.members) <= 1:
            raise RefusedError(f"refusing to {action} {member.name}: it is the last member of the cluster")
        ok, why = can_remove(
            view.voters, view.healthy_voters,
            target_is_voter=not target.is_learner, target_healthy=view.is_healthy(target.id),
        )
        if not ok:
            raise RefusedError(f"refusing to {action} {member.name}: {why}", details=checks)
        checks.append(why)
        steps += [_lock_step(), f"etcd member remove {target.hex_id} ({member.name})"]
    else:
        checks.append(f"{member.name} is not in the cluster's member list: nothing to remove")
    if running or target is not None:
        steps.append(f"stop etcd ({cfg.etcd.service_manager} backend)")
    if data_exists:
        steps.append(f"move {data_dir} aside to {aside}")
        if reset:
            steps.append(f"delete {aside} (only after the move succeeded)")
    return Plan(
        action=action,
        target=member.name,
        peer_url=member.peer_url,
        member_id=target.id if target is not None else None,
        listed=target is not None,
        data_dir=data_dir,
        aside_dir=aside if data_exists else None,
        checks=checks,
        steps=steps,
    )


def member_rows(cfg: Config, view: ClusterView) -> List[Dict[str, Any]]:
    """``member list`` rows: etcd's view plus started/learner/healthy flags and the config's name."""
    by_peer = {m.peer_url: m.name for m in cfg.members}
    rows = []
    for m in view.members:
        configured: Optional[str] = next((by_peer[u] for u in m.peer_urls if u in by_peer), None)
        rows.append({
            "id": m.hex_id,
            "name": m.name or configured or "",
            "started": m.started,
            "learner": m.is_learner,
            "healthy": view.is_healthy(m.id),
            "in_config": configured is not None,
            "peer_urls": list(m.peer_urls),
            "client_urls": list(m.client_urls),
        })
    return rows
