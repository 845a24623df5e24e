"""Pure cluster topology: initial-cluster strings, bootstrap plans, etcd.conf and etcd.service text.

No I/O here. The same rendering feeds the systemd backend (EnvironmentFile=) and the process
backend (which reads the file back into the environment of the etcd it starts), so both run
etcd from the identical ``ETCD_*`` variables.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple
from urllib.parse import urlsplit

from etcd_agent.config import Config, Member

NEW = "new"
EXISTING = "existing"


def initial_cluster(pairs: Iterable[Tuple[str, str]]) -> str:
    """``name=peer_url,...`` in the given order."""
    return ",".join(f"{name}={url}" for name, url in pairs)


def member_pairs(members: Iterable[Member]) -> List[Tuple[str, str]]:
    return [(m.name, m.peer_url) for m in members]


@dataclass(frozen=True)
class Bootstrap:
    """How one member starts: the cluster it believes in and whether it creates or joins it."""

    member: str
    state: str
    initial_cluster: str
    token: str


def static_bootstrap(cfg: Config, member: Member) -> Bootstrap:
    """Static: every member known up front, all start with state=new and the same token."""
    return Bootstrap(member.name, NEW, initial_cluster(member_pairs(cfg.members)), cfg.cluster.token)


def seed_bootstrap(cfg: Config, member: Member) -> Bootstrap:
    """Incremental, first member: the seed creates a one-member cluster."""
    return Bootstrap(member.name, NEW, initial_cluster([(member.name, member.peer_url)]), cfg.cluster.token)


def join_bootstrap(cfg: Config, member: Member, existing: Sequence[Tuple[str, str]]) -> Bootstrap:
    """Incremental, later member: the members that exist at its join plus itself, state=existing.

    ``existing`` are (name, peer URL) pairs from etcd's member list; a member added but not yet
    started has no name, so the pair of the joining member itself is put in by name here.
    """
    pairs = [(n, u) for n, u in existing if u != member.peer_url and n != member.name]
    pairs.append((member.name, member.peer_url))
    return Bootstrap(member.name, EXISTING, initial_cluster(pairs), cfg.cluster.token)


def incremental_walk(cfg: Config) -> List[Bootstrap]:
    """The whole incremental bootstrap in config order: seed, then one join at a time.

    This is the documented infra0/infra1/infra2 walk-through: infra1 joins with
    ``infra0,infra1`` and state=existing, infra2 with all three.
    """
    out = []
    for i, m in enumerate(cfg.members):
        if i == 0:
            out.append(seed_bootstrap(cfg, m))
        else:
            out.append(join_bootstrap(cfg, m, member_pairs(cfg.members[:i])))
    return out


def _loopback_url(url: str) -> str:
    p = urlsplit(url)
    return f"{p.scheme}://127.0.0.1:{p.port}"


def listen_client_urls(member: Member) -> List[str]:
    """Client URL plus loopback (local etcdctl and the agent use 127.0.0.1)."""
    urls = [member.client_url]
    host = urlsplit(member.client_url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        urls.append(_loopback_url(member.client_url))
    return urls


def conf_vars(cfg: Config, member: Member, boot: Bootstrap) -> Dict[str, str]:
    """The ``ETCD_*`` variables of one member, in file order."""
    v: Dict[str, str] = {
        "ETCD_NAME": member.name,
        "ETCD_DATA_DIR": cfg.data_dir(member.name),
        "ETCD_LISTEN_PEER_URLS": member.peer_url,
        "ETCD_LISTEN_CLIENT_URLS": ",".join(listen_client_urls(member)),
        "ETCD_INITIAL_ADVERTISE_PEER_URLS": member.peer_url,
        "ETCD_ADVERTISE_CLIENT_URLS": member.client_url,
        "ETCD_INITIAL_CLUSTER": boot.initial_cluster,
        "ETCD_INITIAL_CLUSTER_STATE": boot.state,
        "ETCD_INITIAL_CLUSTER_TOKEN": boot.token,
    }
    t = cfg.tls
    if t.client_enabled:
        v.update(
            ETCD_CERT_FILE=t.client_cert or "",
            ETCD_KEY_FILE=t.client_key or "",
            ETCD_TRUSTED_CA_FILE=t.client_ca or "",
            ETCD_CLIENT_CERT_AUTH="true" if t.client_cert_auth else "false",
        )
    if t.peer_enabled:
        v.update(
            ETCD_PEER_CERT_FILE=t.peer_cert or "",
            ETCD_PEER_KEY_FILE=t.peer_key or "",
            ETCD_PEER_TRUSTED_CA_FILE=t.peer_ca or "",
            ETCD_PEER_CLIENT_CERT_AUTH="true" if t.peer_client_cert_auth else "false",
        )
    return v


def render_conf(cfg: Config, member: Member, boot: Bootstrap) -> str:
    """``/etc/etcd/etcd.conf`` as an EnvironmentFile (values are validated: no quoting needed)."""
    lines = [
        f"# etcd.conf for member {member.name} of cluster {cfg.cluster.name}.",
        "# Rendered by etcd-agent from its config: edit /etc/etcd-agent/agent.toml, not this file.",
    ]
    lines += [f"{k}={val}" for k, val in conf_vars(cfg, member, boot).items()]
    return "\n".join(lines) + "\n"


def parse_conf(text: str) -> Dict[str, str]:
    """Read an EnvironmentFile back (``KEY=value``, optional quotes, comments ignored)."""
    out: Dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, val = line.split("=", 1)
        key = key.strip()
        if key.startswith("export "):
            key = key[len("export "):].strip()
        val = val.strip()
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "\"'":
            val = val[1:-1]
        out[key] = val
    return out


def render_unit(cfg: Config, member: Member, binary: str) -> str:
    """The etcd.service unit: notify type, runs as the etcd user, restarts on failure.

    ``binary`` is what ExecStart= runs: after a rolling upgrade that is the member's pinned release,
    which the caller reads at render time (``state.pins``), so a caller holding a config from before
    the upgrade never points the unit back at the old release.
    """
    conf = cfg.conf_file(member.name)
    return f"""\
# etcd.service rendered by etcd-agent; edit /etc/etcd-agent/agent.toml, not this file.
[Unit]
Description=etcd key-value store (member managed by etcd-agent)
Documentation=https://etcd.io/docs/
After=network-online.target
Wants=network-online.target

[Service]
Type=notify
User={cfg.etcd.user}
Group={cfg.etcd.group}
EnvironmentFile={conf}
ExecStart={binary}
Restart=on-failure
RestartSec=5s
# a member of a new cluster reports ready only once a quorum is up: allow for the others
TimeoutStartSec=300
LimitNOFILE=65536
# etcd is latency-sensitive: disk I/O and CPU ahead of batch work on the master
IOSchedulingClass=best-effort
IOSchedulingPriority=0
Nice=-10

[Install]
WantedBy=multi-user.target
"""
