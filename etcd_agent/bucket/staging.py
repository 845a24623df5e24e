"""The one way objects come in from the bucket, for ``backup fetch`` and ``restore --from-bucket``
alike: every object of a plan staged ``FETCH_WORKERS`` at a time into the private staging dir
(``fetch.stage_one``: size and sha256 checked as it streams, a killed run's part continued), each
segment's name checked against what it holds, and only then each file linked into the backup dir
(``fetch.publish``). The first failure while staging stops what has not begun and is said in one
sentence with how far the fetch got (``Stopped``); a refusal of the content removes the staged
bytes, a fault keeps them for the same command to continue.

``backup fetch`` (``fetch_into``) checks no more than the names: it restores nothing, and
``backup verify`` / ``restore --from`` check the files as any local backup. ``restore
--from-bucket`` checks the content too, still in the staging dir (``restore.orchestrator.
stagedchecks``), before it publishes.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

from etcd_agent.bucket import fetch, layout
from etcd_agent.errors import AgentError, BackupCorrupt, BackupError, RefusedError
from etcd_agent.fs import size_text

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.bucket.client import Bucket
    from etcd_agent.config import Config

log = logging.getLogger(__name__)

FETCH_WORKERS = 4  # objects fetched at once
PROGRESS_EVERY = 2.0  # seconds between two progress lines of one object


class Stopped(Exception):
    """The first failure of a staging run, once the objects in flight have ended."""

    def __init__(self, error: AgentError, done: int, total: int) -> None:
        super().__init__(error.message)
        self.error, self.done, self.total = error, done, total

    def sentence(self, command: str, outcome: str) -> AgentError:
        """The error, its message saying how far the fetch got and what was not done; for a fault
        (not bytes refused) that the same command continues."""
        exc = self.error
        exc.message = (f"{command}: {self.done} of {self.total} object(s) fetched, then: "
                       f"{exc.message.rstrip('.')}; {outcome}" + (  # botocore's texts end in "."
                           "" if isinstance(exc, (RefusedError, BackupCorrupt)) else
                           " - the same command continues the fetch where it stopped"))
        return exc


def fetch_into(cfg: "Config", items: Sequence[fetch.Wanted], *,
               progress: Callable[[str], None] = lambda s: None) -> List[fetch.Fetched]:
    """``backup fetch``: ``items`` staged, their segments' names checked, then every file linked
    into the backup dir under its own name; nothing is linked unless all were staged and passed.
    RefusedError for a segment whose name lies (its staged bytes removed)."""
    from etcd_agent.bucket.client import Bucket

    directory = cfg.backup.dir
    with fetch.staging_locked(directory):
        try:
            staged = stage_all(cfg, items, directory, progress)
        except Stopped as stop:
            raise stop.sentence("backup fetch", f"nothing moved into {directory}") from None
        try:
            named_as_they_hold(staged, lambda s: s.part or os.path.join(directory, s.file),
                               f"nothing moved into {directory}")
        except RefusedError:
            for s in staged:  # bytes that failed a check are not kept to be continued
                if s.part is not None:
                    fetch.discard_part(s.part)
            raise
        b = Bucket(cfg)
        return [fetch.publish(b, s, directory) for s in staged]


def stage_all(cfg: "Config", items: Sequence[fetch.Wanted], directory: str,
              progress: Callable[[str], None], *, since: Optional[float] = None) -> List[fetch.Staged]:
    """Every object staged, ``FETCH_WORKERS`` at a time (a chain is hundreds of small segments:
    one at a time, the round trips, not the bytes, set the pace), in the plan's order; the first
    failure stops what has not begun and is raised (``Stopped``) once the others in flight have
    ended. Each object's leg (``Fetched.began``, ``seconds``) is timed from ``since`` (a
    ``time.monotonic()``; now by default). The caller holds ``fetch.staging_locked(directory)``."""
    from etcd_agent.bucket.client import Bucket

    since = time.monotonic() if since is None else since
    room(cfg, items, directory)
    local = threading.local()
    stop = threading.Event()

    def one(i: int, w: fetch.Wanted) -> Optional[fetch.Staged]:
        if stop.is_set():
            return None
        if not hasattr(local, "bucket"):  # a Bucket's per-object deadline is its own: one per thread
            local.bucket = Bucket(cfg)
        try:
            return _stage(local.bucket, w, directory, f"[{i}/{len(items)}]", progress, since)
        except Exception:
            stop.set()
            raise

    ex = ThreadPoolExecutor(max_workers=FETCH_WORKERS, thread_name_prefix="fetch")
    futures = [ex.submit(one, i, w) for i, w in enumerate(items, 1)]
    out: List[fetch.Staged] = []
    first: Optional[BaseException] = None
    try:
        for f in futures:
            try:
                got = f.result()
            except Exception as exc:  # re-raised below, once the others in flight have ended
                first = first or exc
                continue
            if got is not None:
                out.append(got)
    except BaseException:  # Ctrl-C: nothing more begins; a part in flight is continued by the next run
        stop.set()
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
    if first is not None:
        if isinstance(first, AgentError):
            raise Stopped(first, len(out), len(items))
        raise first
    return out


def still_to_fetch(items: Sequence[fetch.Wanted], directory: str) -> int:
    """The listed bytes not yet here: nothing for a file already in the backup dir (it is compared,
    not fetched), the rest of a part a killed run left in the staging dir."""
    staging = os.path.join(directory, fetch.STAGING)
    need = 0
    for w in items:
        if os.path.lexists(os.path.join(directory, w.file)):
            continue
        try:
            have = os.lstat(os.path.join(staging, w.file + ".part")).st_size
        except OSError:
            have = 0
        need += max(0, w.size - have)
    return need


def room(cfg: "Config", items: Sequence[fetch.Wanted], directory: str) -> None:
    """The whole plan fits in the staging dir's filesystem with ``[backup] space_margin`` to spare,
    or RefusedError before anything is fetched. Objects are staged 4 at once: each one's own check
    (``fetch.stage_one``) sees the space before the others fill it, and the backup dir often shares
    its filesystem with etcd's data dir, which must never be the one to find it full."""
    need = still_to_fetch(items, directory)
    want = int(need * (1 + cfg.backup.space_margin))
    where = directory
    while not os.path.isdir(where) and os.path.dirname(where) != where:  # a dry run on a new master: made later
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    if need and free < want:
        raise RefusedError(
            f"not enough space in {directory}: {size_text(free)} free, the {len(items)} object(s) still to fetch "
            f"need {size_text(want)} ({size_text(need)} + {cfg.backup.space_margin:.0%} margin); nothing fetched")


