"""The daemon's decision: a pure function from what one cycle observed to one action and a reason.

Rules, in the order they are checked:
- a restore journaled on this host (its marker in the state dir) means hands off: the restore
  stops etcd and moves data on purpose, and one that crashed must be resumed or rolled back by
  an operator, never "healed" by restarting or replacing the member;
- a rolling upgrade stepping this member (its marker, live process) means hands off as well;
- etcd stopping (its unit "deactivating": an operator's `systemctl restart`, or systemd's own
  stop) is waited out: a start now would cancel that job;
- a member with data whose etcd runs is left alone (healthy, starting, or waiting for quorum);
- a member with data whose etcd is down is restarted — restarting is how a cluster that lost
  quorum gets it back, so this is allowed without quorum; after repeated failures with the
  cluster holding quorum without us, the data is treated as corrupt and the member replaced;
- a member without data joins, replaces its stale entry, or bootstraps — all of which change
  membership or create a cluster, so they need a reachable cluster with quorum (or, for the very
  first bootstrap, a host that has never bootstrapped before). Without that it reports and waits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from etcd_agent.member.quorum import has_quorum, quorum

# after this many restarts that did not bring etcd back while the others keep quorum, the local
# data is considered corrupt and the member is replaced
MAX_RESTARTS = 3

NONE = "none"  # healthy or nothing to do
WAIT = "wait"  # something is wrong that the agent must not fix by itself now
RESTART = "restart"
START_STATIC = "start_static"
START_SEED = "start_seed"
JOIN = "join"
REPLACE = "replace"
RENDER = "render"
PROMOTE = "promote"

ACTIONS = (NONE, WAIT, RESTART, START_STATIC, START_SEED, JOIN, REPLACE, RENDER, PROMOTE)


@dataclass(frozen=True)
class Observation:
    member: str
    bootstrap: str  # static | incremental
    is_seed: bool  # first member in the config: the one that creates an incremental cluster
    has_data: bool  # the data dir holds member/
    conf_present: bool
    unit_state: str  # active | activating | deactivating | failed | inactive | unknown
    local_healthy: bool
    cluster_reachable: bool  # another member answered the member list
    voters: int  # voting members in etcd's member list (0 when unknown)
    healthy_voters: int  # of those, healthy (including us)
    self_listed: bool  # our peer URL is in the member list
    self_started: bool  # ... and that member has run (it has a name)
    failures: int  # consecutive restarts by this daemon that did not bring etcd back
    ever_bootstrapped: bool  # this host ran a member of this cluster before (state file)
    left: bool = False  # `etcd-agent leave` took this member out on purpose
    self_learner: bool = False  # etcd lists this member as a (not yet promoted) learner
    restore_op: str = ""  # a restore of this member is in progress (its marker): the op id
    restore_backup: str = ""  # ... from this backup
    upgrade_to: str = ""  # a rolling upgrade is stepping this member to this version (its marker)


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str


def others_have_quorum(o: Observation) -> bool:
    """Quorum without counting us: what a change that takes us down must still have."""
    healthy_others = o.healthy_voters - (1 if o.local_healthy else 0)
    return o.voters > 0 and healthy_others >= quorum(o.voters)


def decide(o: Observation) -> Decision:
    """The one action for this cycle, and why (rules in the module docstring, in this order)."""
    return _hands_off(o) or (_with_data(o) if o.has_data else _without_data(o))


def _hands_off(o: Observation) -> Optional[Decision]:
    """A restore or an upgrade works on this member on purpose: never heal what it stopped."""
    if o.restore_op:
        backup = o.restore_backup or "<the same backup>"
        return Decision(
            WAIT,
            f"restore {o.restore_op} (from {backup}) is in progress on this host; hands off until it "
            f"finishes. If it crashed: `etcd-agent restore --from {backup} --yes` resumes it, "
            "`etcd-agent restore rollback --yes` rolls every member back (refused once a member has finished it)",
        )
    if o.upgrade_to:
        return Decision(
            WAIT,
            f"an upgrade is stepping this member to etcd {o.upgrade_to}; hands off: it stops and "
            "restarts etcd on purpose (and rolls back itself on failure)",
        )
    if o.unit_state == "deactivating":
        # a stop job runs (an operator's `systemctl restart/stop`, or systemd's own): a start or
        # restart now would replace that job ("Job for etcd.service canceled"); systemd ends it
        # within TimeoutStopSec, and the next cycle sees what is left
        return Decision(WAIT, "etcd is stopping (a stop or restart job is running); not interfering")
    return None


def _removed(o: Observation) -> bool:
    """etcd's member list answers and does not hold us: we were removed."""
    return o.cluster_reachable and o.voters > 0 and not o.self_listed


