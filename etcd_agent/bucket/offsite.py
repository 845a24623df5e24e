"""The remote retention of delta chains (``[backup.remote]``): a chain's copies go with the copy
of the full backup it continues.

Segments and checkpoints are copied by the daemon's copy queue (``bucket.queue``,
``bucket.copier``) under ``chains/<key>/`` (``bucket.layout``) beside their full backup. Here:
which remote chains to delete once ``backup.remote.prune_remote`` has decided about the full
backups, one decision per chain with its reason - the chains under ``chains/``, and the legacy
``delta-<base revision>/`` prefixes written before that layout.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

from etcd_agent.chain import chains
from etcd_agent.config import Config

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.backup.retention import Decision

log = logging.getLogger(__name__)


def remote_chains(cfg: Config) -> Tuple[Dict[str, List[str]], Dict[int, List[str]]]:
    """(chain key -> its segment and checkpoint names, legacy base revision -> its segment names)."""
    from etcd_agent.bucket.remote import list_names

    return chains_of(list_names(cfg, ""))


def chains_of(names: List[str]) -> Tuple[Dict[str, List[str]], Dict[int, List[str]]]:
    """``remote_chains`` of the object ``names`` under the prefix (a listing already made)."""
    from etcd_agent.bucket import layout

    keyed: Dict[str, List[str]] = {}
    legacy: Dict[int, List[str]] = {}
    for name in names:
        p = layout.place(name)
        if p is None or p.kind == layout.FULL:
            continue  # full backups are prune_remote's
        if p.key:
            keyed.setdefault(p.key, []).append(name)
        elif p.legacy_revision is not None:
            legacy.setdefault(p.legacy_revision, []).append(name)
    return keyed, legacy


def _active(cfg: Config) -> Tuple[Set[str], Set[int]]:
    """The keys and the base revision of the chain this host's daemon is writing now."""
    directory = cfg.backup.dir
    active = chains.active_base(directory) if os.path.isdir(directory) else None
    if active is None:
        return set(), set()
    keys = {c.base_sha256 for c in chains.scan(directory).chains if c.base_revision == active and c.base_sha256}
    return keys, {active}


def prune_remote_chains(cfg: Config, kept_keys: Set[str], kept_revisions: Set[int], *,
                        dry_run: bool, listed: Optional[List[str]] = None) -> List["Decision"]:
    """Delete every remote chain whose full backup's copy is not kept (the chain being written
    here is kept); one decision per chain, with its reason. ``kept_keys``: the chains of the kept
    copies; ``kept_revisions``: their revisions (what a legacy ``delta-<revision>/`` is known by).
    ``listed``: the names under the prefix, when the caller listed them (else listed here)."""
    from etcd_agent.backup.retention import Decision
    from etcd_agent.bucket import layout
    from etcd_agent.bucket.remote import delete_names

    active_keys, active_revs = _active(cfg)
    keyed, legacy = remote_chains(cfg) if listed is None else chains_of(listed)
    groups: List[Tuple[str, List[str], bool, bool]] = []  # (label, names, kept, active)
    for key, names in sorted(keyed.items()):
        cps = sum(1 for n in names if (layout.place(n) or layout.Placed("", "")).kind == layout.CHECKPOINT)
        label = f"remote chain {layout.chain_dir(key)} ({len(names) - cps} segment(s), {cps} checkpoint(s))"
        groups.append((label, names, key in kept_keys, key in active_keys))
    for base, names in sorted(legacy.items()):
        label = f"legacy remote delta chain after revision {base} ({len(names)} segment(s))"
        groups.append((label, names, base in kept_revisions, base in active_revs))
    out: List[Decision] = []
    for label, names, kept, active in groups:
        if kept:
            out.append(Decision(label, True, ("its full backup's copy is kept",)))
        elif active:
            out.append(Decision(label, True, ("being written by this host's daemon right now",)))
        else:
            why = "no kept copy of the full backup it continues: the segments restore nothing without it"
            out.append(Decision(label, False, (why,)))
            if dry_run:
                log.info("would delete %s: %s", label, why)
            else:
                delete_names(cfg, names)
                log.info("deleted %s: %s", label, why)
    return out
