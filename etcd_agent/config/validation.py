"""Validation of a typed config: every problem at once, as one sentence each.

``config.parse_text`` calls ``validate`` after building the frozen dataclasses; nothing here does
I/O except checking that configured TLS files exist (``file_exists``, injectable for tests).
Where the configured paths may point is for ``config.paths`` to say.
"""
from __future__ import annotations

import ipaddress
import os
import re
from typing import Callable, Dict, List, Optional
from urllib.parse import urlsplit

from etcd_agent.config.model import (
    ADDRESSING_STYLES,
    BOOTSTRAP_MODES,
    BUCKET_RE,
    COMPRESSIONS,
    FENCE_METHODS,
    HOSTNAME_RE,
    IONICE_RE,
    NAME_RE,
    POINT_IN_TIME_LOADS,
    PREFIX_RE,
    REMOTE_VERIFY_MODES,
    SERVICE_MANAGERS,
    SSH_STREAMS,
    UNIT_RE,
    BackupSection,
    Config,
    DeltaSection,
    Member,
    RemoteSection,
)
from etcd_agent.config.paths import path_problem, validate_paths

# Intervals and timeouts: beyond a week is a typo (and overflows the OS's timers).
MAX_SECONDS = 7 * 86400


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
    resolve: Callable[[str], str] = os.path.realpath,
) -> List[str]:
    """Every problem with an already-typed config (empty list: valid), section by section.
    ``resolve`` follows a path's links: the agent's own dirs must be apart where they really are."""
    errs = _validate_cluster(cfg)
    errs += _validate_members(cfg, raw_member_count)
    errs += _validate_etcd(cfg, resolve)
    errs += _validate_tls(cfg, file_exists)
    errs += _validate_backup(cfg)
    errs += _validate_ssh(cfg)
    errs += _validate_kubernetes(cfg, file_exists)
    errs += _validate_daemon(cfg)
    errs += _validate_drill(cfg)
    return errs


def _validate_cluster(cfg: Config) -> List[str]:
    errs: List[str] = []
    c = cfg.cluster
    if not NAME_RE.match(c.name):
        errs.append(f"cluster.name {c.name!r} is not a safe name (letters, digits, _ . -)")
    if not NAME_RE.match(c.token):
        errs.append(f"cluster.token {c.token!r} is not a safe token (letters, digits, _ . -)")
    if c.bootstrap not in BOOTSTRAP_MODES:
        errs.append(f"cluster.bootstrap must be one of {', '.join(BOOTSTRAP_MODES)}, got {c.bootstrap!r}")
    return errs


def _member_url_problems(cfg: Config, m: Member, bad_host: bool) -> List[str]:
    errs: List[str] = []
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
    return errs


def _validate_members(cfg: Config, raw_member_count: int) -> List[str]:
    errs: List[str] = []
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
        errs += _member_url_problems(cfg, m, bad_host)
        for attr in ("name", "client_url", "peer_url"):
            value = getattr(m, attr)
            if value in seen[attr]:
                errs.append(f"member {m.name!r}: duplicate {attr} {value!r} (also member {seen[attr][value]!r})")
            else:
                seen[attr][value] = m.name
    if cfg.local.name is not None and cfg.local.name not in seen["name"]:
        errs.append(f"local.name {cfg.local.name!r}: local member not found among the [[member]] names")
    return errs


def _validate_etcd(cfg: Config, resolve: Callable[[str], str]) -> List[str]:
    errs: List[str] = []
    e = cfg.etcd
    if e.service_manager not in SERVICE_MANAGERS:
        errs.append(f"etcd.service_manager must be one of {', '.join(SERVICE_MANAGERS)}, got {e.service_manager!r}")
    errs.extend(validate_paths(cfg, resolve))
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
    errs.extend(_seconds("etcd.start_timeout", e.start_timeout))
    return errs