def _with_data(o: Observation) -> Decision:
    if not o.conf_present:
        return Decision(RENDER, "etcd.conf is missing; rendering it from the config and the member list")
    if o.unit_state in ("active", "activating", "reloading"):
        return _running(o)
    if _removed(o):
        return Decision(
            WAIT,
            "this member was removed from the cluster; not restarting it on its old data "
            "(`etcd-agent leave` or `etcd-agent reset`, then it rejoins)",
        )
    if o.failures >= MAX_RESTARTS and o.self_listed and others_have_quorum(o):
        return Decision(
            REPLACE,
            f"etcd failed {o.failures} restarts on its data while the cluster keeps quorum; "
            "treating the data as corrupt: setting it aside and replacing the member",
        )
    return Decision(RESTART, f"etcd is {o.unit_state} with its data in place; restarting it")


def _running(o: Observation) -> Decision:
    if o.local_healthy:
        return Decision(NONE, "healthy")
    if o.self_learner and o.self_listed:
        # a learner refuses linearizable reads, so it never looks "healthy" until promoted
        return Decision(PROMOTE, "this member is a learner; promoting it once it has caught up")
    if o.cluster_reachable and not has_quorum(o.voters, o.healthy_voters):
        return Decision(WAIT, f"etcd runs but the cluster has no quorum ({o.healthy_voters} of {o.voters} healthy); waiting")
    if _removed(o):
        return Decision(
            WAIT,
            "this member was removed from the cluster; its data is kept: "
            "`etcd-agent leave` or `etcd-agent reset` to clean up",
        )
    return Decision(NONE, f"etcd is {o.unit_state} but not healthy yet; giving it time")


def _without_data(o: Observation) -> Decision:
    if o.left:
        return Decision(
            WAIT, "this member left the cluster on purpose (`etcd-agent leave`); `etcd-agent join` brings it back"
        )
    if o.cluster_reachable:
        return _join_or_replace(o)
    if o.ever_bootstrapped:
        return Decision(
            WAIT,
            "local data is gone and no other member answers; not bootstrapping a second cluster: "
            "waiting for the others (or restore from a backup)",
        )
    if o.bootstrap == "static":
        return Decision(START_STATIC, "static bootstrap: starting with the full initial cluster, state=new")
    if o.is_seed:
        return Decision(START_SEED, "incremental bootstrap: no cluster answers; this seed member creates it")
    return Decision(WAIT, "incremental bootstrap: waiting for the seed member to create the cluster")


def _join_or_replace(o: Observation) -> Decision:
    """No local data, the cluster answers: changes of membership, which need its quorum."""
    if not has_quorum(o.voters, o.healthy_voters - (1 if o.local_healthy else 0)):
        return Decision(
            WAIT,
            f"no local data and the cluster has no quorum ({o.healthy_voters} of {o.voters} healthy); "
            "not changing membership now",
        )
    if o.self_listed and o.self_started:
        return Decision(REPLACE, "local data is gone but the cluster lists this member; replacing it")
    if o.self_listed and o.bootstrap == "static" and not o.ever_bootstrapped:
        return Decision(START_STATIC, "listed in the forming static cluster; starting with state=new")
    return Decision(JOIN, "the cluster runs without this member; member add, then start with state=existing")