def _stage(b: "Bucket", w: fetch.Wanted, directory: str, counter: str,
           progress: Callable[[str], None], since: float) -> fetch.Staged:
    """One object staged, with a line when it begins, every ``PROGRESS_EVERY`` seconds of a long
    one (bytes, MB/s, ETA) and when it is whole; its leg timed from ``since``."""
    began = time.monotonic()
    last = [began]
    start_at = [-1]

    def tick(done: int, total: int) -> None:
        now = time.monotonic()
        if start_at[0] < 0:
            start_at[0] = done  # a continued part: its first bytes were not read now
        if now - last[0] < PROGRESS_EVERY:
            return
        last[0] = now
        rate = (done - start_at[0]) / max(now - began, 1e-6)
        eta = (total - done) / rate if rate > 0 else float("inf")
        progress(f"{counter} {w.file}: {size_text(done)} of {size_text(total)}, {rate / 1e6:.1f} MB/s, ETA "
                 f"{'?' if eta == float('inf') else f'{eta:.0f}s'}")

    progress(f"{counter} fetching {w.name} ({size_text(w.size)})")
    s = fetch.stage_one(b, w, directory, progress=tick)
    took = time.monotonic() - began
    if s.fetched.how == "already here":
        progress(f"{counter} {w.file}: already in {directory} with the same bytes")
    else:
        at = f", continued at byte {s.fetched.resumed_at}" if s.fetched.resumed_at else ""
        progress(f"{counter} {w.file}: {size_text(s.bytes_read)} in {took:.1f}s "
                 f"({s.bytes_read / max(took, 1e-6) / 1e6:.1f} MB/s{at}), sha256 matches its metadata")
    return dataclasses.replace(s, fetched=dataclasses.replace(s.fetched, began=began - since, seconds=took))


