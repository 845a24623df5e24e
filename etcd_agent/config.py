"""Typed, frozen configuration loaded from TOML.

``load()`` parses and validates once and reports *every* problem in one ``ConfigError``; the rest
of the agent only ever sees a valid ``Config``. Nothing here falls back silently: an unknown key or
a wrong type is an error, not a default.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple
from urllib.parse import urlsplit

from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.9
    import tomli as tomllib

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
COMPRESSIONS = ("none", "gzip", "zstd")
FENCE_METHODS = ("none", "unit", "manifest")
ADDRESSING_STYLES = ("auto", "path", "virtual")
REMOTE_VERIFY_MODES = ("checksum", "etag", "download")
BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")
# Object key prefix: plain characters only; ``{cluster}`` is replaced by cluster.name.
PREFIX_RE = re.compile(r"^[A-Za-z0-9_.,+@%/{}=-]*$")


@dataclass(frozen=True)
class ClusterSection:
    name: str = "etcd"
    token: str = "etcd-cluster"
    bootstrap: str = "static"


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
    prefix: str = "etcd-backup/{cluster}/"
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
    # checksum: SHA-256 sent with every part and read back; etag: MD5 ETag (servers without
    # x-amz-checksum, e.g. OSS); download: stream the object back and hash it
    verify: str = "checksum"
    part_size_mb: int = 16
    connect_timeout: float = 10.0
    read_timeout: float = 120.0
    keep_last: int = 7
    keep_hourly: int = 0
    keep_daily: int = 30


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
    remote: RemoteSection = field(default_factory=RemoteSection)


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


@dataclass(frozen=True)
class KubernetesSection:
    fence: str = "none"
    apiserver_unit: str = "kube-apiserver.service"
    manifest: str = "/etc/kubernetes/manifests/kube-apiserver.yaml"
    manifest_aside_dir: str = "/etc/kubernetes/manifests-aside"


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
}


# ---------------------------------------------------------------- parsing


def _check_type(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        return any(_check_type(value, a) for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return False


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(hint) if a is not type(None))
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, str(hint)
    )


def _build(cls: type, raw: Any, where: str, errors: List[str]) -> Any:
    """Build dataclass ``cls`` from ``raw``; unknown keys and wrong types become errors."""
    if not isinstance(raw, dict):
        errors.append(f"{where}: expected a table")
        return None
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: Dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            errors.append(f"{where}: unknown key {key!r}")
            continue
        if dataclasses.is_dataclass(hints[key]):
            # a nested table such as [backup.remote]: built (and its errors reported) recursively
            sub = _build(hints[key], value, f"{where}.{key}", errors)
            if sub is not None:
                kwargs[key] = sub
            continue
        if not _check_type(value, hints[key]):
            shown = repr(value) if known[key].repr else "<hidden>"  # never echo a secret
            errors.append(f"{where}.{key}: expected {_type_name(hints[key])}, got {shown}")
            continue
        kwargs[key] = float(value) if hints[key] is float else value
    missing = [
        n
        for n, f in known.items()
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
        and n not in kwargs
        and n not in raw
    ]
    for n in missing:
        errors.append(f"{where}: missing required key {n!r}")
    if missing or any(k not in kwargs for k in raw if k in known):
        return None
    return cls(**kwargs)


def parse_text(text: str, *, path: Optional[str] = None) -> Tuple[Optional[Config], List[str]]:
    """Parse TOML text into a Config; returns (config or None, every error found)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return None, [f"not valid TOML: {exc}"]
    errors: List[str] = []
    sections: Dict[str, Any] = {}
    for key in raw:
        if key not in SECTIONS and key != "member":
            errors.append(f"unknown section [{key}]")
    for key, cls in SECTIONS.items():
        sections[key] = _build(cls, raw.get(key, {}), key, errors)
    raw_members = raw.get("member", [])
    member_sections: List[MemberSection] = []
    if not isinstance(raw_members, list):
        errors.append("member: expected [[member]] tables")
    else:
        for i, rm in enumerate(raw_members):
            label = f"member[{i}]"
            if isinstance(rm, dict) and isinstance(rm.get("name"), str):
                label = f"member {rm['name']!r}"
            ms = _build(MemberSection, rm, label, errors)
            if ms is not None:
                member_sections.append(ms)
    if any(v is None for v in sections.values()):
        return None, errors
    members = _resolve_members(member_sections, sections["etcd"], sections["tls"], errors)
    cfg = Config(members=tuple(members), path=path, **sections)
    errors.extend(validate(cfg, raw_member_count=len(raw_members) if isinstance(raw_members, list) else 0))
    return cfg, errors


def _default_url(host: str, port: int, tls: bool) -> str:
    h = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{h}:{port}"


