"""Which clusters a running cluster descends from: its restore lineage.

A restore creates a new cluster id; the restored cluster records the ids its data came from under
``LINEAGE_KEY``, so a later restore still recognises backups taken before the first one as this
cluster's own.
"""
from __future__ import annotations

import json
from typing import List, Optional, Tuple

from ..config import Config
from ..errors import AgentError

# Written into the restored cluster: the ids of the clusters its data came from.
LINEAGE_KEY = "/etcd-agent/restore/lineage"


def current_cluster(cfg: Config) -> Tuple[Optional[str], List[str]]:
    """The running cluster's id and restore lineage if any member answers (None in an outage)."""
    from ..etcd.client import EtcdClient

    try:
        with EtcdClient.from_config(cfg, timeout=2.0) as c:
            for url in cfg.client_urls:
                try:
                    cid = f"{c.status(url, timeout=2.0).cluster_id:x}"
                except AgentError:
                    continue
                try:
                    raw = c.get(LINEAGE_KEY)
                    lineage = [str(x) for x in json.loads(raw)] if raw else []
                except (AgentError, ValueError, TypeError):
                    lineage = []
                return cid, lineage
    except AgentError:
        pass
    return None, []


def record_lineage(cfg: Config, archive_cluster_id: Optional[str]) -> None:
    """Append the archive's cluster id to the restored cluster's lineage (see LINEAGE_KEY)."""
    from ..etcd.client import EtcdClient

    with EtcdClient.from_config(cfg, timeout=5.0) as c:
        raw = c.get(LINEAGE_KEY)
        try:
            ids = [str(x) for x in json.loads(raw)] if raw else []
        except ValueError:
            ids = []
        if archive_cluster_id and archive_cluster_id not in ids:
            ids.append(archive_cluster_id)
        c.put(LINEAGE_KEY, json.dumps(ids[-50:]).encode())


