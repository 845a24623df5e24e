"""Cluster status: one row per member, as ``etcdctl endpoint status`` shows it, never crashing on a
dead member (it becomes a row with an error)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from etcd_agent.config import Config
from etcd_agent.errors import EtcdError
from etcd_agent.etcd.client import EtcdClient, MemberInfo


@dataclass
class MemberStatus:
    name: str
    endpoint: str
    reachable: bool = False
    id: Optional[str] = None
    version: Optional[str] = None
    db_size: Optional[int] = None
    db_size_in_use: Optional[int] = None
    leader: Optional[bool] = None
    learner: Optional[bool] = None
    raft_term: Optional[int] = None
    raft_index: Optional[int] = None
    revision: Optional[int] = None
    healthy: bool = False
    errors: List[str] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def cluster_status(cfg: Config, timeout: float = 2.0) -> List[MemberStatus]:
    """Status of every configured member, plus members etcd knows that the config does not."""
    rows = [MemberStatus(name=m.name, endpoint=m.client_url) for m in cfg.members]
    with EtcdClient.from_config(cfg, timeout=timeout) as client:

        def probe(row: MemberStatus) -> MemberStatus:
            try:
                st = client.status(row.endpoint, timeout=timeout)
            except EtcdError as exc:
                row.errors.append(exc.message)
                return row
            row.reachable = True
            row.id = f"{st.member_id:x}"
            row.version = st.version
            row.db_size = st.db_size
            row.db_size_in_use = st.db_size_in_use or None
            row.leader = st.is_leader
            row.learner = st.is_learner
            row.raft_term = st.raft_term
            row.raft_index = st.raft_index
            row.revision = st.revision
            row.errors.extend(st.errors)
            ok, why = client.healthy(row.endpoint, timeout=timeout)
            row.healthy = ok
            if not ok and why:
                row.errors.append(f"unhealthy: {why}")
            return row

        with ThreadPoolExecutor(max_workers=max(1, len(rows))) as pool:
            rows = list(pool.map(probe, rows))
        members: List[MemberInfo] = []
        try:
            members = client.members()
        except EtcdError:
            pass
    by_id = {r.id: r for r in rows if r.id}
    configured_peers = {m.peer_url for m in cfg.members}
    for m in members:
        if m.hex_id in by_id:
            continue
        if not set(m.peer_urls) & configured_peers:
            rows.append(
                MemberStatus(
                    name=m.name or "(unstarted)",
                    endpoint=",".join(m.client_urls) or "-",
                    id=m.hex_id,
                    learner=m.is_learner,
                    errors=["member of the cluster but not in the config"],
                )
            )
        elif not m.started:
            for r in rows:
                if r.name and not r.reachable and set(m.peer_urls) & {cfg.member(r.name).peer_url}:
                    r.id = m.hex_id
                    r.errors.append("added to the cluster but never started")
    if members:  # duplicates, name mismatches, drifted etcd.conf (see drift.py)
        from etcd_agent.cluster.drift import flag_rows

        flag_rows(cfg, rows, members)
    return rows


def human_size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def format_table(rows: List[MemberStatus]) -> str:
    head = ["NAME", "ID", "ENDPOINT", "VERSION", "DB SIZE", "LEADER", "LEARNER", "RAFT TERM", "RAFT INDEX", "ERRORS"]

    def yn(v: Optional[bool]) -> str:
        return "-" if v is None else ("true" if v else "false")

    body = [
        [
            r.name,
            r.id or "-",
            r.endpoint,
            r.version or "-",
            human_size(r.db_size),
            yn(r.leader),
            yn(r.learner),
            "-" if r.raft_term is None else str(r.raft_term),
            "-" if r.raft_index is None else str(r.raft_index),
            "; ".join(r.errors) if r.errors else "",
        ]
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    widths[-1] = 0  # last column is free text
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + body]
    return "\n".join(lines)
