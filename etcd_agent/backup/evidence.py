"""What this host can find of the current cluster, for ``identity.judge`` (the I/O half).

- the running cluster's member list and id, if any configured member answers;
- the restore lineage recorded in etcd (``cluster/lineage.LINEAGE_KEY``): entries that are lists of
  member ids (earlier incarnations), or, as older restores wrote them, cluster ids;
- on this host: each local member's data dir db (its members bucket) and the agent's bootstrap
  record in the state dir.

Other hosts' data dirs are the restore's to gather (over ``etcd-agent node``); it builds the same
``Evidence`` with more ``HostIds``. Nothing here raises: what cannot be looked at becomes a note.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, FrozenSet, List, Optional, Set, Tuple

from etcd_agent.backup.identity import Evidence, HostIds, KnownMember
from etcd_agent.errors import AgentError
from etcd_agent.etcd.lineage import MAX_LINEAGE_BYTES
from etcd_agent.fs import open_regular
from etcd_agent.member.dblock import db_path
from etcd_agent.safejson import load as load_json
from etcd_agent.safejson import loads

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config

log = logging.getLogger(__name__)


def parse_lineage(raw: Optional[bytes]) -> Tuple[Tuple[FrozenSet[int], ...], FrozenSet[int]]:
    """(member-id sets, cluster ids) from the lineage value; malformed entries are skipped."""
    if not raw:
        return (), frozenset()
    try:
        items = loads(raw, max_bytes=MAX_LINEAGE_BYTES)
    except (ValueError, UnicodeDecodeError):
        return (), frozenset()
    sets: List[FrozenSet[int]] = []
    cids: Set[int] = set()
    if not isinstance(items, list):
        return (), frozenset()
    for it in items[:200]:
        if isinstance(it, dict):
            it = it.get("member_ids")
        try:
            if isinstance(it, str):
                cids.add(int(it, 16))
            elif isinstance(it, list):
                sets.append(frozenset(int(str(x), 16) for x in it[:64]))
        except ValueError:
            continue
    return tuple(sets), frozenset(cids)


def local_hosts(cfg: "Config") -> Tuple[List[HostIds], List[str]]:
    """Member ids in this host's data dirs and bootstrap records."""
    from etcd_agent.errors import ConfigError
    from etcd_agent.etcd.snapdb import read_identity
    from etcd_agent.locality import local_members
    from etcd_agent.state.bootstrap import BootstrapRecord, record_path

    hosts: List[HostIds] = []
    notes: List[str] = []
    try:
        members = local_members(cfg)
    except (ConfigError, OSError) as exc:
        return hosts, [f"this host's members unknown ({exc})"]
    for m in members:
        db = db_path(cfg.data_dir(m.name))
        if os.path.exists(db):
            try:
                ident = read_identity(db)
                if ident.members:
                    hosts.append(HostIds(f"{m.name}'s data dir ({db})", frozenset(ident.member_ids)))
            except (AgentError, OSError) as exc:
                notes.append(f"{m.name}'s data dir db {db} could not be read ({exc})")
        rec = record_path(cfg, m.name)
        try:
            with open_regular(rec) as fh:
                mid = BootstrapRecord.from_json(load_json(fh, max_bytes=65536), f"bootstrap record {rec}").member_id
            if not mid:
                raise ValueError("it names no member id")
            hosts.append(HostIds(f"{m.name}'s bootstrap record ({rec})", frozenset({int(mid, 16)})))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AgentError) as exc:  # AgentError: the record's ProtocolError
            notes.append(f"bootstrap record {rec} unreadable ({exc})")
    return hosts, notes


def gather(cfg: "Config", *, timeout: float = 2.0, local: bool = True) -> Evidence:
    """Everything this host can find; never raises."""
    from etcd_agent.etcd.client import EtcdClient
    from etcd_agent.etcd.lineage import LINEAGE_KEY

    running: Optional[Tuple[KnownMember, ...]] = None
    cluster_id: Optional[int] = None
    lineage: Tuple[FrozenSet[int], ...] = ()
    lineage_cids: FrozenSet[int] = frozenset()
    notes: List[str] = []
    try:
        with EtcdClient.from_config(cfg, timeout=timeout) as c:
            for url in cfg.client_urls:
                try:
                    cluster_id = c.status(url, timeout=timeout).cluster_id
                    listed = c.members(url)
                except AgentError:
                    continue
                running = tuple(KnownMember(x.id, x.name, x.peer_urls) for x in listed)
                try:
                    lineage, lineage_cids = parse_lineage(c.get(LINEAGE_KEY))
                except AgentError as exc:
                    notes.append(f"restore lineage unreadable ({exc.message})")
                break
    except AgentError as exc:
        notes.append(f"etcd not asked ({exc.message})")
    if running is None:
        notes.append("no configured etcd member answered: the running cluster's members are unknown")
    hosts: List[HostIds] = []
    if local:
        hosts, more = local_hosts(cfg)
        notes += more
    return Evidence(running, cluster_id, tuple(hosts), lineage, lineage_cids, tuple(notes))
