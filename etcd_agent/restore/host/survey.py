"""What a host finds when it looks at one of its members, read-only: the pre-check's facts
(``node precheck``, judged by the orchestrator) and, after the start, whether the etcd serving
the member is the restored one. Nothing here changes anything on the host."""
from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from etcd_agent import __version__
from etcd_agent.config import Config
from etcd_agent.errors import AgentError, OperationFailed
from etcd_agent.etcd.tools import cached_version
from etcd_agent.hosts.base import Host
from etcd_agent.locality import machine_identity
from etcd_agent.member import serving
from etcd_agent.member.dblock import db_path
from etcd_agent.node import replies as R
from etcd_agent.restore.host.conf import restored_cluster_id
from etcd_agent.restore.host.facts import NODE_PROTOCOL, NodeFacts
from etcd_agent.state import bootstrap, lineage

if TYPE_CHECKING:
    from etcd_agent.restore.host.node import NodeRestore


def facts(node: NodeRestore) -> NodeFacts:
    """What this host reports about ``node``'s member before a restore (``node precheck``)."""
    cfg, m = node.cfg, node.member
    versions = tool_versions(cfg, node.host)
    state = data_dir_state(node.data_dir)
    running, foreign = serving_state(node)
    fence_ok, fence_detail = fence_possible(cfg, node.host)
    rec = bootstrap.read(cfg, m.name)
    db_ids, db_note = db_member_ids(node.data_dir) if state == "member" else ((), "")
    j = node.journal()
    return NodeFacts(
        member=m.name, protocol=NODE_PROTOCOL, agent_version=__version__,
        etcd_version=versions["etcd"], etcdctl_version=versions["etcdctl"], etcdutl_version=versions["etcdutl"],
        free_bytes=shutil.disk_usage(existing_parent(node.data_dir)).free, data_dir=node.data_dir,
        data_dir_state=state, work_dir=node.work_dir, conf_file=cfg.conf_file(m.name),
        conf_present=os.path.isfile(cfg.conf_file(m.name)), unit_present=unit_present(cfg),
        backend=cfg.etcd.service_manager, running=running, fence_ok=fence_ok, fence_detail=fence_detail,
        identity_match=machine_identity().is_me(m.host), tls_missing=tls_missing(cfg),
        journal=j.summary() if j is not None else None, peer_url=m.peer_url, client_url=m.client_url,
        bootstrap_member_id=rec.member_id if rec else None, bootstrap_cluster_id=rec.cluster_id if rec else None,
        lineage=tuple(tuple(sorted(s)) for s in lineage.read(cfg)),
        db_member_ids=db_ids, db_note=db_note,
        etcdctl_path=cfg.etcd.etcdctl, etcdutl_path=cfg.etcd.etcdutl,
        foreign=foreign,
    )


def tool_versions(cfg: Config, host: Host) -> Dict[str, Optional[str]]:
    """The versions of the member's etcd, etcdctl and etcdutl (three binaries started at once)."""
    tools = (("etcd", cfg.etcd.binary), ("etcdctl", cfg.etcd.etcdctl), ("etcdutl", cfg.etcd.etcdutl))
    with ThreadPoolExecutor(max_workers=len(tools)) as ex:
        found = ex.map(lambda kb: cached_version(host, kb[1]), tools)
        return dict(zip((key for key, _b in tools), found))


def existing_parent(data_dir: str) -> str:
    """The nearest existing directory above ``data_dir``: where its free space is measured."""
    probe = os.path.dirname(data_dir) or "/"
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    return probe


def data_dir_state(data_dir: str) -> str:
    """absent | other (not a plain directory) | member (holds etcd's data) | empty."""
    if not os.path.lexists(data_dir):
        return "absent"
    if not os.path.isdir(data_dir) or os.path.islink(data_dir):
        return "other"
    if os.path.isdir(os.path.join(data_dir, "member")):
        return "member"
    return "empty"


