"""The restore lineage this host knows: which member ids the data it runs came from.

A restore makes new member ids (they are derived from the peer URLs and the new cluster token),
so a backup taken before the restore lists ids the running cluster no longer has. Each finished
restore appends the ids of the snapshot it restored (``<state_dir>/lineage.json``, newest last):
a later restore of such a backup is then recognised as this cluster's own, even with etcd down.
"""
from __future__ import annotations

import json
import os
import time
from typing import List, Sequence, Set

from etcd_agent.config import Config
from etcd_agent.fs import makedirs, write_atomic
from etcd_agent.safejson import UnsafeJson, loads

MAX_ENTRIES = 50


def lineage_path(cfg: Config) -> str:
    return os.path.join(cfg.daemon.state_dir, "lineage.json")


def read(cfg: Config) -> List[Set[str]]:
    """Every recorded set of ancestor member ids (hex), oldest first; [] when none or unreadable."""
    try:
        with open(lineage_path(cfg), "rb") as fh:
            doc = loads(fh.read(1 << 20), max_bytes=1 << 20)
    except (OSError, UnsafeJson):
        return []
    out: List[Set[str]] = []
    if isinstance(doc, list):
        for entry in doc:
            ids = entry.get("member_ids") if isinstance(entry, dict) else None
            if isinstance(ids, list) and ids and all(isinstance(x, str) for x in ids):
                out.append({x.lower() for x in ids})
    return out


def record(cfg: Config, member_ids: Sequence[str], op: str) -> None:
    """Append the snapshot's member ids of a finished restore (kept to the last MAX_ENTRIES)."""
    if not member_ids:
        return
    try:
        with open(lineage_path(cfg), "rb") as fh:
            doc = loads(fh.read(1 << 20), max_bytes=1 << 20)
        entries = doc if isinstance(doc, list) else []
    except (OSError, UnsafeJson):
        entries = []
    entries.append({"member_ids": sorted(x.lower() for x in member_ids), "op": op,
                    "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    makedirs(cfg.daemon.state_dir, 0o700)
    write_atomic(lineage_path(cfg), (json.dumps(entries[-MAX_ENTRIES:], indent=1) + "\n").encode(), mode=0o600)
