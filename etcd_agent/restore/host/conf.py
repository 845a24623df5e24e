"""A restored member's configuration: the ``ETCD_*`` values a restore rewrites in ``etcd.conf`` and
the cluster id the restored members will report (etcd derives it from the peer URLs and token).

Both halves use these: the orchestrator to plan and to judge what the hosts report, each host to
rewrite its own file and to check what it serves.
"""
from __future__ import annotations

from typing import Dict, List, Mapping

from etcd_agent.config import Config, Member
from etcd_agent.etcd.snapvalues import cluster_id_from, member_id_from
from etcd_agent.topology import Bootstrap, conf_vars

# ETCD_* keys that carry a member's identity or the cluster it believes in: rewritten on repair.
REWRITE_KEYS = (
    "ETCD_NAME",
    "ETCD_DATA_DIR",
    "ETCD_LISTEN_PEER_URLS",
    "ETCD_LISTEN_CLIENT_URLS",
    "ETCD_INITIAL_ADVERTISE_PEER_URLS",
    "ETCD_ADVERTISE_CLIENT_URLS",
    "ETCD_INITIAL_CLUSTER",
    "ETCD_INITIAL_CLUSTER_STATE",
    "ETCD_INITIAL_CLUSTER_TOKEN",
)


def restored_cluster_id(initial_cluster: str, token: str) -> int:
    """The cluster id ``snapshot restore`` gives the members of ``initial_cluster`` with ``token``
    (etcd derives each member id from its peer URLs and the token, the cluster id from those):
    what a member answers once it serves the restored data, and an old etcd never does."""
    urls: Dict[str, List[str]] = {}
    for pair in initial_cluster.split(","):
        name, _, url = pair.partition("=")
        urls.setdefault(name, []).append(url)
    return cluster_id_from([member_id_from(u, token) for u in urls.values()])


def rewrite_conf(text: str, values: Mapping[str, str]) -> str:
    """``text`` (an EnvironmentFile) with the given keys set to ``values``; other lines (tuning,
    comments) kept as they are; keys not present are appended."""
    out: List[str] = []
    done = set()
    for raw in text.splitlines():
        line = raw.strip()
        key = line.split("=", 1)[0].strip() if "=" in line and not line.startswith(("#", ";")) else ""
        if key.startswith("export "):
            key = key[len("export "):].strip()
        if key in values:
            if key not in done:
                out.append(f"{key}={values[key]}")
                done.add(key)
            continue  # a duplicate assignment would override ours: drop it
        out.append(raw)
    missing = [k for k in values if k not in done]
    if missing:
        out.append("# set by etcd-agent restore")
        out += [f"{k}={values[k]}" for k in missing]
    return "\n".join(out) + "\n"


def restore_conf_values(cfg: Config, member: Member, boot: Bootstrap) -> Dict[str, str]:
    """The ETCD_* identity values of ``member`` in the restored cluster (plus TLS files)."""
    v = conf_vars(cfg, member, boot)
    return {k: val for k, val in v.items() if k in REWRITE_KEYS or k.endswith(("_FILE", "_AUTH"))}
