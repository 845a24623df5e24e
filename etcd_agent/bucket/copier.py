"""Copies that always land: the daemon's copy queue, and ``backup push``.

``push`` copies what ``queue.plan`` finds pending, in its order, and stops at the first copy
that fails (an outage fails them all, and a segment must not land before its full backup).
``Copier`` runs ``push`` on a thread of its own in the daemon: again at once when nudged (a
segment closed, a full backup or a checkpoint appeared), else every ``RESCAN_EVERY`` seconds,
and after a failure with a back-off (``waiting.Backoff``, 1 s doubling to 60 s) until the copies
land or their files are pruned. It logs when copies start failing and one line when they resume.

What it sees is kept in a ``CopyStatus``: for the metrics (``BucketCollector``, on the daemon's
endpoint and in its textfile) and, written beside the backups (``STATUS_FILE``, a report only:
the queue itself is always derived again), for ``etcd-agent status`` in another process.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from etcd_agent.bucket import layout, queue
from etcd_agent.config import Config, Member
from etcd_agent.errors import AgentError, BackupCorrupt, ProtocolError
from etcd_agent.typedjson import Document
from etcd_agent.waiting import Backoff

if TYPE_CHECKING:  # pragma: no cover
    from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

RESCAN_EVERY = 30.0
STATUS_FILE = ".etcd-agent-bucket.json"
MAX_STATUS_BYTES = 64 * 1024
MAX_ERROR = 500  # characters of the last error kept (a status line, a metric label)
PREFIX = "etcd_agent_bucket_"
LISTING = "(listing the bucket)"  # what a pass that could not read the bucket stopped at


@dataclass(frozen=True)
class CopyStatus(Document):
    """The copy queue as its last pass left it."""

    enabled: bool = False
    at: float = 0.0  # Unix s this status was made
    pending: int = 0  # objects still to copy
    pending_bytes: int = 0
    pending_revisions: int = 0  # revisions held by the pending segments (the off-host RPO in revisions)
    oldest_pending_since: Optional[float] = None  # Unix s the oldest pending file appeared
    failing_since: Optional[float] = None  # Unix s of the first failure in a row (None: not failing)
    last_error: str = ""  # the last failure, credentials scrubbed ("" none since the last success)
    last_copy: Optional[float] = None  # Unix s of the last copy that landed
    copied_total: int = 0  # by this daemon since it started
    failures_total: int = 0
    unplaced: int = 0  # files that cannot be placed in the bucket (logged once each)
    # the lag is known only from a listing: while the bucket cannot be listed, the pending fields
    # hold what is surely not copied (a lower bound: ``Copier._surely_pending``)
    listed_at: Optional[float] = None  # Unix s of the last listing (None: not since the daemon started)
    unreachable_since: Optional[float] = None  # Unix s the listings started failing (None: the last worked)
    # copies by the check that verified them (checksum, etag, read-back): a metric's label
    verified: Dict[str, int] = field(default_factory=dict)

    def oldest_pending_seconds(self, now: Optional[float] = None) -> float:
        if self.oldest_pending_since is None or not self.pending:
            return 0.0
        return max(0.0, (self.at if now is None else now) - self.oldest_pending_since)

    @property
    def up(self) -> bool:
        """The last pass listed the bucket: the pending fields are what the bucket lacks."""
        return self.listed_at is not None and self.unreachable_since is None

    def describe(self, now: float) -> str:
        """One line for ``etcd-agent status``."""
        if not self.enabled:
            return "off-host copies: disabled in the daemon's config"
        seen = f"(as the daemon saw it {max(0.0, now - self.at):.0f}s ago)"
        if self.unreachable_since is not None:
            if self.listed_at is None:
                lag = "lag unknown (the bucket has not been listed since the daemon started)"
            else:
                lag = (f"lag at least {self.oldest_pending_seconds(now):.0f}s, {self.pending_revisions} revision(s), "
                       f"{self.pending} object(s) (last listed {max(0.0, now - self.listed_at):.0f}s ago)")
            failing = f"FAILING since {_utc(self.failing_since)} ({self.failures_total} failure(s)): " \
                if self.failing_since is not None else ""
            return (f"off-host copies: {failing}bucket unreachable since {_utc(self.unreachable_since)}; {lag}: "
                    f"{self.last_error}; the daemon retries {seen}")
        if self.pending:
            what = (f"{self.pending} object(s) pending ({self.pending_bytes} bytes), the oldest for "
                    f"{self.oldest_pending_seconds(self.at):.0f}s (off-host RPO: {self.pending_revisions} "
                    "revision(s) not in the bucket)")
        else:
            what = "nothing pending"
        if self.failing_since is not None:
            what += (f"; FAILING since {_utc(self.failing_since)} "
                     f"({self.failures_total} failure(s)): {self.last_error}; the daemon retries")
        elif self.last_copy is not None:
            what += f"; last copy {now - self.last_copy:.0f}s ago"
        return f"off-host copies: {what} {seen}"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + "Z"


def status_path(cfg: Config) -> str:
    return os.path.join(cfg.backup.dir, STATUS_FILE)


def read_status(cfg: Config) -> Optional[CopyStatus]:
    """The daemon's last report (None: none, or unreadable: said in the log)."""
    from etcd_agent import safejson
    from etcd_agent.fs import read_regular

    try:
        raw = read_regular(status_path(cfg), MAX_STATUS_BYTES, follow_symlinks=False)
        return CopyStatus.from_json(safejson.loads(raw, max_bytes=MAX_STATUS_BYTES), STATUS_FILE)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, ProtocolError) as exc:
        log.warning("ignoring unreadable %s: %s", status_path(cfg), getattr(exc, "message", None) or exc)
        return None