def _validate_tls(cfg: Config, file_exists: Callable[[str], bool]) -> List[str]:
    errs: List[str] = []
    t = cfg.tls
    for prefix, enabled in (("client", t.client_enabled), ("peer", t.peer_enabled)):
        if not enabled:
            continue
        for kind in ("ca", "cert", "key"):
            path = getattr(t, f"{prefix}_{kind}")
            if not path:
                errs.append(f"tls.{prefix}_{kind} is required when {prefix} TLS is configured")
            elif path_problem("", path):
                pass  # reported with every other path
            elif not file_exists(path):
                errs.append(f"tls.{prefix}_{kind}: file {path} does not exist")
    return errs


def _retention_problems(w: str, keep_last: int, keep_hourly: int, keep_daily: int, newest: str) -> List[str]:
    errs = [f"{w}.{key} must be >= 0" for key, v in (("keep_last", keep_last), ("keep_hourly", keep_hourly),
                                                     ("keep_daily", keep_daily)) if v < 0]
    if keep_last < 1:
        errs.append(f"{w}.keep_last must be >= 1: the newest {newest} is always kept")
    return errs


def _validate_backup(cfg: Config) -> List[str]:
    errs: List[str] = []
    b = cfg.backup
    if b.compression not in COMPRESSIONS:
        errs.append(f"backup.compression must be one of {', '.join(COMPRESSIONS)}, got {b.compression!r}")
    errs += _retention_problems("backup", b.keep_last, b.keep_hourly, b.keep_daily, "backup")
    if b.space_margin < 0:
        errs.append("backup.space_margin must be >= 0")
    errs.extend(_validate_encrypt_to(b))
    errs.extend(_validate_remote(b.remote))
    errs.extend(_validate_delta(b.delta))
    return errs


def _validate_ssh(cfg: Config) -> List[str]:
    errs: List[str] = []
    s = cfg.ssh
    if not NAME_RE.match(s.user):
        errs.append(f"ssh.user {s.user!r} is not a valid user name")
    if not 1 <= s.port <= 65535:
        errs.append("ssh.port must be a TCP port (1-65535)")
    for key in ("connect_timeout", "command_timeout"):
        errs.extend(_seconds(f"ssh.{key}", getattr(s, key)))
    if s.stream not in SSH_STREAMS:
        errs.append(f"ssh.stream must be one of {', '.join(SSH_STREAMS)}, got {s.stream!r}")
    return errs


def _validate_kubernetes(cfg: Config, file_exists: Callable[[str], bool]) -> List[str]:
    errs: List[str] = []
    k = cfg.kubernetes
    if k.fence not in FENCE_METHODS:
        errs.append(f"kubernetes.fence must be one of {', '.join(FENCE_METHODS)}, got {k.fence!r}")
    if not UNIT_RE.match(k.apiserver_unit):
        errs.append(f"kubernetes.apiserver_unit {k.apiserver_unit!r} must be a systemd service name")
    if k.readyz_url is not None:
        probe = k.readyz_url.replace("{host}", "h.example")
        parts = urlsplit(probe)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment or "@" in parts.netloc:
            errs.append(f"kubernetes.readyz_url {k.readyz_url!r} must be http(s)://{{host}}:PORT/readyz (no query)")
        elif "{host}" not in k.readyz_url:
            errs.append("kubernetes.readyz_url must name the master as {host}, e.g. https://{host}:6443/readyz")
    if k.readyz_ca is not None and not file_exists(k.readyz_ca):
        errs.append(f"kubernetes.readyz_ca: file {k.readyz_ca} does not exist")
    errs.extend(_seconds("kubernetes.readyz_timeout", k.readyz_timeout))
    if not re.match(r"^/[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$", k.etcd_prefix):
        errs.append(f"kubernetes.etcd_prefix {k.etcd_prefix!r} must be a key prefix like /registry")
    return errs


