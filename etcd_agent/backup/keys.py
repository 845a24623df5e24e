"""The cluster's manifest key: which key signs manifests, and how every master gets the same one.

The key is 32 random bytes, kept hex-encoded in ``manifest.key`` beside the config
(``/etc/etcd-agent/manifest.key``, 0600; ``KEY_FILE`` until the config grows a
``[backup] manifest_key`` setting). Distribution goes through etcd itself:

- the first backup that finds no key anywhere creates one and stores it under ``ETCD_KEY`` with a
  create-if-absent transaction; if another master won that race, its key is read back and used;
- every agent caches the key from etcd in its own file (a backup, a verify or an import fetches it
  when the file is missing);
- a key in etcd that differs from the cached one wins (it is the cluster's) and replaces the
  cache, with a warning: backups signed with the old key then show as signed with an unknown key;
- etcd unreachable or the file unreadable is a warning, never an error: the backup is then
  unsigned and says so.

Limitation, on purpose written down: the key lives in etcd's keyspace, so every snapshot carries
it. Whoever holds a backup (or etcd read access) holds the key and could forge a manifest; the
signature defeats tampering by anyone without those, and identity never rests on the manifest.
The key is never logged, printed or put in an error.
"""
from __future__ import annotations

import binascii
import logging
import os
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional

from etcd_agent.errors import AgentError
from etcd_agent.fs import open_regular, write_atomic

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config
    from etcd_agent.etcd.client import EtcdClient

log = logging.getLogger(__name__)

KEY_FILE = "/etc/etcd-agent/manifest.key"
KEY_NAME = "manifest.key"
ETCD_KEY = "/etcd-agent/manifest-key"
KEY_BYTES = 32


@dataclass
class KeyState:
    """The key to use (None: none to be had) and what happened getting it."""

    key: Optional[bytes]
    source: str  # "file" | "etcd" | "created" | "none"
    warnings: List[str] = field(default_factory=list)


def key_path(cfg: "Config") -> str:
    """``[backup] manifest_key``, else beside the config file the agent was started with, else the
    default."""
    if cfg.backup.manifest_key:
        return cfg.backup.manifest_key
    if cfg.path:
        return os.path.join(os.path.dirname(os.path.abspath(cfg.path)), KEY_NAME)
    return KEY_FILE


def _decode(raw: bytes) -> Optional[bytes]:
    try:
        key = binascii.unhexlify(raw.strip())
    except (binascii.Error, ValueError):
        return None
    return key if len(key) == KEY_BYTES else None


def read_key_file(path: str) -> KeyState:
    """The cached key; a missing file is no key, a bad one a warning."""
    try:
        st = os.stat(path)
        with open_regular(path, follow_symlinks=True) as fh:
            raw = fh.read(4096)
    except FileNotFoundError:
        return KeyState(None, "none")
    except OSError as exc:
        return KeyState(None, "none", [f"manifest key {path} unreadable ({exc.strerror or exc}); manifests are not signed"])
    warnings = []
    if st.st_mode & 0o077:
        warnings.append(f"manifest key {path} has mode {st.st_mode & 0o777:o}; it should be 0600")
    key = _decode(raw)
    if key is None:
        warnings.append(f"manifest key {path} does not hold {KEY_BYTES} hex-encoded bytes; ignored")
        return KeyState(None, "none", warnings)
    return KeyState(key, "file", warnings)


def _cache(path: str, key: bytes, state: KeyState) -> None:
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        write_atomic(path, binascii.hexlify(key) + b"\n", mode=0o600)
    except OSError as exc:
        state.warnings.append(f"cannot cache the manifest key in {path} ({exc.strerror or exc})")


def local_key(cfg: "Config") -> KeyState:
    """The key this host has cached, without asking etcd."""
    return read_key_file(key_path(cfg))


def cluster_key(cfg: "Config", client: Optional["EtcdClient"], *, create: bool) -> KeyState:
    """The cluster's key: etcd's (cached here), else this host's cached one; with ``create`` a
    new key is made and offered to etcd when there is none anywhere. Never raises."""
    path = key_path(cfg)
    state = read_key_file(path)
    if client is None:
        return state
    try:
        raw = client.get(ETCD_KEY)
    except AgentError as exc:
        state.warnings.append(f"cannot read the manifest key from etcd ({exc.message}); using the cached one"
                              if state.key else f"cannot read the manifest key from etcd ({exc.message})")
        return state
    remote = _decode(raw) if raw is not None else None
    if raw is not None and remote is None:
        state.warnings.append(f"the manifest key in etcd ({ETCD_KEY}) is malformed; using the cached one")
        return state
    if remote is None:
        if not create and state.key is None:
            return state
        offer = state.key or secrets.token_bytes(KEY_BYTES)
        try:
            created = client.put_if_absent(ETCD_KEY, binascii.hexlify(offer))
            if not created:  # another master was first: take its key
                raw = client.get(ETCD_KEY)
                remote = _decode(raw) if raw is not None else None
            else:
                remote = offer
                log.info("manifest key %s in etcd (%s)", "published" if state.key else "created", ETCD_KEY)
        except AgentError as exc:
            state.warnings.append(f"cannot store the manifest key in etcd ({exc.message})")
            return state
        if remote is None:
            state.warnings.append(f"the manifest key in etcd ({ETCD_KEY}) is malformed; using the cached one")
            return state
        source = "created" if remote == offer and state.key is None else "etcd"
    else:
        source = "etcd"
    if state.key is not None and state.key != remote:
        state.warnings.append(f"the manifest key cached in {path} differs from the cluster's in etcd; "
                              "replacing the cached copy (backups signed with the old key show as unknown-key)")
    if state.key != remote:
        _cache(path, remote, state)
    state.key, state.source = remote, source
    return state
