"""The agent's configuration: ``load`` a TOML file into a frozen, validated ``Config``.

``model`` holds the typed sections, ``load`` reads (regular files only, bounded), parses and builds
them, ``validation`` checks a built config (every problem at once), ``security`` warns about files
that expose secrets, ``sample`` is the commented default. Importers use this package.
"""
from etcd_agent.config.load import load, parse_text
from etcd_agent.config.model import (
    ADDRESSING_STYLES,
    BOOTSTRAP_MODES,
    BUCKET_RE,
    COMPRESSIONS,
    DEFAULT_PATH,
    FENCE_METHODS,
    HOSTNAME_RE,
    NAME_RE,
    PATH_RE,
    POINT_IN_TIME_LOADS,
    PREFIX_RE,
    REMOTE_VERIFY_MODES,
    SECTIONS,
    SERVICE_MANAGERS,
    UNIT_RE,
    BackupSection,
    ClusterSection,
    Config,
    DaemonSection,
    DeltaSection,
    DrillSection,
    EtcdSection,
    KubernetesSection,
    LocalSection,
    MaintenanceSection,
    Member,
    MemberSection,
    RemoteSection,
    SshSection,
    TlsSection,
    merged,
    with_local,
)
from etcd_agent.config.security import security_warnings

__all__ = [
    "ADDRESSING_STYLES", "BOOTSTRAP_MODES", "BUCKET_RE", "COMPRESSIONS", "DEFAULT_PATH", "FENCE_METHODS",
    "POINT_IN_TIME_LOADS", "HOSTNAME_RE", "NAME_RE", "PATH_RE", "PREFIX_RE", "REMOTE_VERIFY_MODES", "SECTIONS", "SERVICE_MANAGERS",
    "UNIT_RE", "BackupSection", "ClusterSection", "Config", "DaemonSection", "DeltaSection", "DrillSection",
    "EtcdSection", "KubernetesSection", "LocalSection", "MaintenanceSection", "Member", "MemberSection",
    "RemoteSection", "SshSection", "TlsSection",
    "load", "merged", "parse_text", "security_warnings", "with_local",
]