def serving_state(node: NodeRestore) -> Tuple[bool, Tuple[str, ...]]:
    """Whether an etcd of ours serves the member, and why each process serving it that this agent
    did not start stops a restore."""
    try:
        running = node.backend.is_active()
    except AgentError:
        running = False
    try:
        servers = node.servers()
    except (OSError, AgentError) as exc:
        return running, (f"the processes serving it cannot be listed ({getattr(exc, 'message', exc)}): "
                         "whether its data dir is in use cannot be told",)
    foreign = tuple(serving.refusal(s, node.backend.kind) for s in servers if not s.ours)
    return running or any(s.ours for s in servers), foreign  # an etcd of ours whose pid file is gone


def unit_present(cfg: Config) -> Optional[bool]:
    """Whether etcd's unit file exists; None for the process backend, which has none."""
    return os.path.isfile(cfg.etcd.unit_file) if cfg.etcd.service_manager == "systemd" else None


def tls_missing(cfg: Config) -> Tuple[str, ...]:
    """The TLS files the config names that are not on this host."""
    t = cfg.tls
    named = (t.client_ca, t.client_cert, t.client_key, t.peer_ca, t.peer_cert, t.peer_key)
    return tuple(p for p in named if p and not os.path.isfile(p))


def db_member_ids(data_dir: str) -> Tuple[Tuple[str, ...], str]:
    """The member ids in this data dir's own db: which cluster this host runs, readable with
    etcd down (evidence for whose backup may be restored here)."""
    from etcd_agent.etcd.snapdb import read_identity

    db = db_path(data_dir)
    try:
        return tuple(f"{x:x}" for x in read_identity(db).member_ids), ""
    except FileNotFoundError:
        return (), ""
    except (AgentError, OSError, ValueError) as exc:
        return (), f"{db} could not be read ({getattr(exc, 'message', None) or exc})"


def fence_possible(cfg: Config, host: Host) -> Tuple[bool, str]:
    k = cfg.kubernetes
    if k.fence == "none":
        return True, "no fencing configured"
    if k.fence == "unit":
        res = host.run(["systemctl", "show", k.apiserver_unit, "-p", "LoadState"], timeout=30, check=False)
        if res.ok and "LoadState=loaded" in res.stdout:
            return True, f"{k.apiserver_unit} is loaded"
        return False, f"{k.apiserver_unit} is not a loaded unit ({(res.stdout or res.stderr).strip()[:120]})"
    aside = os.path.join(k.manifest_aside_dir, os.path.basename(k.manifest))
    if os.path.isfile(k.manifest) or os.path.isfile(aside):
        return True, f"{k.manifest} can be moved to {k.manifest_aside_dir}"
    return False, f"neither {k.manifest} nor {aside} exists"


def restored_serving(node: NodeRestore, min_revision: Optional[int]) -> R.ServingReply:
    """After the start (and the cluster's convergence): ``node``'s member is served by the etcd its
    backend just started, alone, from the restored data dir, answering for the restored cluster at
    a revision of at least ``min_revision`` (the snapshot's, bumped). Else the restore fails and
    rolls back: an old etcd still answering is no restore."""
    from etcd_agent.etcd.client import EtcdClient

    j, name = node.mine(), node.member.name
    me = serving.served_by(node.spots, node.backend.kind, node.backend.pid())
    want = restored_cluster_id(j.initial_cluster, j.token)
    url = node.member.client_url
    with EtcdClient.from_config(node.cfg, timeout=5.0) as c:
        st = c.status(url)
    if st.cluster_id != want:
        raise OperationFailed(f"{name}: {url} (pid {me.pid}) answers for cluster {st.cluster_id:x}, "
                              f"not the restored cluster {want:x}")
    if min_revision is not None and st.revision < min_revision:
        raise OperationFailed(f"{name}: {url} (pid {me.pid}) is at revision {st.revision}, below the "
                              f"snapshot's bumped revision {min_revision}")
    return R.ServingReply(step="serving", member=name, pid=me.pid, cluster_id=f"{want:x}", revision=st.revision)
