"""The bootstrap record: this host has run a member of this cluster, and as which one.

``<[daemon] state_dir>/<member>.json`` is written the first time the member is seen healthy, and
rewritten by a restore (which makes new member ids and a new cluster token). Without it a host
that lost its data while nobody answers cannot tell "first boot" from "everyone else is down",
and would seed a second cluster. Its ids are also evidence of which cluster this host belongs to
when a restore must decide whether a backup is this cluster's, with etcd down.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Optional

from etcd_agent.config import Config
from etcd_agent.errors import ProtocolError
from etcd_agent.fs import makedirs, write_atomic
from etcd_agent.safejson import UnsafeJson, loads
from etcd_agent.typedjson import Document


@dataclass(frozen=True)
class BootstrapRecord(Document):
    """The record as written; every field but ``cluster`` may be absent (``token`` came later)."""

    cluster: str = ""
    cluster_id: Optional[str] = None  # hex, as etcd prints it
    member_id: Optional[str] = None
    token: Optional[str] = None  # the initial cluster token in use (a restore sets a new one)
    since: str = ""


def record_path(cfg: Config, member: str) -> str:
    return os.path.join(cfg.daemon.state_dir, f"{member}.json")


def ever_bootstrapped(cfg: Config, member: str) -> bool:
    return os.path.exists(record_path(cfg, member))


def read(cfg: Config, member: str) -> Optional[BootstrapRecord]:
    """The record, None when absent; an unreadable one still says "bootstrapped" (fail closed)
    but carries no ids."""
    path = record_path(cfg, member)
    try:
        with open(path, "rb") as fh:
            doc = loads(fh.read(65537), max_bytes=65536)
        rec = BootstrapRecord.from_json(doc, f"bootstrap record {path}")
    except FileNotFoundError:
        return None
    except (OSError, UnsafeJson, ProtocolError):
        return BootstrapRecord(cfg.cluster.name)
    # an empty id is no id (as the previous reader took it)
    return dataclasses.replace(rec, cluster_id=rec.cluster_id or None, member_id=rec.member_id or None,
                               token=rec.token or None)


def remember(cfg: Config, member: str, cluster_id: int, member_id: int, token: Optional[str] = None) -> None:
    """Record that ``member`` runs healthy as ``member_id`` in cluster ``cluster_id`` (0600)."""
    makedirs(cfg.daemon.state_dir, 0o700)
    rec = BootstrapRecord(cfg.cluster.name, f"{cluster_id:x}", f"{member_id:x}", token,
                          time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    write_atomic(record_path(cfg, member), (json.dumps(rec.to_json(), sort_keys=True) + "\n").encode(), mode=0o600)


def effective_token(cfg: Config, member: str) -> str:
    """The cluster token this member's cluster was made with: a restore's, else the config's."""
    rec = read(cfg, member)
    return rec.token if rec is not None and rec.token else cfg.cluster.token
