"""Warnings about files of a valid config that expose secrets: ``security_warnings(cfg)``.

Not validation errors: a world-readable ``agent.toml`` still works, and refusing to start the
daemon over it would cost more than it saves. But it is said wherever an operator looks:
``config validate`` and ``status`` print it, ``backup`` and the daemon (at start and on every
reload) log it. A warning names the file, its mode and the fix, never the secret. Settings that
silently do nothing are said the same way (``addressing_style = "virtual"`` on an IP endpoint).
"""
from __future__ import annotations

import os
import stat
from typing import List, Optional

from etcd_agent.config.model import Config

READ_BY_OTHERS = 0o044
WRITE_BY_OTHERS = 0o022


def security_warnings(cfg: Config) -> List[str]:
    """One sentence per exposed secret or config file others can change; [] when all is private.

    Files that do not exist (or cannot be looked at) are skipped: other checks report those.
    """
    out: List[str] = []
    r = cfg.backup.remote
    path = cfg.path if cfg.path not in (None, "<stdin>") else None
    if path is not None:
        mode = _mode(path)
        if mode is not None and r.access_key is not None and mode & READ_BY_OTHERS:
            out.append(
                f"config file {path} holds [backup.remote] access_key/secret_key and is readable by group/others "
                f"(mode {mode:04o}): run `chmod 600 {path}`, or move the keys to a credentials_file of mode 0600"
            )
        if mode is not None and mode & WRITE_BY_OTHERS:
            out.append(
                f"config file {path} is writable by group/others (mode {mode:04o}): whoever can write it decides "
                f"what the agent runs; run `chmod go-w {path}`"
            )
    if r.credentials_file is not None:
        mode = _mode(r.credentials_file)
        # the same rule the S3 client applies before it reads the file (backup/remotebucket.py)
        if mode is not None and mode & 0o077:
            out.append(
                f"backup.remote.credentials_file {r.credentials_file} is open to group/others (mode {mode:04o}): "
                f"it holds the S3 secret key and remote copies refuse it; run `chmod 600 {r.credentials_file}`"
            )
    if r.enabled and r.addressing_style == "virtual" and r.endpoint is not None and is_ip_endpoint(r.endpoint):
        # botocore cannot put a bucket into an IP address: it uses path style, whatever is set
        out.append(
            'backup.remote.addressing_style = "virtual" has no effect with an IP address endpoint: the S3 client '
            'uses path-style addresses then; set addressing_style = "path" (or a host name endpoint)'
        )
    key = cfg.ssh.identity_file
    if key is not None:
        mode = _mode(key)
        if mode is not None and mode & READ_BY_OTHERS:
            out.append(
                f"ssh.identity_file {key} is readable by group/others (mode {mode:04o}): it is the private key "
                f"that logs in to every master as {cfg.ssh.user}; run `chmod 600 {key}`"
            )
    return out


def is_ip_endpoint(endpoint: str) -> bool:
    """The endpoint URL's host is an IP address (not a name a bucket could be put in front of)."""
    import ipaddress
    from urllib.parse import urlsplit

    try:
        ipaddress.ip_address(urlsplit(endpoint).hostname or "")
    except ValueError:
        return False
    return True


def _mode(path: str) -> Optional[int]:
    """Permission bits of the file ``path`` points to, or None when there is nothing to look at."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
