"""Which incarnations a running cluster descends from: its restore lineage, kept in etcd.

A restore makes new member ids (they derive from the peer URLs and the new cluster token), so a
backup taken before the restore lists ids the running cluster no longer has. Each finished
restore appends the member ids of the snapshot it restored under ``LINEAGE_KEY`` (a list of id
lists, newest last): a later restore recognises backups of any earlier incarnation as this
cluster's own (``backup.evidence.parse_lineage`` reads it; older entries were cluster ids). The
hosts keep the same record in their state dir (``state.lineage``) for when etcd is down.
"""
from __future__ import annotations

import json
from typing import Any, List

from etcd_agent.config import Config
from etcd_agent.safejson import loads

LINEAGE_KEY = "/etcd-agent/restore/lineage"
MAX_ENTRIES = 50
# the value as read: 50 entries of a few member ids take a few KiB
MAX_LINEAGE_BYTES = 1 << 20


def record_lineage(cfg: Config, member_ids: List[str]) -> None:
    """Append ``member_ids`` (hex) to the running cluster's lineage."""
    from etcd_agent.etcd.client import EtcdClient

    if not member_ids:
        return
    with EtcdClient.from_config(cfg, timeout=5.0) as c:
        raw = c.get(LINEAGE_KEY)
        entries: List[Any] = []
        try:
            doc = loads(raw, max_bytes=MAX_LINEAGE_BYTES) if raw else []
            entries = doc if isinstance(doc, list) else []
        except ValueError:
            pass
        entry = sorted(x.lower() for x in member_ids)
        if entry not in entries:
            entries.append(entry)
        c.put(LINEAGE_KEY, json.dumps(entries[-MAX_ENTRIES:]).encode())
