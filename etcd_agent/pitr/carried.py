"""A chain check carried to the restore that reads the same files, so a restore checks its chain
once (issue 34 item 4).

``restore --from-bucket`` checks the fetched files under a dir of its staging dir
(``restore.orchestrator.stagedchecks``), then hard-links them into the backup dir; verifying every
segment's bytes again there costs seconds on a long chain and proves nothing new: the files are
the same inodes. ``CheckedChain`` is that check (``prepare.Prepared``) with the identity (st_dev,
st_ino) of every file it read, taken before it read them; ``rerooted`` moves its paths to the
backup dir once linked; ``take`` hands it to the restore only if every file under its new name is
still the very inode that was checked - anything else (a file replaced, gone, or re-fetched as a
copy) and the restore checks the chain again, saying so loudly. Bytes changed inside the same
inode are the replay's to catch: it reads every segment again and compares its sha256 with the
check's (``replayrun._fold``), and the full backup and checkpoint are read and checked again by
the restore in any case.

An encrypted chain's check read its segments decrypted into a private dir (``workdirs``): that
dir and the one-replay lock held since are carried too, so the restore replays from the copies
the check made instead of decrypting (and checking) again, and no other run's sweep removes them
meanwhile. Whoever holds a ``CheckedChain`` releases it (``release``) unless ``take`` handed it on.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from etcd_agent.chain.check import ChainCheck
from etcd_agent.chain.segments import SegmentInfo
from etcd_agent.pitr.prepare import Prepared
from etcd_agent.pitr.replay import Plan, Target

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config
    from etcd_agent.state.locks import OperationLock

log = logging.getLogger(__name__)

Inode = Tuple[int, int]  # (st_dev, st_ino)


@dataclass(frozen=True)
class CheckedChain:
    """One verified check of a full backup's chain (``prepare``) and what it was asked: the
    restore takes it only for the same question (``take``)."""

    prepared: Prepared
    inodes: Tuple[Tuple[str, Inode], ...]  # every file the check read -> its inode before it was read
    checkpoints: bool
    accept_unsigned: bool
    private: Optional[str] = None  # the dir of the decrypted segments the check read (an encrypted chain)
    lock: Optional["OperationLock"] = None  # the one-replay lock, held since the check (``workdirs.lock``)

    def release(self) -> None:
        """The decrypted copies removed and the lock let go (both again harmless)."""
        if self.private is not None:
            shutil.rmtree(self.private, ignore_errors=True)
        if self.lock is not None:
            self.lock.release()


def inode(path: str) -> Optional[Inode]:
    """The file ``path`` names (not a link to one): None when there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def read_by(prep: Prepared) -> List[str]:
    """The files a restore of ``prep`` reads: the full backup, the checkpoint it starts from and
    the chain's segments (those after a stop too: the replay is handed them) - an encrypted one's
    file, not its decrypted copy."""
    out = [prep.entry.path] + ([prep.start.path] if prep.start is not None else [])
    out += [s.disk_path for s in prep.check.segments] + list(prep.check.lost)
    return out


def carry(prep: Prepared, before: Dict[str, Optional[Inode]], *, checkpoints: bool, accept_unsigned: bool,
          private: Optional[str] = None, lock: Optional["OperationLock"] = None) -> Optional[CheckedChain]:
    """``prep`` carried, its files' inodes as ``before`` (taken before the check read them) and
    still now, with the ``private`` dir of its decrypted segments and the ``lock`` that keeps it
    (the result owns both); None - the restore checks again, the caller keeps both - when a file
    is not in ``before`` or was replaced during the check, or decrypted copies have no dir."""
    if private is None and any(s.sealed is not None for s in prep.check.segments):
        return None
    inodes = []
    for path in read_by(prep):
        was = before.get(path)
        if was is None or inode(path) != was:
            log.warning("%s changed while the chain was checked: the restore checks it again", path)
            return None
        inodes.append((path, was))
    return CheckedChain(prep, tuple(inodes), checkpoints, accept_unsigned, private, lock)


def rerooted(c: CheckedChain, old: str, new: str) -> CheckedChain:
    """``c`` with its paths under the dir ``old`` moved under ``new`` (the files hard-linked
    there: the same inodes, which ``take`` checks)."""
    def moved(path: str) -> str:
        rel = os.path.relpath(path, old)
        return path if rel.startswith(os.pardir) else os.path.join(new, rel)

    def seg(s: SegmentInfo) -> SegmentInfo:  # an opened encrypted one's path is its copy: not under ``old``
        sealed = dataclasses.replace(s.sealed, path=moved(s.sealed.path)) if s.sealed is not None else None
        return dataclasses.replace(s, path=moved(s.path), sealed=sealed)

    p = c.prepared
    check: ChainCheck = dataclasses.replace(
        p.check, segments=tuple(seg(s) for s in p.check.segments), lost=tuple(moved(x) for x in p.check.lost),
        passed=tuple((moved(x), why) for x, why in p.check.passed))
    plan: Plan = dataclasses.replace(p.plan, segments=tuple(seg(s) for s in p.plan.segments))
    start = dataclasses.replace(p.start, path=moved(p.start.path)) if p.start is not None else None
    prep = dataclasses.replace(p, entry=dataclasses.replace(p.entry, path=moved(p.entry.path)), check=check,
                               plan=plan, start=start)
    return dataclasses.replace(c, prepared=prep, inodes=tuple((moved(x), i) for x, i in c.inodes))


def take(c: Optional[CheckedChain], cfg: "Config", spec: str, target: Target, *, checkpoints: bool,
         accept_unsigned: bool, progress: Callable[[str], None]) -> Optional[CheckedChain]:
    """The carried check for a restore of ``spec`` to ``target`` from ``cfg``'s backup dir, when
    it answers that very question about these very files: the caller then owns its dir and lock.
    None (check again) otherwise, ``c`` released."""
    if c is None:
        return None
    p = c.prepared
    if (p.entry.name != spec or p.target != target or c.checkpoints != checkpoints
            or c.accept_unsigned != accept_unsigned
            or os.path.dirname(os.path.abspath(p.entry.path)) != os.path.abspath(cfg.backup.dir)):
        log.info("the chain check made before the files were let in is not this restore's: checking again")
        c.release()
        return None
    swapped = [os.path.basename(path) for path, was in c.inodes if inode(path) != was]
    if swapped:
        why = (f"{', '.join(swapped[:3])}{f' and {len(swapped) - 3} more' if len(swapped) > 3 else ''} in "
               f"{cfg.backup.dir} is not the file that was checked before it was let in (another file, or none, "
               "under its name now): the chain is checked again")
        log.warning("%s", why)
        progress(why)
        c.release()
        return None
    progress(f"delta chain: checked once, before it was let in ({len(p.check.segments)} segment(s), the same files "
             f"in the backup dir now{', decrypted once' if c.private is not None else ''}): not read twice")
    return c