def write_status(cfg: Config, st: CopyStatus) -> None:
    import json

    from etcd_agent.fs import write_atomic

    if not os.path.isdir(cfg.backup.dir):
        return
    try:
        write_atomic(status_path(cfg), (json.dumps(st.to_json(), indent=1) + "\n").encode(), mode=0o600)
    except OSError as exc:
        log.warning("could not write %s: %s", status_path(cfg), exc.strerror or exc)


# ---------------------------------------------------------------- one pass


@dataclass
class Pushed:
    """What one pass did."""

    plan: queue.Plan
    copied: List[queue.LocalFile] = field(default_factory=list)
    error: str = ""  # why it stopped ("" it did not)
    failed: str = ""  # the object it stopped at
    listed: bool = False  # the bucket was listed: ``plan`` is what it lacks

    @property
    def left(self) -> List[queue.LocalFile]:
        done = {f.name for f in self.copied}
        return [f for f in self.plan.pending if f.name not in done and os.path.exists(f.path)]


def pending(cfg: Config, caches: queue.Caches) -> queue.Plan:
    """What the bucket lacks now (one listing, a HEAD per object of the right size not yet checked)."""
    listing = queue.list_bucket(cfg)
    files = queue.scan_local(cfg, caches)
    r = cfg.backup.remote
    remote_fulls = [p.file for p in (layout.place(n) for n in listing) if p is not None and p.kind == layout.FULL]
    keep = queue.plan_fulls([f.file for f in files if f.kind == layout.FULL], remote_fulls,
                            keep_last=r.keep_last, keep_hourly=r.keep_hourly, keep_daily=r.keep_daily)
    return queue.plan(files, listing, queue.same_bytes(cfg, files, listing, caches), keep)


def copy_one(cfg: Config, f: queue.LocalFile, sha256: Optional[str] = None) -> str:
    """Copy one file to its place (verified as every copy is: ``bucket.remote.upload_file``);
    returns the check that verified the copy (``bucket.client.CHECKS``). ``sha256``: the file's,
    when it was hashed already: the upload then reads it once (and refuses bytes not hashing to it)."""
    from etcd_agent.bucket.remote import manifest_metadata, upload_file

    if f.kind == layout.SEGMENT:
        from etcd_agent.chain.reader import read_header

        h = read_header(f.path)
        extra = {"base-revision": str(h.base_revision), "chain-id": h.chain_id, "seq": str(h.seq), "chain": f.key}
        return upload_file(cfg, f.path, f.name, lambda sha: {"sha256": sha, **extra}, sha256=sha256).verified_by
    return upload_file(cfg, f.path, f.name, lambda sha: {**manifest_metadata(sha, f.manifest), "chain": f.key},
                       sha256=sha256).verified_by


