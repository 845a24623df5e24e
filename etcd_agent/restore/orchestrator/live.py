"""The running cluster as a restore sees it: what the orchestrator asks the cluster itself over
etcd's client API (its own evidence, who leads, convergence, ids, lineage, Kubernetes cleanup,
apiserver readiness). ``EtcdCluster`` is the real one; the component tier scripts its own."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Tuple

from etcd_agent.backup.evidence import gather
from etcd_agent.backup.identity import Evidence
from etcd_agent.cluster.health import wait_converged
from etcd_agent.config import Config, Member
from etcd_agent.errors import AgentError
from etcd_agent.etcd.lineage import record_lineage
from etcd_agent.etcd.rpc import EtcdRpc

Progress = Callable[[str], None]


class LiveCluster(Protocol):
    """What the orchestrator asks the cluster itself (over etcd's client API)."""

    def evidence(self) -> Evidence:
        """What the running cluster says of itself (member list, id, restore lineage in etcd);
        empty when no member answers (an outage)."""
        ...

    def leader(self) -> Optional[str]:
        """The member that leads now, if any answers."""
        ...

    def converged(self, timeout: float, say: Progress) -> Dict[str, int]:
        """Wait until every member is healthy at one revision; member -> revision."""
        ...

    def member_ids(self) -> Dict[str, Tuple[str, str]]:
        """member -> (its id, the cluster id), as each answers now."""
        ...

    def record_lineage(self, member_ids: List[str]) -> None:
        """Append the restored snapshot's member ids to the lineage kept in etcd."""
        ...

    def k8s_cleanup(self) -> List[str]:
        """Remove what Kubernetes left stale in the restored data (``cluster.kubernetes``)."""
        ...

    def wait_ready(self, member: Member) -> Optional[float]:
        """Wait for the member's apiserver /readyz; seconds, or None when no URL is set."""
        ...

    def writer(self) -> EtcdRpc:
        """A connection for writing into the restored cluster (its leader's, when one answers):
        a point-in-time restore's tail is loaded through it."""
        ...


class EtcdCluster:
    """``LiveCluster`` through the etcd client API of the configured members."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def evidence(self) -> Evidence:
        return gather(self.cfg, local=False)

    def leader(self) -> Optional[str]:
        from etcd_agent.etcd.client import EtcdClient

        with EtcdClient.from_config(self.cfg, timeout=1.0) as c:
            for m in self.cfg.members:
                try:
                    if c.status(m.client_url, timeout=1.0).is_leader:
                        return m.name
                except AgentError:
                    continue
        return None

    def converged(self, timeout: float, say: Progress) -> Dict[str, int]:
        return wait_converged(self.cfg, timeout, say)

    def member_ids(self) -> Dict[str, Tuple[str, str]]:
        from etcd_agent.etcd.client import EtcdClient

        out: Dict[str, Tuple[str, str]] = {}
        with EtcdClient.from_config(self.cfg, timeout=3.0) as c:
            for m in self.cfg.members:
                try:
                    st = c.status(m.client_url)
                    out[m.name] = (f"{st.member_id:x}", f"{st.cluster_id:x}")
                except AgentError:
                    pass
        return out

    def record_lineage(self, member_ids: List[str]) -> None:
        record_lineage(self.cfg, member_ids)

    def k8s_cleanup(self) -> List[str]:
        from etcd_agent.cluster.kubernetes import cleanup
        from etcd_agent.etcd.client import EtcdClient

        with EtcdClient.from_config(self.cfg, timeout=5.0) as c:
            plan = cleanup(self.cfg, c, dry_run=False)
        return [f"deleted {r.key}: {r.why}" for r in plan.delete] + plan.notes

    def wait_ready(self, member: Member) -> Optional[float]:
        from etcd_agent.cluster.kubernetes import wait_ready

        return wait_ready(self.cfg, member)

    def writer(self) -> EtcdRpc:
        leader = self.leader()
        m = next((m for m in self.cfg.members if m.name == leader), self.cfg.members[0])
        return EtcdRpc(m.client_url, tls=self.cfg.tls, timeout=30.0)
