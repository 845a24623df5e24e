"""The daemon's checkpoints: full backups taken inside the running delta chain, which the chain
then vouches for (``segments.Checkpoint``; docs/delta-segments.md, "Checkpoints"), so that a
point-in-time restore replays only what follows the newest one. ``due`` says when (pure),
``take`` takes one for a running watch; the supervisor counts the chain's growth between them."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional

from etcd_agent.chain.segments import Checkpoint, parse_name
from etcd_agent.errors import AgentError, BusyError
from etcd_agent.memory import release_freed_memory

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.chain.chains import ChainSummary
    from etcd_agent.config import Config, DeltaSection
    from etcd_agent.continuous.watcher import DeltaWatcher

log = logging.getLogger(__name__)

# a chain grows by at least this much between two checkpoints, whatever the full backup's size (a
# near-empty cluster's, or one whose size is unknown): a checkpoint of a few events saves nothing
MIN_GROWTH = 1 << 20


def due(d: "DeltaSection", grown: int, full_size: int, since_last: float, full_name: str) -> str:
    """Why the running chain wants a checkpoint now ("" it does not): it grew by ``grown`` bytes
    (segments with events) since its start or last checkpoint, ``since_last`` seconds ago, and
    its full backup is ``full_size`` bytes. At least ``MIN_GROWTH`` in any case."""
    if d.checkpoint_ratio <= 0:
        return ""
    if grown < max(int(d.checkpoint_ratio * full_size), MIN_GROWTH) or since_last < d.checkpoint_min_seconds:
        return ""
    return f"the chain grew by {grown} bytes since its last checkpoint ({d.checkpoint_ratio:g} x {full_name})"


def take(cfg: "Config", member: str, w: "DeltaWatcher") -> Optional[Checkpoint]:
    """A lease census, a full backup inside ``w``'s chain, and the checkpoint handed to ``w`` to
    vouch for once it has written through its revision and checked the member again. None when
    none was taken (said in the log; the chain goes on and the next try waits)."""
    from etcd_agent.backup.outstream import low_memory
    from etcd_agent.backup.service import take_backup

    chain_id = w.pos.chain_id
    wait = cfg.backup.delta.checkpoint_min_seconds
    leases_from = w.lease_census()
    if leases_from is None:
        log.warning("delta: checkpoint not taken: the watch could not observe every lease first (a replay from it "
                    "would lack their TTLs); the next try in %.0fs", wait)
        return None
    try:
        with low_memory():
            res = take_backup(cfg, member=member, origin="daemon", checkpoint_of=chain_id)
    except AgentError as exc:  # busy (cron's backup) or failed: the chain goes on without it
        log.log(logging.INFO if isinstance(exc, BusyError) else logging.WARNING,
                "delta: checkpoint not taken: %s; the chain goes on, the next try in %.0fs", exc.message, wait)
        return None
    finally:
        release_freed_memory()
    if res.revision is None or not res.sha256:
        log.warning("delta: checkpoint %s has no known revision or sha256: the chain cannot vouch for it", res.path)
        return None
    cp = Checkpoint(os.path.basename(res.path), res.sha256, res.revision, min(leases_from, res.revision))
    if w.running and w.pos.chain_id == chain_id:
        w.vouch(cp)
        log.info("delta: checkpoint %s (revision %d) taken inside chain %s; the chain vouches for it once it has "
                 "written that far", res.path, res.revision, chain_id[:8])
    else:
        log.info("delta: checkpoint %s taken, but its chain's watch ended meanwhile: never vouched for, never used "
                 "by a restore", res.path)
    return cp


def bytes_since(cfg: "Config", chain: "ChainSummary") -> int:
    """Bytes of ``chain``'s segments with events after its newest checkpoint here (all of them
    without one): where a resumed watch's next checkpoint counts from."""
    from etcd_agent.backup import catalog, keys

    entries = catalog.list_backups(cfg.backup.dir, utc=cfg.backup.utc, key=keys.local_key(cfg).key)
    revs = [e.revision for e in catalog.good(entries) if e.checkpoint_of == chain.chain_id and e.revision is not None]
    after = max(revs, default=chain.base_revision)
    total = 0
    for p in chain.paths:
        rng = parse_name(os.path.basename(p))
        if rng is not None and rng[1] > after and rng[1] >= rng[0]:  # idle segments hold nothing to fold
            try:
                total += os.path.getsize(p)
            except OSError:
                pass
    return total