class OffHostCopy:
    """What ``take_backup`` calls after writing a full backup by hand or from cron
    (``backup.service.OffHostCopy``): the copy at once, under its chain; the remote retention."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def upload(self, path: str, manifest: Mapping[str, Any], snapshot_sha256: str) -> None:
        copy_full(self.cfg, path, dict(manifest), snapshot_sha256)

    def prune(self) -> List[str]:
        from etcd_agent.bucket.remote import prune_remote

        return [f"remote:{d.name}" for d in prune_remote(self.cfg, dry_run=False) if not d.keep]


def off_host(cfg: Config) -> Optional[OffHostCopy]:
    """The off-host copy ``take_backup`` makes, or None when ``[backup.remote]`` is off."""
    return OffHostCopy(cfg) if cfg.backup.remote.enabled else None


def copy_full(cfg: Config, path: str, manifest: Dict[str, object], snapshot_sha256: str) -> str:
    """A CLI backup's own copy, at once, under its chain (the same place the queue would use)."""
    own = None if layout.KEY_RE.match(snapshot_sha256 or "") else queue.file_sha256(path)
    key = own or snapshot_sha256
    f = queue.LocalFile(layout.FULL, path, os.path.getsize(path), time.time(), key, 0, manifest)
    copy_one(cfg, f, own)  # the file's own digest, when it names the chain: hashed once
    return f.name


def push(cfg: Config, caches: queue.Caches, *, stop: Callable[[], bool] = lambda: False,
         on_copied: Callable[[queue.LocalFile, str], None] = lambda f, check: None,
         on_plan: Callable[[queue.Plan], None] = lambda p: None) -> Pushed:
    """Copy everything pending, in order, until done or the first failure (``Pushed.error``)."""
    try:
        plan = pending(cfg, caches)
    except AgentError as exc:
        return Pushed(queue.Plan(()), error=exc.message, failed=LISTING)
    except OSError as exc:
        return Pushed(queue.Plan(()), error=f"cannot read {cfg.backup.dir}: {exc.strerror or exc}",
                      failed="(the backup dir)")
    on_plan(plan)
    out = Pushed(plan, listed=True)
    for f in plan.pending:
        if stop():
            break
        known = caches.known_sha(f.path)  # hashed by this pass's check or an earlier one
        try:
            check = copy_one(cfg, f, known)
        except (AgentError, OSError) as exc:
            if isinstance(exc, BackupCorrupt) and known is not None:
                caches.forget(f.path)  # the bytes no longer hash to it: the next pass hashes them again
            if not os.path.exists(f.path):
                continue  # pruned meanwhile: it needs no copy
            out.error = getattr(exc, "message", None) or f"cannot read {f.path}: {exc}"
            out.failed = f.name
            return out
        caches.landed(f.name)
        out.copied.append(f)
        on_copied(f, check)
    return out


def _prune(cfg: Config) -> None:
    """The remote retention, once a new full backup landed (a CLI backup prunes after its own copy)."""
    from etcd_agent.bucket.remote import prune_remote

    try:
        prune_remote(cfg, dry_run=False)
    except AgentError as exc:
        log.warning("remote prune after an off-host copy failed: %s", exc.message)


def scrub(cfg: Config, text: str) -> str:
    """``text`` without the bucket's credentials (the client's scrub), and short."""
    from etcd_agent.bucket.client import Bucket

    try:
        text = Bucket(cfg).scrub(text)
    except AgentError:  # no client (credentials file unreadable): the inline keys at least
        r = cfg.backup.remote
        for s in (r.access_key, r.secret_key):
            if s:
                text = text.replace(s, "***")
    return text[:MAX_ERROR]


# ---------------------------------------------------------------- the daemon's thread


