"""Is the cluster whole? The health gates every cluster-wide operation waits on.

Upgrade, maintenance and restore each need "every configured member answers a linearizable read"
(and sometimes "at one revision") before their next step; they wait here, on one definition.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Tuple

from ..config import Config
from ..errors import AgentError, EtcdError, OperationFailed, RefusedError
from ..etcd.client import EndpointStatus, EtcdClient

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


def statuses(cfg: Config, client: EtcdClient, timeout: float = 3.0) -> Dict[str, EndpointStatus]:
    """Status of every configured member; RefusedError naming the ones that do not answer."""
    out: Dict[str, EndpointStatus] = {}
    bad: List[str] = []
    for m in cfg.members:
        try:
            out[m.name] = client.status(m.client_url, timeout=timeout)
        except EtcdError as exc:
            bad.append(f"{m.name}: {exc.message}")
    if bad:
        raise RefusedError("not every member answers; an upgrade needs the whole cluster", details=bad)
    return out


def cluster_health(cfg: Config, client: EtcdClient, timeout: float = 2.0) -> Tuple[bool, List[str]]:
    """Every configured member answers a linearizable read, and etcd lists no member we do not run."""
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
    return not problems, problems


def wait_cluster_healthy(cfg: Config, client: EtcdClient, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    problems: List[str] = []
    while time.monotonic() < deadline:
        ok, problems = cluster_health(cfg, client)
        if ok:
            return
        time.sleep(0.5)
    raise OperationFailed(f"cluster not healthy after {timeout:.0f}s", details=problems)


def wait_converged(cfg: Config, timeout: float, say: Progress = lambda s: None) -> Dict[str, int]:
    """Wait until every member is healthy, in one cluster, at the same revision."""
    from ..etcd.client import EtcdClient

    deadline = time.monotonic() + timeout
    last = ""
    with EtcdClient.from_config(cfg, timeout=2.0) as c:
        while time.monotonic() < deadline:
            revs: Dict[str, int] = {}
            clusters = set()
            why = ""
            for m in cfg.members:
                ok, w = c.healthy(m.client_url, timeout=2.0)
                if not ok:
                    why = f"{m.name}: {w}"
                    break
                try:
                    st = c.status(m.client_url, timeout=2.0)
                except AgentError as exc:
                    why = f"{m.name}: {exc.message}"
                    break
                revs[m.name] = st.revision
                clusters.add(st.cluster_id)
            else:
                if len(set(revs.values())) == 1 and len(clusters) == 1:
                    say(f"all {len(revs)} members healthy at revision {next(iter(revs.values()))}")
                    return revs
                why = f"revisions {revs}"
            if why != last:
                log.info("waiting for the restored cluster: %s", why)
                last = why
            time.sleep(0.2)
    raise OperationFailed(f"restored cluster not healthy at one revision after {timeout:.0f}s: {last}")