def _validate_daemon(cfg: Config) -> List[str]:
    """[daemon] and [maintenance], which the daemon runs."""
    errs: List[str] = []
    d = cfg.daemon
    errs.extend(_seconds("daemon.interval", d.interval))
    if d.lock_ttl < 5:
        errs.append("daemon.lock_ttl must be >= 5 seconds")
    elif d.lock_ttl > MAX_SECONDS:
        errs.append(f"daemon.lock_ttl must be at most {MAX_SECONDS} seconds (7 days)")
    if d.metrics_address is not None and not _loopback_address_ok(d.metrics_address):
        errs.append(f"daemon.metrics_address {d.metrics_address!r} must be host:port (e.g. 127.0.0.1:9479)")
    mt = cfg.maintenance
    if not 0 < mt.defrag_threshold_percent < 100:
        errs.append("maintenance.defrag_threshold_percent must be between 0 and 100 (exclusive)")
    if mt.defrag_min_db_bytes < 0:
        errs.append("maintenance.defrag_min_db_bytes must be >= 0")
    errs.extend(_seconds("maintenance.defrag_timeout", mt.defrag_timeout))
    return errs


def _validate_drill(cfg: Config) -> List[str]:
    dr = cfg.drill
    errs: List[str] = []
    if dr.every != 0 and not 60 <= dr.every <= MAX_SECONDS:
        errs.append(f"drill.every must be 0 (no scheduled drills) or 60 to {MAX_SECONDS} seconds, got {dr.every:g}")
    if dr.user and not NAME_RE.match(dr.user):
        errs.append(f"drill.user {dr.user!r} is not a safe user name")
    if not 0 <= dr.nice <= 19:
        errs.append(f"drill.nice must be 0 to 19, got {dr.nice}")
    if not IONICE_RE.match(dr.ionice):
        errs.append(f"drill.ionice must be idle, none or best-effort:N (N 0-7), got {dr.ionice!r}")
    if not 0 <= dr.gomaxprocs <= 1024:
        errs.append(f"drill.gomaxprocs must be 0 (all cores) to 1024, got {dr.gomaxprocs}")
    if not 0 <= dr.sample_keys <= 100_000:
        errs.append(f"drill.sample_keys must be 0 to 100000, got {dr.sample_keys}")
    errs.extend(_seconds("drill.timeout", dr.timeout))
    return errs


def _seconds(key: str, value: float) -> List[str]:
    """A duration: > 0 and at most MAX_SECONDS."""
    if value <= 0:
        return [f"{key} must be > 0 seconds"]
    if value > MAX_SECONDS:
        return [f"{key} must be at most {MAX_SECONDS} seconds (7 days)"]
    return []


def _validate_delta(d: DeltaSection) -> List[str]:
    """Problems with ``[backup.delta]``."""
    w = "backup.delta"
    errs: List[str] = []
    for key in ("close_seconds", "idle_seconds", "max_outage"):
        errs.extend(_seconds(f"{w}.{key}", getattr(d, key)))
    if d.close_seconds > d.idle_seconds:
        errs.append(f"{w}.close_seconds ({d.close_seconds:g}) must not exceed idle_seconds ({d.idle_seconds:g})")
    if not 0 <= d.batch_seconds <= 10:
        errs.append(f"{w}.batch_seconds must be between 0 (a streaming watch) and 10")
    elif d.batch_seconds > d.close_seconds:
        errs.append(f"{w}.batch_seconds ({d.batch_seconds:g}) must not exceed close_seconds ({d.close_seconds:g})")
    # a segment is read whole (at most 1 GiB) and one revision may be etcd's --max-request-bytes
    if not 64 * 1024 <= d.close_bytes <= 512 * 1024 * 1024:
        errs.append(f"{w}.close_bytes must be between 65536 and 536870912")
    for key in ("max_chain_events", "max_chain_bytes", "max_chain_segments"):
        if getattr(d, key) < 1:
            errs.append(f"{w}.{key} must be >= 1")
    if not 0 <= d.checkpoint_ratio <= 100:
        errs.append(f"{w}.checkpoint_ratio must be between 0 (no checkpoints) and 100")
    errs.extend(_seconds(f"{w}.checkpoint_min_seconds", d.checkpoint_min_seconds))
    if not 1 <= d.checkpoint_keep <= 10:
        errs.append(f"{w}.checkpoint_keep must be between 1 and 10")
    if d.point_in_time_load not in POINT_IN_TIME_LOADS:
        errs.append(f"{w}.point_in_time_load must be one of {', '.join(POINT_IN_TIME_LOADS)}, "
                    f"got {d.point_in_time_load!r}")
    return errs


