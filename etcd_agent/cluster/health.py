"""Is the cluster whole? The health gates every cluster-wide operation waits on.

Upgrade, maintenance and restore each need "every configured member answers a linearizable read"
(and restore also "in one cluster, at one revision") before their next step; they wait here, on
one definition, with one way to wait (``waiting.poll``).
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, NoReturn, Optional, Tuple

from etcd_agent.config import Config
from etcd_agent.errors import EtcdError, OperationFailed, RefusedError
from etcd_agent.etcd.client import EndpointStatus, EtcdClient
from etcd_agent.waiting import SYSTEM_CLOCK, Clock, NotYet, poll

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


def statuses(cfg: Config, client: EtcdClient, timeout: float = 3.0, purpose: str = "this operation") -> Dict[str, EndpointStatus]:
    """Status of every configured member; RefusedError naming the ones that do not answer."""
    out: Dict[str, EndpointStatus] = {}
    bad: List[str] = []
    for m in cfg.members:
        try:
            out[m.name] = client.status(m.client_url, timeout=timeout)
        except EtcdError as exc:
            bad.append(f"{m.name}: {exc.message}")
    if bad:
        raise RefusedError(f"not every member answers; {purpose} needs the whole cluster", details=bad)
    return out


def _alarm_problem(text: str) -> bool:
    low = text.lower()
    return "alarm" in low or "nospace" in low


def cluster_health(cfg: Config, client: EtcdClient, timeout: float = 2.0, allow_alarms: bool = False) -> Tuple[bool, List[str]]:
    """Every configured member answers a linearizable read, and etcd lists no member we do not run.
    ``allow_alarms``: a member refusing only because of an alarm counts (clearing NOSPACE needs that)."""
    problems = []
    for m in cfg.members:
        ok, why = client.healthy(m.client_url, timeout=timeout)
        if not ok:
            problems.append(f"{m.name}: {why or 'unhealthy'}")
    try:
        listed = client.members()
        if len(listed) != len(cfg.members) or not all(x.started for x in listed):
            problems.append(f"etcd lists {len(listed)} members ({sum(1 for x in listed if not x.started)} never "
                            f"started), the config {len(cfg.members)}")
    except EtcdError as exc:
        problems.append(f"member list: {exc.message}")
    if allow_alarms:
        problems = [p for p in problems if not _alarm_problem(p)]
    return not problems, problems


def wait_cluster_healthy(
    cfg: Config, client: EtcdClient, timeout: float, *, allow_alarms: bool = False, clock: Clock = SYSTEM_CLOCK
) -> None:
    """Wait until ``cluster_health`` holds; OperationFailed with its problems at the deadline."""
    last: List[str] = []

    def healthy() -> bool:
        ok, problems = cluster_health(cfg, client, allow_alarms=allow_alarms)
        last[:] = problems
        if not ok:
            raise NotYet("; ".join(problems))
        return True

    try:
        poll(healthy, timeout=timeout, what="cluster healthy", interval=0.5, clock=clock)
    except OperationFailed as exc:
        raise OperationFailed(exc.message, details=last) from None


def wait_converged(
    cfg: Config, timeout: float, say: Progress = lambda s: None, *, clock: Clock = SYSTEM_CLOCK,
    client: Optional[EtcdClient] = None,
) -> Dict[str, int]:
    """Wait until every member is healthy, in one cluster, at the same revision."""
    own = client is None
    c = client or EtcdClient.from_config(cfg, timeout=2.0)
    shown = {"why": ""}

    def converged() -> Dict[str, int]:
        revs: Dict[str, int] = {}
        clusters = set()
        for m in cfg.members:
            why, st = c.health(m.client_url, timeout=2.0)
            if why or st is None:
                _not_yet(f"{m.name}: {why or 'no status'}")
            revs[m.name] = st.revision
            clusters.add(st.cluster_id)
        if len(set(revs.values())) != 1 or len(clusters) != 1:
            _not_yet(f"revisions {revs}" + (f", {len(clusters)} cluster ids" if len(clusters) > 1 else ""))
        return revs

    def _not_yet(why: str) -> NoReturn:
        if why != shown["why"]:
            log.info("waiting for the cluster to converge: %s", why)
            shown["why"] = why
        raise NotYet(why)

    try:
        # a restored cluster is usually whole within a second of its start: look often
        revs = poll(converged, timeout=timeout, what="every member healthy at one revision", interval=0.1,
                    clock=clock)
    finally:
        if own:
            c.close()
    say(f"all {len(revs)} members healthy at revision {next(iter(revs.values()))}")
    return revs