def _resolve_members(
    sections: List[MemberSection], etcd: EtcdSection, tls: TlsSection, errors: List[str]
) -> List[Member]:
    out = []
    for s in sections:
        out.append(
            Member(
                name=s.name,
                host=s.host,
                client_url=s.client_url or _default_url(s.host, etcd.client_port, tls.client_enabled),
                peer_url=s.peer_url or _default_url(s.host, etcd.peer_port, tls.peer_enabled),
                ssh_host=s.ssh_host or s.host,
            )
        )
    return out


# ---------------------------------------------------------------- validation


def valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(HOSTNAME_RE.match(host)) and not host.replace(".", "").isdigit()


def url_problem(url: str) -> Optional[str]:
    """Why ``url`` is not an acceptable etcd URL, or None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"malformed URL {url!r} ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"URL {url!r} must start with http:// or https://"
    if not parts.hostname or not valid_host(parts.hostname):
        return f"URL {url!r} has no valid host"
    if port is None:
        return f"URL {url!r} has no port"
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return f"URL {url!r} must be scheme://host:port only"
    return None


def validate(
    cfg: Config,
    *,
    raw_member_count: int = -1,
    file_exists: Callable[[str], bool] = os.path.isfile,
) -> List[str]:
    """Every problem with an already-typed config (empty list: valid)."""
    errs: List[str] = []
    c = cfg.cluster
    if not NAME_RE.match(c.name):
        errs.append(f"cluster.name {c.name!r} is not a safe name (letters, digits, _ . -)")
    if not NAME_RE.match(c.token):
        errs.append(f"cluster.token {c.token!r} is not a safe token (letters, digits, _ . -)")
    if c.bootstrap not in BOOTSTRAP_MODES:
        errs.append(f"cluster.bootstrap must be one of {', '.join(BOOTSTRAP_MODES)}, got {c.bootstrap!r}")

    if raw_member_count == 0 or not cfg.members and raw_member_count < 0:
        errs.append("no [[member]] defined: a cluster needs at least one")
    seen: Dict[str, Dict[str, str]] = {"name": {}, "client_url": {}, "peer_url": {}}
    for m in cfg.members:
        if not NAME_RE.match(m.name):
            errs.append(f"member {m.name!r}: name is not a safe identifier (letters, digits, _ . -; max 63)")
        bad_host = not valid_host(m.host)
        if bad_host:
            errs.append(f"member {m.name!r}: host {m.host!r} is not a valid IP address or host name")
        if m.ssh_host != m.host and not valid_host(m.ssh_host):
            errs.append(f"member {m.name!r}: ssh_host {m.ssh_host!r} is not a valid IP address or host name")
        for attr, wants_tls in (("client_url", cfg.tls.client_enabled), ("peer_url", cfg.tls.peer_enabled)):
            url = getattr(m, attr)
            if bad_host and m.host in url:
                continue  # derived from the bad host: one error is enough
            problem = url_problem(url)
            if problem:
                errs.append(f"member {m.name!r}: {attr}: {problem}")
            elif urlsplit(url).scheme != ("https" if wants_tls else "http"):
                errs.append(
                    f"member {m.name!r}: {attr} {url!r} must use "
                    f"{'https (TLS is configured)' if wants_tls else 'http (no TLS configured)'}"
                )
        for attr in ("name", "client_url", "peer_url"):
            value = getattr(m, attr)
            if value in seen[attr]:
                errs.append(f"member {m.name!r}: duplicate {attr} {value!r} (also member {seen[attr][value]!r})")
            else:
                seen[attr][value] = m.name

    if cfg.local.name is not None and cfg.local.name not in seen["name"]:
        errs.append(f"local.name {cfg.local.name!r}: local member not found among the [[member]] names")

    e = cfg.etcd
    if e.service_manager not in SERVICE_MANAGERS:
        errs.append(f"etcd.service_manager must be one of {', '.join(SERVICE_MANAGERS)}, got {e.service_manager!r}")
    for key in ("binary", "etcdctl", "etcdutl", "data_dir", "conf_file", "unit_file", "run_dir", "versions_dir"):
        value = getattr(e, key)
        if value is not None and not PATH_RE.match(value):
            errs.append(f"etcd.{key} {value!r} must be an absolute path of plain characters")
    if PATH_RE.match(e.data_dir) and e.data_dir.rstrip("/") in ("", "/var", "/var/lib", "/etc", "/usr", "/tmp"):
        errs.append(f"etcd.data_dir {e.data_dir!r} is a system directory; give etcd a dir of its own")
    if len(cfg.members) > 1 and "{name}" not in e.data_dir:
        hosts = [m.host for m in cfg.members]
        if len(set(hosts)) < len(hosts):
            errs.append("members share a host: etcd.data_dir and etcd.conf_file need a {name} placeholder")
    if not UNIT_RE.match(e.unit):
        errs.append(f"etcd.unit {e.unit!r} must be a systemd service name like etcd.service")
    for key in ("user", "group"):
        if not NAME_RE.match(getattr(e, key)):
            errs.append(f"etcd.{key} {getattr(e, key)!r} is not a valid user/group name")
    for key in ("client_port", "peer_port"):
        if not 1 <= getattr(e, key) <= 65535:
            errs.append(f"etcd.{key} must be a TCP port (1-65535)")

    t = cfg.tls
    for prefix, enabled in (("client", t.client_enabled), ("peer", t.peer_enabled)):
        if not enabled:
            continue
        for kind in ("ca", "cert", "key"):
            path = getattr(t, f"{prefix}_{kind}")
            if not path:
                errs.append(f"tls.{prefix}_{kind} is required when {prefix} TLS is configured")
            elif not PATH_RE.match(path):
                errs.append(f"tls.{prefix}_{kind} {path!r} must be an absolute path of plain characters")
            elif not file_exists(path):
                errs.append(f"tls.{prefix}_{kind}: file {path} does not exist")

    b = cfg.backup
    if not PATH_RE.match(b.dir):
        errs.append(f"backup.dir {b.dir!r} must be an absolute path of plain characters")
    if b.compression not in COMPRESSIONS:
        errs.append(f"backup.compression must be one of {', '.join(COMPRESSIONS)}, got {b.compression!r}")
    for key in ("keep_last", "keep_hourly", "keep_daily"):
        if getattr(b, key) < 0:
            errs.append(f"backup.{key} must be >= 0")
    if b.keep_last < 1:
        errs.append("backup.keep_last must be >= 1: the newest backup is always kept")
    if b.space_margin < 0:
        errs.append("backup.space_margin must be >= 0")
    if b.metrics_file is not None and not PATH_RE.match(b.metrics_file):
        errs.append(f"backup.metrics_file {b.metrics_file!r} must be an absolute path")
    errs.extend(_validate_remote(b.remote))

    s = cfg.ssh
    if not NAME_RE.match(s.user):
        errs.append(f"ssh.user {s.user!r} is not a valid user name")
    if not 1 <= s.port <= 65535:
        errs.append("ssh.port must be a TCP port (1-65535)")
    for key in ("identity_file", "known_hosts", "agent_path"):
        value = getattr(s, key)
        if value is not None and not PATH_RE.match(value):
            errs.append(f"ssh.{key} {value!r} must be an absolute path of plain characters")
    for key in ("connect_timeout", "command_timeout"):
        if getattr(s, key) <= 0:
            errs.append(f"ssh.{key} must be > 0 seconds")

    k = cfg.kubernetes
    if k.fence not in FENCE_METHODS:
        errs.append(f"kubernetes.fence must be one of {', '.join(FENCE_METHODS)}, got {k.fence!r}")
    if not UNIT_RE.match(k.apiserver_unit):
        errs.append(f"kubernetes.apiserver_unit {k.apiserver_unit!r} must be a systemd service name")
    for key in ("manifest", "manifest_aside_dir"):
        if not PATH_RE.match(getattr(k, key)):
            errs.append(f"kubernetes.{key} must be an absolute path of plain characters")

    d = cfg.daemon
    if d.interval <= 0:
        errs.append("daemon.interval must be > 0 seconds")
    if d.lock_ttl < 5:
        errs.append("daemon.lock_ttl must be >= 5 seconds")
    if not PATH_RE.match(d.state_dir):
        errs.append(f"daemon.state_dir {d.state_dir!r} must be an absolute path of plain characters")
    if d.metrics_address is not None and not _loopback_address_ok(d.metrics_address):
        errs.append(f"daemon.metrics_address {d.metrics_address!r} must be host:port (e.g. 127.0.0.1:9479)")
    mt = cfg.maintenance
    if not 0 < mt.defrag_threshold_percent < 100:
        errs.append("maintenance.defrag_threshold_percent must be between 0 and 100 (exclusive)")
    if mt.defrag_min_db_bytes < 0:
        errs.append("maintenance.defrag_min_db_bytes must be >= 0")
    if mt.defrag_timeout <= 0:
        errs.append("maintenance.defrag_timeout must be > 0 seconds")
    return errs


def _loopback_address_ok(addr: str) -> bool:
    """``host:port`` or ``[v6]:port`` with a valid host and a TCP port."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return bool(host) and valid_host(host)


