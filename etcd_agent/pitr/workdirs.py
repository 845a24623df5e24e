"""Where a point-in-time restore works on this host, and its housekeeping: ``<backup dir>/.pitr``
(the replay's throwaway etcd, the kept result) or, for an encrypted backup or chain, a private dir
under the daemon's state dir (the backup dir is copied off-host, so it never holds plaintext);
the lock that lets one replay run at a time, and what a killed run left found and removed.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, List

from etcd_agent.fs import makedirs
from etcd_agent.scratch.leftovers import remove_left
from etcd_agent.state.locks import CLEANUP, SHORT_WAIT, OperationLock

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config

log = logging.getLogger(__name__)

PITR_DIR = ".pitr"
PRIVATE_DIR = "decrypted"  # under [daemon] state_dir: the plaintext of encrypted backups and chains
OPEN_PREFIX = "etcd-open-"  # a restore's decrypted segments, under PRIVATE_DIR
# what a replay makes in its work dir: a dead run's are removed (``sweep``)
TAIL_PREFIX = "etcd-tail-"  # a tail folded for the restored members (``pitr.members``)
WORK_PREFIXES = ("etcd-replay-", "etcd-scratch-", OPEN_PREFIX, TAIL_PREFIX)


def pitr_dir(cfg: "Config") -> str:
    return os.path.join(cfg.backup.dir, PITR_DIR)


def private_dir(cfg: "Config") -> str:
    """Where the plaintext of an encrypted backup or chain is staged: a 0700 dir outside the
    backup dir (copied off-host, backed up by other tools), removed when the restore ends."""
    return os.path.join(cfg.daemon.state_dir, PRIVATE_DIR)


def work_dir(cfg: "Config", encrypted: bool) -> str:
    """A replay's work dir (its throwaway etcd, its kept result), made 0700."""
    d = private_dir(cfg) if encrypted else pitr_dir(cfg)
    makedirs(d, 0o700)
    return d


def in_work_dir(cfg: "Config", path: str) -> bool:
    """``path`` (absolute) lies directly in ``pitr_dir`` or ``private_dir``: what a crashed
    point-in-time restore's journal may name (a kept replay, a tail's record)."""
    return os.path.dirname(path) in (os.path.abspath(pitr_dir(cfg)), os.path.abspath(private_dir(cfg)))


def lock(cfg: "Config") -> OperationLock:
    """One point-in-time restore at a time on this host (held from the replay to the restore's
    end: the kept replay is its own); what a dead one left in ``.pitr`` is cleared."""
    held = _lock(cfg, "point-in-time replay", wait=SHORT_WAIT)  # past another command's ``clean``
    sweep(cfg)
    return held


def _lock(cfg: "Config", operation: str, wait: float = 0.0) -> OperationLock:
    d = pitr_dir(cfg)
    makedirs(d, 0o700)
    return OperationLock(os.path.join(d, ".lock"), operation).acquire(wait=wait)


def sweep(cfg: "Config") -> List[str]:
    """What dead runs left (call it holding ``lock``): the etcds still running in their work dirs
    are stopped and the dirs removed - decrypted segments, scratch data - and the decrypted
    backups of readers that died; the paths removed."""
    from etcd_agent.backup.reader import remove_stale_stages

    removed = [os.path.join(pitr_dir(cfg), n) for n in remove_left(pitr_dir(cfg), WORK_PREFIXES)]
    private = private_dir(cfg)
    if os.path.isdir(private):
        removed += [os.path.join(private, n) for n in remove_left(private, WORK_PREFIXES)]
        removed += [os.path.join(private, n) for n in remove_stale_stages(private)]
    if removed:
        log.warning("removed what a killed point-in-time restore left: %s", ", ".join(removed))
    return removed


def leftovers(cfg: "Config") -> List[str]:
    """What a killed point-in-time restore left on this host, one line each (``status``): its
    work dirs, their size, whether they hold plaintext, the etcds still running in them. [] while
    a replay runs (they are its own). The next command of any kind removes them (``clean``)."""
    from etcd_agent.backup.reader import stale_stages
    from etcd_agent.scratch.leftovers import etcds_in, left_dirs

    if not lock_free(cfg):
        return []
    private = private_dir(cfg)
    found = [(d, False) for d in left_dirs(pitr_dir(cfg), WORK_PREFIXES)]
    found += [(d, True) for d in left_dirs(private, WORK_PREFIXES)]
    found += [(os.path.join(private, n), True) for n in stale_stages(private)]
    lines = []
    for d, plain in found:
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(d) for f in fs
                   if os.path.isfile(os.path.join(r, f)))
        pids = [p.pid for p in etcds_in([d])]
        lines.append(f"{d}: {size / 1e6:.1f} MB{' of decrypted (plaintext) data' if plain else ''}"
                     + (f"; etcd pid {', '.join(map(str, pids))} still running in it" if pids else ""))
    return lines


def clean(cfg: "Config") -> List[str]:
    """``sweep`` when no replay runs; what it removed. Creates nothing: without ``.pitr`` no
    replay ever ran here, and only the decrypted copies of dead readers can be left."""
    from etcd_agent.backup.reader import remove_stale_stages
    from etcd_agent.errors import BusyError

    if not os.path.isdir(pitr_dir(cfg)):
        private = private_dir(cfg)
        return [os.path.join(private, n) for n in remove_stale_stages(private)]
    try:
        held = _lock(cfg, CLEANUP)
    except BusyError:
        return []  # a replay runs: its dirs are its own
    try:
        return sweep(cfg)
    finally:
        held.release()


def lock_free(cfg: "Config") -> bool:
    """No point-in-time replay runs on this host (its dirs are then a dead run's)."""
    from etcd_agent.state.locks import held_by

    return held_by(os.path.join(pitr_dir(cfg), ".lock")) is None


def open_staging(cfg: "Config") -> str:
    """A private (0700) dir under ``private_dir`` for the decrypted segments of one restore; call
    it holding ``lock`` and remove it (``shutil.rmtree``) when the replay is done."""
    import tempfile

    return tempfile.mkdtemp(prefix=OPEN_PREFIX, dir=work_dir(cfg, True))