def _loopback_address_ok(addr: str) -> bool:
    """``host:port`` or ``[v6]:port`` with a valid host and a TCP port."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return bool(host) and valid_host(host)


def _validate_encrypt_to(b: BackupSection) -> List[str]:
    """``[backup] encrypt_to``: each entry an age X25519 recipient (a secret key there is an error
    that never quotes it), at most MAX_RECIPIENTS, and not together with compression."""
    if not b.encrypt_to:
        return []
    from etcd_agent.age import MAX_RECIPIENTS, parse_recipient  # cryptography: only for configs that encrypt
    from etcd_agent.errors import RecipientInvalid

    errs: List[str] = []
    for i, text in enumerate(b.encrypt_to):
        try:
            parse_recipient(text, f"backup.encrypt_to[{i}]")
        except RecipientInvalid as exc:
            errs.append(exc.message)
    if len(b.encrypt_to) > MAX_RECIPIENTS:
        errs.append(f"backup.encrypt_to lists {len(b.encrypt_to)} recipients; at most {MAX_RECIPIENTS} are supported")
    if b.compression != "none":
        # ciphertext does not compress, and compressing first would make each archive's size depend
        # on what is in etcd (some of it written by anyone who may create a ConfigMap)
        errs.append(f"backup.compression = {b.compression!r} cannot go with backup.encrypt_to: encrypted snapshots "
                    "are written uncompressed (ciphertext does not compress, and compressing before encrypting "
                    "would let each backup's size tell about its content); set compression = \"none\"")
    return errs


def _endpoint_ok(endpoint: str) -> bool:
    try:
        parts = urlsplit(endpoint)
        _ = parts.port  # raises on a bad port
    except ValueError:
        return False
    return (parts.scheme in ("http", "https") and bool(parts.hostname) and valid_host(parts.hostname or "")
            and "@" not in parts.netloc and parts.path in ("", "/") and not parts.query and not parts.fragment)


def _remote_credentials_problems(r: RemoteSection, w: str) -> List[str]:
    errs: List[str] = []
    if (r.access_key is None) != (r.secret_key is None):
        errs.append(f"{w}: access_key and secret_key must be given together")
    if r.access_key is not None and r.credentials_file is not None:
        errs.append(f"{w}: give either access_key/secret_key or credentials_file, not both")
    if not NAME_RE.match(r.credentials_profile):
        errs.append(f"{w}.credentials_profile {r.credentials_profile!r} is not a valid profile name")
    if r.ca_bundle is not None and not r.verify_tls:
        errs.append(f"{w}: ca_bundle is set but verify_tls is false")
    return errs


def _validate_remote(r: RemoteSection) -> List[str]:
    """Problems with ``[backup.remote]``; never quotes the credentials."""
    errs: List[str] = []
    w = "backup.remote"
    if r.endpoint is not None and not _endpoint_ok(r.endpoint):
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
    errs += _remote_credentials_problems(r, w)
    if r.addressing_style not in ADDRESSING_STYLES:
        errs.append(f"{w}.addressing_style must be one of {', '.join(ADDRESSING_STYLES)}, got {r.addressing_style!r}")
    if r.verify not in REMOTE_VERIFY_MODES:
        errs.append(f"{w}.verify must be one of {', '.join(REMOTE_VERIFY_MODES)}, got {r.verify!r}")
    # S3 parts are 5 MiB .. 5 GiB (the last part may be smaller)
    if not 5 <= r.part_size_mb <= 5120:
        errs.append(f"{w}.part_size_mb must be between 5 and 5120")
    for key in ("connect_timeout", "read_timeout", "deadline"):
        errs.extend(_seconds(f"{w}.{key}", getattr(r, key)))
    if not 1 <= r.max_attempts <= 10:
        errs.append(f"{w}.max_attempts must be between 1 and 10")
    errs += _retention_problems(w, r.keep_last, r.keep_hourly, r.keep_daily, "remote copy")
    return errs