def _validate_remote(r: RemoteSection) -> List[str]:
    """Problems with ``[backup.remote]``; never quotes the credentials."""
    errs: List[str] = []
    w = "backup.remote"
    if r.endpoint is not None:
        try:
            parts = urlsplit(r.endpoint)
            ok = (
                parts.scheme in ("http", "https")
                and bool(parts.hostname)
                and valid_host(parts.hostname or "")
                and "@" not in parts.netloc
                and parts.path in ("", "/")
                and not parts.query
                and not parts.fragment
            )
            parts.port  # raises on a bad port
        except ValueError:
            ok = False
        if not ok:
            # not echoed: a mistyped endpoint may carry user info
            errs.append(f"{w}.endpoint must be http(s)://host[:port] only (no user info, path or query)")
    if r.enabled and not r.bucket:
        errs.append(f"{w}.bucket is required when remote copies are enabled")
    if r.bucket and not BUCKET_RE.match(r.bucket):
        errs.append(f"{w}.bucket {r.bucket!r} is not a valid bucket name")
    if not PREFIX_RE.match(r.prefix) or r.prefix.startswith("/") or ".." in r.prefix:
        errs.append(f"{w}.prefix {r.prefix!r} must be a relative key prefix of plain characters")
    if not NAME_RE.match(r.region):
        errs.append(f"{w}.region {r.region!r} is not a valid region name")
    if (r.access_key is None) != (r.secret_key is None):
        errs.append(f"{w}: access_key and secret_key must be given together")
    if r.access_key is not None and r.credentials_file is not None:
        errs.append(f"{w}: give either access_key/secret_key or credentials_file, not both")
    for key in ("credentials_file", "ca_bundle"):
        value = getattr(r, key)
        if value is not None and not PATH_RE.match(value):
            errs.append(f"{w}.{key} {value!r} must be an absolute path of plain characters")
    if not NAME_RE.match(r.credentials_profile):
        errs.append(f"{w}.credentials_profile {r.credentials_profile!r} is not a valid profile name")
    if r.ca_bundle is not None and not r.verify_tls:
        errs.append(f"{w}: ca_bundle is set but verify_tls is false")
    if r.addressing_style not in ADDRESSING_STYLES:
        errs.append(f"{w}.addressing_style must be one of {', '.join(ADDRESSING_STYLES)}, got {r.addressing_style!r}")
    if r.verify not in REMOTE_VERIFY_MODES:
        errs.append(f"{w}.verify must be one of {', '.join(REMOTE_VERIFY_MODES)}, got {r.verify!r}")
    # S3 parts are 5 MiB .. 5 GiB (the last part may be smaller)
    if not 5 <= r.part_size_mb <= 5120:
        errs.append(f"{w}.part_size_mb must be between 5 and 5120")
    for key in ("connect_timeout", "read_timeout"):
        if getattr(r, key) <= 0:
            errs.append(f"{w}.{key} must be > 0 seconds")
    for key in ("keep_last", "keep_hourly", "keep_daily"):
        if getattr(r, key) < 0:
            errs.append(f"{w}.{key} must be >= 0")
    if r.keep_last < 1:
        errs.append(f"{w}.keep_last must be >= 1: the newest remote copy is always kept")
    return errs


