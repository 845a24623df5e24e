"""Lean checkpoints: the daemon's checkpoint snapshot defragmented offline before it is archived.

etcd streams its live db file: the history since the last compaction *and* every free page (3-5x
the data on a cluster compacted every few minutes). A point-in-time restore starts from the newest
checkpoint and pays for each of those pages (staged, restored into the throwaway member, started,
defragmented). So a checkpoint's snapshot is staged in a private 0700 dir under ``[daemon]
state_dir`` (never the backup dir: with ``encrypt_to`` it is plaintext), etcd's sha256 trailer
checked and cut off, the db defragmented offline (``etcdutl defrag --data-dir``; etcdctl's for
3.4), cut to its high-water mark and given a new trailer, then archived from that file.

Offline defragmentation copies every bucket: the keys and their revisions (the same KV hash and
revision for ``snapshot status``), the members bucket - who the snapshot is, for the catalogue -
and etcd's meta (consistent index) are unchanged; the history is not compacted.

It never costs a checkpoint: a defrag tool that is missing or fails leaves the checkpoint as today
(the snapshot as etcd streamed it, checked), said in one log line. Too little room to stage it is a
refusal: that checkpoint is not taken (the next try comes). The stage is removed on every path, and
what a killed run left is swept when the daemon starts and by the next backup on this host
(``sweep``, under the backup lock).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, List

from etcd_agent.backup.outstream import Chunk
from etcd_agent.errors import AgentError, BackupCorrupt, BackupError, RefusedError, SnapshotFormatError
from etcd_agent.etcd.bbolt import TRAILER
from etcd_agent.fs import makedirs

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config
    from etcd_agent.hosts.base import Host

log = logging.getLogger(__name__)

STAGE_DIR = "checkpoint-stage"  # under [daemon] state_dir
STAGE_PREFIX = "etcd-lean-"
READ_CHUNK = 1 << 20


def stage_parent(cfg: "Config") -> str:
    """Where checkpoints are staged: a 0700 dir under ``[daemon] state_dir``, outside the backup
    dir (copied off-host; never any plaintext of an encrypted backup)."""
    return os.path.join(cfg.daemon.state_dir, STAGE_DIR)


def room_needed(db_size: int, margin: float) -> int:
    """Free bytes the stage needs: the snapshot, and the defragmented copy written beside it
    before it replaces it (at most as large), plus ``margin``."""
    return int(2 * (db_size + TRAILER) * (1.0 + margin))


def sweep(cfg: "Config") -> List[str]:
    """Remove the stages a killed checkpoint left (call holding the backup dir's operation lock:
    the only holder that stages); the paths removed."""
    parent = stage_parent(cfg)
    try:
        names = sorted(os.listdir(parent))
    except OSError:  # no stage was ever made here (or the state dir is not ours to read)
        return []
    removed = []
    for n in names:
        p = os.path.join(parent, n)
        if n.startswith(STAGE_PREFIX) and os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        log.warning("removed what a killed checkpoint left staged: %s", ", ".join(removed))
    return removed


def sweep_at_start(cfg: "Config") -> List[str]:
    """``sweep`` when the daemon starts, if the backup dir's lock is free (a backup running now
    is the only one that stages, and the next backup sweeps anyway); the paths removed."""
    from etcd_agent.errors import BusyError
    from etcd_agent.state.locks import OperationLock, lock_path_for

    if not os.path.isdir(stage_parent(cfg)) or not os.path.isdir(cfg.backup.dir):
        return []
    try:
        with OperationLock(lock_path_for(cfg.backup.dir), "sweep of checkpoint stages"):
            return sweep(cfg)
    except BusyError:
        return []
    except (AgentError, OSError) as exc:  # the next backup sweeps them
        log.warning("checkpoint stages not swept at start: %s", getattr(exc, "message", exc))
        return []


def strip_trailer(path: str) -> bytes:
    """Check etcd's trailer of the snapshot at ``path`` (a whole number of 512-byte blocks plus
    32, the last 32 the sha256 of all before them), then cut it off: ``path`` is then a bare bbolt
    db. The trailer returned; BackupCorrupt (the file untouched) when it is not one."""
    size = os.path.getsize(path)
    if size < 512 or size % 512 != TRAILER:
        raise BackupCorrupt(f"{path}: {size} bytes is not a bbolt db plus etcd's 32-byte sha256 trailer "
                            "(a truncated snapshot)")
    body = size - TRAILER
    digest = _sha256_of(path, body)
    with open(path, "rb") as fh:
        fh.seek(body)
        trailer = fh.read(TRAILER)
    if digest != trailer:
        raise BackupCorrupt(f"{path}: etcd's sha256 trailer does not match the data before it")
    os.truncate(path, body)
    return trailer


def seal(path: str) -> int:
    """The bare db at ``path`` made a snapshot again, as etcd streams one: cut to its high-water
    mark (bbolt grows a file ahead of its pages; etcd sends exactly the pages) and followed by the
    sha256 of all of it. Its new size; BackupCorrupt when the db's meta is not sound or it is
    shorter than its high-water mark."""
    from etcd_agent.etcd.snapdb import read_meta

    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        try:
            meta = read_meta(lambda off, n: os.pread(fh.fileno(), n, off), size)
        except SnapshotFormatError as exc:
            raise BackupCorrupt(f"{path}: the defragmented db is not sound ({exc.message})") from None
    body = meta.high_water * meta.page_size
    if body > size or body % 512:
        raise BackupCorrupt(f"{path}: the defragmented db is {size} bytes, its meta says {meta.high_water} pages "
                            f"of {meta.page_size}")
    os.truncate(path, body)
    trailer = _sha256_of(path, body)
    with open(path, "ab") as fh:
        fh.write(trailer)
    return body + TRAILER


def _sha256_of(path: str, n: int) -> bytes:
    """sha256 of the first ``n`` bytes of ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        left = n
        while left > 0:
            block = fh.read(min(READ_CHUNK, left))
            if not block:
                raise BackupCorrupt(f"{path}: ended {left} bytes early")
            h.update(block)
            left -= len(block)
    return h.digest()