class Copier:
    """``start()`` / ``stop()`` / ``nudge()``; ``status()`` for metrics and ``etcd-agent status``."""

    def __init__(self, source: Callable[[], Tuple[Config, Member]], *, rescan: float = RESCAN_EVERY,
                 backoff: Optional[Backoff] = None) -> None:
        self._source = source
        self._rescan = rescan
        self._backoff = backoff or Backoff(1.0, 60.0)
        self._stop = threading.Event()
        self._wake = threading.Event()  # something new to copy
        self._kick = threading.Event()  # retry now, back-off or not (a reload, a stop)
        self._thread: Optional[threading.Thread] = None
        self._mu = threading.Lock()
        self._status = CopyStatus(enabled=True, at=time.time())
        self._caches = queue.Caches()
        self._said_unplaced: set[str] = set()
        self._known: Tuple[queue.LocalFile, ...] = ()  # pending as of the last listing
        self._copied_then: Set[str] = set()  # what the pass of the last listing copied

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="bucket-copier", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def nudge(self) -> None:
        """Look again soon (something new to copy); a back-off after a failure still runs out."""
        self._wake.set()

    def retry_now(self) -> None:
        """The config changed (new credentials, endpoint): try again at once, the back-off reset."""
        self._backoff.succeeded()
        self._kick.set()
        self._wake.set()

    def status(self) -> CopyStatus:
        with self._mu:
            return self._status

    def _set(self, **kw: object) -> CopyStatus:
        with self._mu:
            self._status = replace(self._status, at=time.time(), **kw)  # type: ignore[arg-type]
            return self._status

    def _main(self) -> None:
        while not self._stop.is_set():
            cfg = self._source()[0]
            try:
                failed = self._pass(cfg)
            except Exception:  # one bad pass must not end the copies; the next one tries again
                log.exception("off-host copy pass failed")
                failed = True
            if failed:  # new segments do not cut a back-off short; a reload does
                self._kick.wait(self._backoff.step)
            else:
                self._wake.wait(self._rescan)
            self._wake.clear()
            self._kick.clear()

    def _pass(self, cfg: Config) -> bool:
        """One ``push``; True when it failed (the back-off then waits)."""
        if not cfg.backup.remote.enabled:
            self._set(enabled=False, pending=0, pending_bytes=0, pending_revisions=0, oldest_pending_since=None)
            return False
        before = self.status()
        started = time.time()  # files newer than the listing may be missing from it
        res = push(cfg, self._caches, stop=self._stop.is_set, on_plan=self._planned, on_copied=self._copied)
        now = time.time()
        listing: Dict[str, Any] = {}  # the backup dir unreadable: what the bucket lacks is as known before
        if res.listed:
            self._known, self._copied_then = tuple(res.left), {f.name for f in res.copied}
            listing = {"listed_at": started, "unreachable_since": None, **_pending_fields(res.left)}
        elif res.failed == LISTING:
            left = self._surely_pending(cfg, before.listed_at)
            listing = {"unreachable_since": before.unreachable_since or now, **_pending_fields(left)}
        if res.error:
            wait = self._backoff.failed()
            error = scrub(cfg, f"{res.failed}: {res.error}")
            st = self._set(failing_since=before.failing_since or now, last_error=error,
                           failures_total=before.failures_total + 1, **listing)
            level = logging.WARNING if before.failing_since is None or before.last_error != error else logging.INFO
            log.log(level, "off-host copy failed: %s; %d object(s) pending, retrying in %.0fs (until they land or "
                    "their files are pruned)", error, st.pending, wait)
            write_status(cfg, st)
            return True
        self._backoff.succeeded()
        left = res.left
        st = self._set(enabled=True, failing_since=None, last_error="", **listing)
        if before.failing_since is not None:
            log.info("off-host copies resumed (failing since %s, %.0fs): %d object(s) copied, %d pending",
                     time.strftime("%H:%M:%S", time.gmtime(before.failing_since)), time.time() - before.failing_since,
                     len(res.copied), len(left))
        self._say_unplaced(res.plan)
        write_status(cfg, st)
        if any(f.kind == layout.FULL for f in res.copied):
            _prune(cfg)
        return False

    def _surely_pending(self, cfg: Config, listed_at: Optional[float]) -> List[queue.LocalFile]:
        """While the bucket cannot be listed: the files surely not in it, a lower bound of what it
        lacks - those pending at the last listing and still here, and those that appeared since
        (this copier copied nothing meanwhile; a CLI backup's own copy may have landed). Never
        listed since the daemon started: nothing is known (``describe`` says so)."""
        known = [f for f in self._known if os.path.exists(f.path)]
        if listed_at is None:
            return known
        try:
            here = queue.scan_local(cfg, self._caches)
        except (AgentError, OSError) as exc:
            log.info("the files here not scanned for the lag: %s", getattr(exc, "message", None) or exc)
            return known
        names = {f.name for f in known} | self._copied_then
        return known + [f for f in here if f.since > listed_at and f.name not in names]

    def _planned(self, p: queue.Plan) -> None:
        self._set(enabled=True, pending=len(p.pending), pending_bytes=p.pending_bytes,
                  pending_revisions=p.pending_revisions,
                  oldest_pending_since=p.oldest_since(), unplaced=len(p.unplaced))

    def _copied(self, f: queue.LocalFile, check: str) -> None:
        with self._mu:
            s = self._status
            self._status = replace(s, at=time.time(), pending=max(0, s.pending - 1),
                                   pending_bytes=max(0, s.pending_bytes - f.size), last_copy=time.time(),
                                   pending_revisions=max(0, s.pending_revisions - queue.revisions_of([f])),
                                   copied_total=s.copied_total + 1,
                                   verified={**s.verified, check: s.verified.get(check, 0) + 1})

    def _say_unplaced(self, p: queue.Plan) -> None:
        for path, why in zip(p.unplaced, p.why_unplaced):
            if path not in self._said_unplaced:
                self._said_unplaced.add(path)
                log.warning("%s is not copied off-host: %s", path, why)


