"""Off-host copies of delta segments (``[backup.remote]``), uploaded as they close.

A segment goes to ``<prefix>delta-<full backup revision, 16 digits>/<segment name>``, verified as
every copy is (``backup.remote.upload_file``: server checksums or a read-back; a bad copy is
deleted) with its sha256 in the object's metadata. The ``Uploader`` thread takes closed segments
from the watcher and retries failures with backoff, so a slow or absent bucket never holds up
the watch; when a chain starts (or resumes) it first uploads whatever of that chain the bucket
lacks (a restart, an earlier outage). ``RemoteFollower`` starts, stops or redirects it the tick
after a reload enables, disables or changes ``[backup.remote]``, and says so. Remote chains are
pruned with the remote copy of their full backup (``prune_remote_chains``, called by
``backup.remote.prune_remote``).
"""
from __future__ import annotations

import logging
import os
import queue
import re
import threading
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set, Tuple

from etcd_agent.chain import chains
from etcd_agent.chain.reader import read_header
from etcd_agent.chain.segments import list_segments, parse_name
from etcd_agent.config import Config, Member, RemoteSection
from etcd_agent.errors import AgentError

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.backup.retention import Decision

log = logging.getLogger(__name__)

DIR_RE = re.compile(r"^delta-(\d{16})/(.+)$")
MAX_BACKOFF = 60.0


def remote_name(base_revision: int, path: str) -> str:
    return f"delta-{base_revision:016d}/{os.path.basename(path)}"


def upload_segment(cfg: Config, path: str, base_revision: int) -> str:
    """Copy one segment; returns the check that verified the copy (``backup.remote.CHECKS``)."""
    from etcd_agent.bucket.remote import upload_file

    h = read_header(path)
    return upload_file(cfg, path, remote_name(base_revision, path), lambda sha: {
        "sha256": sha, "base-revision": str(base_revision), "chain-id": h.chain_id, "seq": str(h.seq),
    }).verified_by


def remote_chains(cfg: Config) -> Dict[int, List[str]]:
    """base revision -> the segment names in the bucket."""
    from etcd_agent.bucket.remote import list_names

    out: Dict[int, List[str]] = {}
    for name in list_names(cfg, "delta-"):
        m = DIR_RE.match(name)
        if m and parse_name(m.group(2)) is not None:
            out.setdefault(int(m.group(1)), []).append(name)
    return out


def prune_remote_chains(cfg: Config, kept_revisions: Set[int], *, dry_run: bool) -> List["Decision"]:
    """Delete every remote chain whose full backup's copy is not kept (the chain being written
    here is kept); one decision per chain, with its reason."""
    from etcd_agent.backup.retention import Decision
    from etcd_agent.bucket.remote import delete_names

    active = chains.active_base(cfg.backup.dir) if os.path.isdir(cfg.backup.dir) else None
    out: List[Decision] = []
    for base, names in sorted(remote_chains(cfg).items()):
        label = f"remote delta chain after revision {base} ({len(names)} segment(s))"
        if base in kept_revisions:
            out.append(Decision(label, True, ("its full backup's copy is kept",)))
        elif base == active:
            out.append(Decision(label, True, ("being written by this host's daemon right now",)))
        else:
            why = "no kept copy of a full backup at this revision: the segments restore nothing without it"
            out.append(Decision(label, False, (why,)))
            if dry_run:
                log.info("would delete %s: %s", label, why)
            else:
                delete_names(cfg, names)
                log.info("deleted %s: %s", label, why)
    return out