def named_as_they_hold(staged: Sequence[fetch.Staged], where: Callable[[fetch.Staged], str], outcome: str) -> None:
    """Each segment's name says the revisions (and end time) its header and footer hold (read
    from ``where(s)``). The chain is followed by content, so two segments swapped under each
    other's names would replay right, but they would enter the backup dir under names that lie
    to everything that reads names (listings, retention, the choice of what a later restore
    fetches): RefusedError, its sentence ending in ``outcome``. A segment whose header or footer
    cannot be read is left to what reads its content (the chain check of a restore, ``backup
    list``, which names it damaged)."""
    from etcd_agent.chain.reader import read_summary
    from etcd_agent.chain.segments import name_time_ms, parse_name

    for s in staged:
        if s.fetched.wanted.kind != layout.SEGMENT:
            continue
        named = parse_name(s.file)
        try:
            header, footer = read_summary(where(s))
        except BackupError:
            continue
        holds = (header.start_revision, footer.end_revision)
        when = name_time_ms(s.file)  # to the ms, or to the second in a name without them
        if named is not None and (holds != named or when not in (footer.end_time_ms, footer.end_time_ms // 1000 * 1000)):
            raise RefusedError(
                f"{s.fetched.wanted.name} in the bucket holds revisions {holds[0]}-{holds[1]} ending "
                f"{_ms_text(footer.end_time_ms)} under a name that says {named[0]}-{named[1]} ending "
                f"{_ms_text(when)}: renamed, or swapped with another segment; {outcome}")


def _ms_text(ms: Optional[int]) -> str:
    from etcd_agent.chain.segments import ms_to_datetime

    return "?" if ms is None else ms_to_datetime(ms).isoformat(timespec="milliseconds")


def checkpoints_kept(cfg: "Config", items: Sequence[fetch.Wanted]) -> Tuple[List[fetch.Wanted], List[str]]:
    """What ``backup fetch`` brings of ``items`` (a ``fetch.plan``): all but the chain's older
    checkpoints, and a line for those left in the bucket. The bucket keeps every checkpoint of a
    chain until the chain goes; the backup dir keeps the newest ``[backup.delta]
    checkpoint_keep`` of a chain (``retention.plan_checkpoints``), as the master that copied
    them did. More would each cost a full backup's size, to be deleted by the next prune here;
    a point-in-time restore before the oldest one kept replays from the full backup."""
    from etcd_agent.backup.catalog import name_time

    keep = cfg.backup.delta.checkpoint_keep

    def when(w: fetch.Wanted) -> Tuple[float, str]:
        t = name_time(w.file, cfg.backup.utc)
        return (t.timestamp() if t is not None else float("-inf")), w.file

    older = sorted((w for w in items if w.kind == layout.CHECKPOINT), key=when, reverse=True)[keep:]
    if not older:
        return list(items), []
    left = set(older)
    return [w for w in items if w not in left], [
        f"{len(older)} object(s), {size_text(sum(w.size for w in older))}: older checkpoints of the chain, left in "
        f"the bucket - the backup dir keeps the newest {keep} checkpoint(s) of a chain ([backup.delta] "
        "checkpoint_keep); a point-in-time restore before them replays from the full backup"]