def _pending_fields(left: List[queue.LocalFile]) -> Dict[str, Any]:
    return {"pending": len(left), "pending_bytes": sum(f.size for f in left),
            "pending_revisions": queue.revisions_of(left), "oldest_pending_since": min((f.since for f in left),
                                                                                      default=None)}


# ---------------------------------------------------------------- metrics


GAUGES = {
    "enabled": "1 if off-host copies ([backup.remote]) are enabled in the daemon.",
    "up": "1 if the daemon's last pass listed the bucket; 0 if it could not (the pending and lag gauges then "
          "hold what is surely not copied: a lower bound) or has not yet.",
    "last_listing_timestamp_seconds": "Unix time the bucket was last listed (0: not since the daemon started; "
                                      "while up is 0 the lag is then unknown).",
    "pending_objects": "Files (full backups, checkpoints, segments) the bucket does not hold yet.",
    "pending_bytes": "Bytes of the files the bucket does not hold yet.",
    "oldest_pending_seconds": "Age of the oldest file waiting for its off-host copy (0: none): the off-host RPO.",
    "lag_revisions": "Revisions in delta segments here that the bucket does not hold yet: the off-host RPO in "
                     "revisions.",
    "failing_since_timestamp_seconds": "Unix time copies started failing (0: they are not failing).",
    "last_copy_timestamp_seconds": "Unix time of the last off-host copy that landed (verified).",
}
COUNTERS = {
    "copies": "Off-host copies that landed, since the daemon started.",
    "copy_failures": "Off-host copy passes that failed (each retried with back-off).",
}


def metric_values(s: CopyStatus) -> Dict[str, float]:
    return {
        "enabled": float(s.enabled),
        "up": float(s.up),
        "last_listing_timestamp_seconds": s.listed_at or 0.0,
        "pending_objects": float(s.pending),
        "pending_bytes": float(s.pending_bytes),
        "oldest_pending_seconds": s.oldest_pending_seconds(time.time()),
        "lag_revisions": float(s.pending_revisions),
        "failing_since_timestamp_seconds": s.failing_since or 0.0,
        "last_copy_timestamp_seconds": s.last_copy or 0.0,
    }


class BucketCollector:
    """A prometheus_client collector of ``status_fn()``; the last error is a label of
    ``etcd_agent_bucket_last_error_info`` while copies fail."""

    def __init__(self, status_fn: Callable[[], Optional[CopyStatus]]) -> None:
        self.status_fn = status_fn

    def collect(self) -> "Iterable[Metric]":
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.status_fn()
        if s is None:
            return
        for name, value in metric_values(s).items():
            yield GaugeMetricFamily(PREFIX + name, GAUGES[name], value=value)
        yield CounterMetricFamily(PREFIX + "copies", COUNTERS["copies"], value=s.copied_total)
        yield CounterMetricFamily(PREFIX + "copy_failures", COUNTERS["copy_failures"], value=s.failures_total)
        if s.failing_since is not None:
            info = GaugeMetricFamily(PREFIX + "last_error_info", "The last off-host copy error (credentials scrubbed), "
                                     "while copies fail.", labels=["error"])
            info.add_metric([s.last_error], 1.0)
            yield info