class Uploader:
    """Uploads closed segments on a thread of its own; ``pending`` and ``failures`` for metrics."""

    def __init__(self, source: Callable[[], Tuple[Config, Member]]) -> None:
        self._source = source
        self._q: "queue.Queue[Tuple[str, str, int]]" = queue.Queue()  # (kind, path, base)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.pending = 0
        self.failures = 0
        self.uploaded = 0
        self.verified: Dict[str, int] = {}  # copies by the check that verified them (a metric label)
        self._mu = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="delta-upload", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._q.put(("stop", "", 0))
        if self._thread is not None:
            self._thread.join(timeout)

    def enqueue(self, path: str, base_revision: int) -> None:
        with self._mu:
            self.pending += 1
        self._q.put(("segment", path, base_revision))

    def sync(self, base_revision: int) -> None:
        """Upload whatever of this chain the bucket lacks (before the watch adds to it)."""
        self._q.put(("sync", "", base_revision))

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            kind, path, base = self._q.get()
            if kind == "stop":
                return
            try:
                cfg = self._source()[0]
                if not cfg.backup.remote.enabled:  # a reload disabled copies: RemoteFollower stops this thread
                    if kind == "segment":
                        with self._mu:
                            self.pending -= 1
                    continue
                if kind == "sync":
                    self._sync(cfg, base)
                elif os.path.exists(path):  # a pruned segment needs no copy
                    check = upload_segment(cfg, path, base)
                    self.uploaded += 1
                    self.verified[check] = self.verified.get(check, 0) + 1
                if kind == "segment":
                    with self._mu:
                        self.pending -= 1
                backoff = 1.0
            except (AgentError, OSError) as exc:
                self.failures += 1
                msg = getattr(exc, "message", None) or str(exc)
                log.warning("delta: off-host copy of %s failed: %s; retrying in %.0fs", path or f"chain {base}",
                            msg, backoff)
                self._q.put((kind, path, base))
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    def _sync(self, cfg: Config, base: int) -> None:
        have = {n.split("/", 1)[1] for n in remote_chains(cfg).get(base, [])}
        for p in list_segments(cfg.backup.dir):
            if os.path.basename(p) in have:
                continue
            try:
                if read_header(p).base_revision != base:
                    continue
            except AgentError:
                continue  # damaged: `backup list` reports it; it is not worth a copy
            self.enqueue(p, base)


class RemoteFollower:
    """``[backup.remote]`` as the running config has it, followed at once (the supervisor's next
    tick, a second after a reload): enabled starts an uploader, disabled stops it, changed (an
    endpoint, bucket, prefix, key) sends the next copies to the new place; each is logged. The
    running chain's segments the bucket lacks are queued (``sync``) when copies start or move."""

    def __init__(self) -> None:
        self._seen: Optional[RemoteSection] = None
        self._started = False

    def follow(self, cfg: Config, uploader: Optional[Uploader], source: Callable[[], Tuple[Config, Member]],
               base: Optional[int]) -> Optional[Uploader]:
        """The uploader to use from now on (``base``: the running chain's full backup revision)."""
        r = cfg.backup.remote
        if self._started and r == self._seen:
            return uploader
        before, self._seen, reloaded = self._seen, r, self._started
        self._started = True
        if r.enabled and uploader is None:
            uploader = Uploader(source)
            uploader.start()
            if reloaded:
                log.info("delta: [backup.remote] enabled by the reloaded config: segments are copied to %s from now "
                         "on%s", _where(cfg), ", the running chain's too" if base is not None else "")
        elif not r.enabled and uploader is not None:
            uploader.stop(timeout=0.1)  # an upload under way ends by itself, bounded by its deadline
            log.info("delta: [backup.remote] disabled by the reloaded config: segments are no longer copied "
                     "off-host (%d waiting were dropped)", uploader.pending)
            return None
        elif r.enabled and uploader is not None and before is not None and before != r:
            log.info("delta: [backup.remote] changed by the reloaded config: segments are copied to %s from now "
                     "on%s", _where(cfg), ", with the running chain's segments the bucket lacks" if base is not None else "")
        else:
            return uploader
        if uploader is not None and base is not None:
            uploader.sync(base)
        return uploader


def _where(cfg: Config) -> str:
    from etcd_agent.bucket.client import expand_prefix

    r = cfg.backup.remote
    return f"s3://{r.bucket}/{expand_prefix(r.prefix, cfg.cluster.name)}"
