"""The typed, frozen configuration: one dataclass per TOML section, and the patterns values obey.

Nothing here parses or validates (``load`` and ``validation`` do); the rest of the agent only ever
sees a ``Config`` that passed both.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from etcd_agent.errors import ConfigError

DEFAULT_PATH = "/etc/etcd-agent/agent.toml"

# Names end up in etcd flags, file names and systemd text: keep them boring.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# A DNS host name (RFC 1123 labels); IP literals are checked separately.
HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
# Absolute paths without characters that would need quoting in an EnvironmentFile or unit.
PATH_RE = re.compile(r"^/[A-Za-z0-9_.,+@%/{}-]*$")
UNIT_RE = re.compile(r"^[A-Za-z0-9_.@-]+\.service$")

BOOTSTRAP_MODES = ("static", "incremental")
SERVICE_MANAGERS = ("systemd", "process")
COMPRESSIONS = ("none", "zstd", "gzip")  # zstd recommended; gzip spools the snapshot first
FENCE_METHODS = ("none", "unit", "manifest")
# how a point-in-time restore gets from its start snapshot to the target: "scratch" replays the
# chain in a throwaway member and restores its saved db; "members" restores the start snapshot and
# writes the chain into the restored cluster before its apiservers start; "auto": "members" when
# [kubernetes] fence stops the apiservers, else "scratch" (nothing to keep clients out meanwhile).
# The default is "scratch": measured equal in wall time (bench/pitr_bench.py, 2026-12-08), and its
# replay runs before the fence, so the apiservers are down for less (docs/delta-segments.md)
POINT_IN_TIME_LOADS = ("auto", "members", "scratch")
SSH_STREAMS = ("auto", "openssh", "paramiko")  # what carries a restore's snapshot (ssh.stream)
ADDRESSING_STYLES = ("auto", "path", "virtual")
REMOTE_VERIFY_MODES = ("auto", "checksum", "etag", "download")
BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")
# Object key prefix: plain characters only; ``{cluster}`` is replaced by cluster.name.
PREFIX_RE = re.compile(r"^[A-Za-z0-9_.,+@%/{}=-]*$")


@dataclass(frozen=True)
class ClusterSection:
    name: str = "etcd"
    token: str = "etcd-cluster"
    bootstrap: str = "static"
    # joins (daemon and `etcd-agent join`) add the member as a non-voting learner and promote it
    # once it has caught up: a slow catch-up never counts against quorum
    learner_joins: bool = False


@dataclass(frozen=True)
class MemberSection:
    name: str
    host: str
    client_url: Optional[str] = None
    peer_url: Optional[str] = None
    ssh_host: Optional[str] = None


@dataclass(frozen=True)
class LocalSection:
    name: Optional[str] = None


@dataclass(frozen=True)
class EtcdSection:
    binary: str = "/usr/bin/etcd"
    etcdctl: str = "/usr/bin/etcdctl"
    etcdutl: Optional[str] = None
    # ``{name}`` in data_dir and conf_file is replaced by the member's name (one-host clusters).
    data_dir: str = "/var/lib/etcd/default.etcd"
    conf_file: str = "/etc/etcd/etcd.conf"
    unit: str = "etcd.service"
    unit_file: str = "/etc/systemd/system/etcd.service"
    user: str = "etcd"
    group: str = "etcd"
    service_manager: str = "systemd"
    # process backend only: where pid files and logs of the supervised etcd go
    run_dir: str = "/run/etcd-agent"
    client_port: int = 2379
    peer_port: int = 2380
    start_timeout: float = 60.0
    # etcd releases side by side, one dir per version: <versions_dir>/<version>/{etcd,etcdctl,etcdutl}
    versions_dir: str = "/opt/etcd"


@dataclass(frozen=True)
class TlsSection:
    client_ca: Optional[str] = None
    client_cert: Optional[str] = None
    client_key: Optional[str] = None
    client_cert_auth: bool = True
    peer_ca: Optional[str] = None
    peer_cert: Optional[str] = None
    peer_key: Optional[str] = None
    peer_client_cert_auth: bool = True

    @property
    def client_enabled(self) -> bool:
        return bool(self.client_cert or self.client_key or self.client_ca)

    @property
    def peer_enabled(self) -> bool:
        return bool(self.peer_cert or self.peer_key or self.peer_ca)


@dataclass(frozen=True)
class RemoteSection:
    """``[backup.remote]``: off-host copies in an S3-compatible bucket (AWS, MinIO, Ceph RGW, OSS)."""

    enabled: bool = False
    # scheme://host[:port]; None = the AWS endpoint of ``region``
    endpoint: Optional[str] = None
    bucket: str = ""
    # {cluster} and {host} are expanded: one folder per master, so copies never collide
    prefix: str = "etcd-backup/{cluster}/{host}/"
    region: str = "us-east-1"
    # Inline keys or an AWS-style credentials file (INI, mode 0600); neither = boto3's default chain.
    access_key: Optional[str] = field(default=None, repr=False)
    secret_key: Optional[str] = field(default=None, repr=False)
    credentials_file: Optional[str] = None
    credentials_profile: str = "default"
    verify_tls: bool = True
    ca_bundle: Optional[str] = None
    # "path" for MinIO / Ceph RGW, "virtual" for Aliyun OSS and AWS
    addressing_style: str = "auto"
    # what proves a copy, found once per endpoint by a probe (a wrong value refused is the only
    # proof a store checks it): auto = the strongest the store enforces (SHA-256 checksums, else
    # Content-MD5 per part and the MD5 ETag, else a read-back); checksum = SHA-256 or the copy
    # fails (a store that accepts a wrong one, e.g. Ceph RGW 16, is refused: never a silent
    # downgrade); etag = Content-MD5 and the ETag; download = stream the object back and hash it
    verify: str = "auto"
    part_size_mb: int = 8  # boto3's own: parts sent 4 at once hold 40 MiB
    # seconds, not minutes: a hung gateway (accepts, never answers) fails a request within
    # max_attempts x (connect_timeout + read_timeout + 1 s) plus botocore's backoff, < 60 s by default
    connect_timeout: float = 5.0
    read_timeout: float = 10.0
    max_attempts: int = 3
    # one object's upload, download or check, retries included, ends after this many seconds
    # plus one per MiB of the object (a floor rate of 1 MiB/s)
    deadline: float = 120.0
    keep_last: int = 7
    keep_hourly: int = 0
    keep_daily: int = 30


@dataclass(frozen=True)
class DeltaSection:
    """``[backup.delta]``: continuous backup. The daemon watches its member from the newest full
    backup on this host and writes every change into delta segments beside the full backups, so
    a point-in-time restore (``restore --to-time``) loses seconds, not the time since the last
    full backup. On by default: it costs a few % of a core and a few MB/s of disk at Kubernetes
    write rates, and an operator who runs the daemon expects the newest data to be restorable."""

    enabled: bool = True
    # a segment that holds events is closed (fsynced, visible, uploaded) this often: what a host
    # lost at once can cost at most, on top of the watch's own latency
    close_seconds: float = 5.0
    close_bytes: int = 4 * 1024 * 1024
    # the watch is read in batches this often: a short watch from the revision after the last one
    # captured, read until it has delivered the member's revision, then canceled. etcd then sends
    # up to 1000 revisions a message instead of one message a revision, which was ~95 % of the
    # watch's CPU (docs/delta-segments.md). A revision's recorded time is when its batch arrived:
    # `--to-time` is exact to this much (`--to-revision` always). 0: one streaming watch.
    batch_seconds: float = 1.0
    # with no events, an empty segment this often (time coverage and lease TTLs keep moving)
    idle_seconds: float = 60.0
    # bounds of one chain: past any of them the daemon takes a full backup and starts a new chain,
    # so a restore never replays more (events replay at ~100,000/s: 600000 is about 6 s)
    max_chain_events: int = 600_000
    max_chain_bytes: int = 1024 * 1024 * 1024
    max_chain_segments: int = 1000
    # checkpoints: a full backup taken inside the running chain (the chain goes on) once the chain
    # since the last one - or since its full backup - holds checkpoint_ratio times the newest full
    # backup's size. A point-in-time restore starts from the newest checkpoint the chain vouches
    # for before its target and replays only what follows, so its time does not grow with the
    # chain; each costs one full backup's I/O, so they come at the chain's own pace (at most one
    # every checkpoint_min_seconds). 0: none.
    checkpoint_ratio: float = 0.5
    checkpoint_min_seconds: float = 60.0
    checkpoint_keep: int = 2  # the newest of each chain kept (they take no retention slot)
    # a checkpoint's snapshot defragmented offline before it is archived (staged under [daemon]
    # state_dir): a replay starts from the data, not from the live db's free pages; false: the
    # snapshot as etcd streams it, as every other backup
    lean_checkpoints: bool = True
    # a point-in-time restore's way to the target (POINT_IN_TIME_LOADS; docs/delta-segments.md,
    # "The tail loaded into the restored members")
    point_in_time_load: str = "scratch"
    # the member unwatchable this long: the chain is broken (a full backup once it is back)
    max_outage: float = 300.0
    # node_exporter textfile of the delta metrics; None: beside [backup] metrics_file, named
    # etcd_agent_delta.prom (none when that is unset too)
    metrics_file: Optional[str] = None


@dataclass(frozen=True)
class BackupSection:
    dir: str = "/var/lib/etcd_backup"
    keep_last: int = 7
    keep_hourly: int = 24
    keep_daily: int = 7
    compression: str = "none"
    utc: bool = True
    # free space required beyond the expected archive size, as a fraction of it
    space_margin: float = 0.2
    # node_exporter textfile; None = no metrics (e.g.
    # /var/lib/node_exporter/textfile_collector/etcd_agent_backup.prom)
    metrics_file: Optional[str] = None
    # age recipients (age1..., public keys): the snapshot is encrypted to them as it streams, so
    # the masters never hold the key that decrypts; empty = not encrypted
    encrypt_to: Tuple[str, ...] = ()
    # the manifest key's file; None = manifest.key beside the config. A restore on new hosts
    # (`restore --from-bucket --key-file`) points it at the copy the operator kept off-host
    manifest_key: Optional[str] = None
    remote: RemoteSection = field(default_factory=RemoteSection)
    delta: DeltaSection = field(default_factory=DeltaSection)


@dataclass(frozen=True)
class SshSection:
    user: str = "root"
    port: int = 22
    identity_file: Optional[str] = None
    known_hosts: str = "/etc/etcd-agent/known_hosts"
    connect_timeout: float = 10.0
    command_timeout: float = 600.0
    # where the agent is installed on the other masters
    agent_path: str = "/usr/bin/etcd-agent"
    # what carries a restore's snapshot to the other masters: "openssh" (the ssh client, its
    # ciphers in C on a core of its own), "paramiko" (a channel of the agent's own connection),
    # or "auto" (openssh when an ssh client is installed). Both trust only known_hosts.
    stream: str = "auto"


@dataclass(frozen=True)
class KubernetesSection:
    fence: str = "none"
    apiserver_unit: str = "kube-apiserver.service"
    manifest: str = "/etc/kubernetes/manifests/kube-apiserver.yaml"
    manifest_aside_dir: str = "/etc/kubernetes/manifests-aside"
    # each master's apiserver readiness endpoint; {host} is the member's host. Set, the restore
    # unfences the apiservers one at a time, each after the one before answers 200 here.
    readyz_url: Optional[str] = None
    readyz_ca: Optional[str] = None  # CA of the apiserver's serving certificate (kubeadm: /etc/kubernetes/pki/ca.crt)
    readyz_timeout: float = 180.0
    # the etcd prefix the apiservers store their objects under (--etcd-prefix)
    etcd_prefix: str = "/registry"
    # after a restore (and `k8s cleanup`): drop the controller-manager and scheduler leader leases
    # too, so new leaders are chosen at once instead of when the restored leases time out
    drop_leader_leases: bool = False


@dataclass(frozen=True)
class DaemonSection:
    interval: float = 10.0
    lock_ttl: int = 60
    # what the agent remembers between runs (e.g. that this host has bootstrapped a member)
    state_dir: str = "/var/lib/etcd-agent"
    metrics_address: Optional[str] = None


@dataclass(frozen=True)
class MaintenanceSection:
    """``[maintenance]``: defragmentation and alarm handling (``etcd-agent defrag`` / ``alarms``)."""

    # defragment a member when 1 - db_size_in_use/db_size exceeds this percentage
    defrag_threshold_percent: float = 50.0
    # ... and its db is at least this big (defragmenting a tiny db is pointless churn)
    defrag_min_db_bytes: int = 16 * 1024 * 1024
    # the daemon defragments on its own when true; otherwise only the command does
    auto_defrag: bool = False
    # the daemon clears a NOSPACE alarm (compact, defrag, disarm) on its own when true
    auto_disarm_nospace: bool = False
    defrag_timeout: float = 600.0


@dataclass(frozen=True)
class DrillSection:
    """``[drill]``: restore drills - a backup restored into a throwaway single-member etcd on
    loopback (its own ports and dir, as ``[etcd] user``, at low priority), checked, removed."""

    # the daemon drills the newest good backup this often, one master of the cluster at a time
    # (an etcd lock and a record in etcd); 0 = the daemon never drills (`etcd-agent drill` still does)
    every: float = 0.0
    # the throwaway member's parent dir: created 0711 so the etcd user can reach its own 0700 dir
    dir: str = "/var/lib/etcd-agent-drill"
    # who the throwaway etcd runs as (when the agent is root and the user exists); "" = [etcd] user
    user: str = ""
    nice: int = 10  # CPU priority of the drill and its etcd (0-19)
    ionice: str = "idle"  # "idle", "best-effort:N" (N 0-7) or "none"
    gomaxprocs: int = 1  # cores the throwaway etcd may use; 0 = Go's default (all)
    sample_keys: int = 100  # keys read back through the restored member and compared with the snapshot
    timeout: float = 1800.0  # a drill that takes longer fails (and bounds the lock's lease)
    # node_exporter textfile; None = none (e.g. /var/lib/node_exporter/textfile_collector/etcd_agent_drill.prom)
    metrics_file: Optional[str] = None


IONICE_RE = re.compile(r"^(idle|none|best-effort:[0-7])$")


@dataclass(frozen=True)
class Member:
    """A member with every URL resolved."""

    name: str
    host: str
    client_url: str
    peer_url: str
    ssh_host: str


@dataclass(frozen=True)
class Config:
    cluster: ClusterSection
    members: Tuple[Member, ...]
    local: LocalSection = field(default_factory=LocalSection)
    etcd: EtcdSection = field(default_factory=EtcdSection)
    tls: TlsSection = field(default_factory=TlsSection)
    backup: BackupSection = field(default_factory=BackupSection)
    ssh: SshSection = field(default_factory=SshSection)
    kubernetes: KubernetesSection = field(default_factory=KubernetesSection)
    daemon: DaemonSection = field(default_factory=DaemonSection)
    maintenance: MaintenanceSection = field(default_factory=MaintenanceSection)
    drill: DrillSection = field(default_factory=DrillSection)
    path: Optional[str] = None

    def member(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise ConfigError(f"no member named {name!r} in the config")

    def data_dir(self, member: str) -> str:
        return self.etcd.data_dir.replace("{name}", member)

    def conf_file(self, member: str) -> str:
        return self.etcd.conf_file.replace("{name}", member)

    @property
    def client_urls(self) -> List[str]:
        return [m.client_url for m in self.members]


SECTIONS: Dict[str, type] = {
    "cluster": ClusterSection,
    "local": LocalSection,
    "etcd": EtcdSection,
    "tls": TlsSection,
    "backup": BackupSection,
    "ssh": SshSection,
    "kubernetes": KubernetesSection,
    "daemon": DaemonSection,
    "maintenance": MaintenanceSection,
    "drill": DrillSection,
}


def with_local(cfg: Config, name: str) -> Config:
    """The same config with ``[local] name`` set (the demo and tests run several members per host)."""
    cfg.member(name)
    return dataclasses.replace(cfg, local=LocalSection(name=name))


def merged(cfg: Config, **sections: Mapping[str, Any]) -> Config:
    """The same config with some section fields replaced (e.g. ``etcd={'binary': ...}``)."""
    repl = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()}
    return dataclasses.replace(cfg, **repl)