# ---------------------------------------------------------------- loading


def load(path: str = DEFAULT_PATH, *, text: Optional[str] = None) -> Config:
    """Load and validate; raise ConfigError listing every problem."""
    if text is None:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found (use -c PATH, or `etcd-agent config sample`)")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}")
    cfg, errors = parse_text(text, path=path)
    if errors or cfg is None:
        n = len(errors)
        raise ConfigError(f"{path}: {n} problem{'s' if n != 1 else ''} in the config", details=errors)
    return cfg


@dataclass(frozen=True)
class MachineIdentity:
    """What this machine calls itself: host names and IP addresses."""

    names: Tuple[str, ...]
    addresses: Tuple[str, ...]


def local_member(cfg: Config, me: MachineIdentity) -> Member:
    """The member this machine runs: ``[local] name``, else the one whose host matches this machine."""
    if cfg.local.name is not None:
        return cfg.member(cfg.local.name)
    matches = [
        m
        for m in cfg.members
        if m.name in me.names or m.host in me.names or m.host in me.addresses
    ]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ConfigError(
            "local member not found: no [[member]] name or host matches this machine "
            f"(names {', '.join(me.names) or '-'}; addresses {', '.join(me.addresses) or '-'}); "
            "set [local] name"
        )
    raise ConfigError(
        f"local member is ambiguous: {', '.join(m.name for m in matches)} all match this machine; "
        "set [local] name"
    )


def with_local(cfg: Config, name: str) -> Config:
    """The same config with ``[local] name`` set (the demo and tests run several members per host)."""
    cfg.member(name)
    return dataclasses.replace(cfg, local=LocalSection(name=name))


def merged(cfg: Config, **sections: Mapping[str, Any]) -> Config:
    """The same config with some section fields replaced (e.g. ``etcd={'binary': ...}``)."""
    repl = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()}
    return dataclasses.replace(cfg, **repl)
