"""The bootstrap record: this host has run a member of this cluster.

``<[daemon] state_dir>/<member>.json`` is written the first time the member is seen healthy.
Without it a host that lost its data while nobody answers cannot tell "first boot" from
"everyone else is down", and would seed a second cluster.
"""
from __future__ import annotations

import json
import os
import time

from ..config import Config
from ..fs import makedirs, write_atomic


def record_path(cfg: Config, member: str) -> str:
    return os.path.join(cfg.daemon.state_dir, f"{member}.json")


def ever_bootstrapped(cfg: Config, member: str) -> bool:
    return os.path.exists(record_path(cfg, member))


def remember(cfg: Config, member: str, cluster_id: int, member_id: int) -> None:
    """Record that ``member`` ran healthy in cluster ``cluster_id`` (written once, 0600)."""
    makedirs(cfg.daemon.state_dir, 0o700)
    rec = {"cluster": cfg.cluster.name, "cluster_id": f"{cluster_id:x}", "member_id": f"{member_id:x}",
           "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_atomic(record_path(cfg, member), (json.dumps(rec) + "\n").encode(), mode=0o600)