def file_chunks(path: str) -> Iterator[bytes]:
    """The file at ``path``, in 1 MiB reads (``write_archive``'s chunks)."""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(READ_CHUNK)
            if not block:
                return
            yield block


@dataclass(frozen=True)
class Staged:
    """The snapshot a checkpoint archives: ``path`` (its file, with etcd's trailer or ours), and
    ``from_bytes``, the snapshot's size as etcd streamed it; ``lean``: defragmented."""

    path: str
    from_bytes: int
    lean: bool

    def chunks(self) -> Iterator[bytes]:
        return file_chunks(self.path)


def defrag_argv(cfg: "Config", data_dir: str) -> List[str]:
    """Offline defragmentation of the db in ``data_dir``/member/snap: etcdutl when configured
    (3.5+), else etcdctl (3.4: ``ETCDCTL_API=3 etcdctl defrag --data-dir``)."""
    from etcd_agent.etcd.tools import snapshot_tool

    return snapshot_tool(cfg) + ["defrag", f"--data-dir={data_dir}"]


def tool_missing(cfg: "Config") -> str:
    """Why the offline defrag cannot run at all ("" it can): its binary is not there."""
    from etcd_agent.etcd.tools import snapshot_tool

    tool = snapshot_tool(cfg)[0]
    if os.path.isabs(tool):
        ok = os.path.isfile(tool) and os.access(tool, os.X_OK)
    else:
        ok = shutil.which(tool) is not None
    return "" if ok else f"{tool} is not an executable here"


@contextlib.contextmanager
def staged(cfg: "Config", host: "Host", stream: Callable[[], Iterable[Chunk]], db_size: int) -> Iterator[Staged]:
    """The checkpoint's snapshot from ``stream()`` (etcd's), staged, checked and defragmented;
    the stage removed on the way out, whatever happens. RefusedError before anything is read when
    the stage's filesystem lacks room for ``db_size`` twice (plus ``[backup] space_margin``);
    BackupCorrupt when etcd's trailer is wrong. A defrag that fails yields the snapshot as etcd
    streamed it (``lean`` false), said in one log line."""
    parent = stage_parent(cfg)
    try:
        makedirs(parent, 0o700)
        free = shutil.disk_usage(parent).free
    except OSError as exc:
        raise RefusedError(f"cannot stage the checkpoint in {parent}: {exc.strerror or exc}; nothing written") from None
    need = room_needed(db_size, cfg.backup.space_margin)
    if free < need:
        raise RefusedError(f"not enough space in {parent} to defragment the checkpoint: {free} bytes free, the "
                           f"{db_size}-byte db needs {need} (twice, + {cfg.backup.space_margin:.0%} margin); "
                           "nothing written")
    top = tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=parent)  # 0700
    try:
        snap = os.path.join(top, "member", "snap")
        makedirs(snap, 0o700)
        db = os.path.join(snap, "db")
        fd = os.open(db, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            for chunk in stream():
                out.write(chunk)
        from_bytes = os.path.getsize(db)
        trailer = strip_trailer(db)
        why = _defrag(cfg, host, top)
        if why:
            _restore_trailer(db, trailer, why)
            log.warning("delta: checkpoint archived as etcd streamed it (%d bytes), not defragmented: %s",
                        from_bytes, why)
            yield Staged(db, from_bytes, False)
            return
        size = seal(db)
        log.info("delta: checkpoint defragmented offline: %d -> %d bytes", from_bytes, size)
        yield Staged(db, from_bytes, True)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _defrag(cfg: "Config", host: "Host", data_dir: str) -> str:
    """Defragment the db under ``data_dir``; "" done, else why not (one line)."""
    from etcd_agent.etcd.tools import ETCDCTL_ENV

    missing = tool_missing(cfg)
    if missing:
        return missing
    try:
        host.run(defrag_argv(cfg, data_dir), timeout=cfg.maintenance.defrag_timeout, env=ETCDCTL_ENV)
    except AgentError as exc:
        tail = ""
        res = getattr(exc, "result", None)
        if res is not None:
            lines = (res.stderr or res.stdout or "").strip().splitlines()
            tail = f" ({lines[-1][:200]})" if lines else ""
        return f"{exc.message}{tail}"
    return ""


def _restore_trailer(db: str, trailer: bytes, why: str) -> None:
    """After a failed defrag: the db must still be the one etcd sent (its trailer's hash), which
    is then archived as today. BackupError (no checkpoint this time) when the tool changed it."""
    size = os.path.getsize(db)
    if size % 512 or _sha256_of(db, size) != trailer:
        raise BackupError(f"the offline defrag failed ({why}) and left the staged snapshot changed; "
                          "checkpoint not taken")
    with open(db, "ab") as fh:
        fh.write(trailer)
