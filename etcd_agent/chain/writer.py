"""Writing one delta segment (layout in ``segments``): records encoded, the file made visible whole.

``SegmentWriter`` appends a revision at a time under a hidden temp name and links the finished
file to its final name only after the footer, the digest and an fsync; ``remove_stale_temps``
clears what a watcher that died left open.
"""
from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Any, BinaryIO, List, Optional, Sequence, Tuple

from etcd_agent.chain import sign as segsign
from etcd_agent.chain.errors import DeltaError
from etcd_agent.chain.segments import (
    DELETE,
    DIGEST,
    EVENT_HEAD,
    FLAG_CATCHUP,
    LEASE_BODY,
    MAGIC,
    MAX_RECORD,
    PUT,
    REC_FOOTER,
    REC_HEAD,
    REC_LEASE,
    REC_TXN,
    TEMP_PREFIX,
    TXN_HEAD,
    U32,
    U64,
    Checkpoint,
    LeaseRecord,
    SegmentFooter,
    SegmentHeader,
    SegmentInfo,
    Txn,
    json_bytes,
    segment_name,
)
from etcd_agent.fs import fsync_dir

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import X25519Recipient
    from etcd_agent.chain.seal import SealingSink

log = logging.getLogger(__name__)

PENDING = 64 * 1024


def encode_txn(txn: Txn) -> bytes:
    parts = [TXN_HEAD.pack(txn.revision, txn.time_ms, len(txn.events), FLAG_CATCHUP if txn.catchup else 0)]
    for ev in txn.events:
        if ev.kind == PUT:
            parts.append(EVENT_HEAD.pack(PUT, len(ev.key), len(ev.value), ev.create_revision, ev.version, ev.lease))
            parts.append(ev.key)
            parts.append(ev.value)
        else:
            parts.append(EVENT_HEAD.pack(DELETE, len(ev.key), 0, 0, 0, 0))
            parts.append(ev.key)
    payload = b"".join(parts)
    return REC_HEAD.pack(REC_TXN, len(payload)) + payload


def encode_lease(rec: LeaseRecord) -> bytes:
    payload = LEASE_BODY.pack(rec.lease_id, rec.granted_ttl, rec.remaining_ttl, rec.observed_ms)
    return REC_HEAD.pack(REC_LEASE, len(payload)) + payload


class SegmentWriter:
    """Writes one segment under a hidden temp name; ``close`` makes it visible atomically.

    The file is 0600 whatever the umask, fsynced before it is linked to its final name (never
    replacing a file), and the directory is fsynced after. ``abort`` (or a crash) leaves at most
    the hidden temp file, which ``remove_stale_temps`` clears on the next start.

    With ``recipients`` the segment is encrypted to them as it is written (``segseal``: no
    plaintext byte reaches the disk) and sealed when it closes, signed with ``sign_key`` (the
    manifest key) when there is one; it is then named ``<segment name>.age``. A plain segment's
    footer is signed with ``sign_key`` (``segsign``).
    """

    def __init__(self, directory: str, header: SegmentHeader, *, buffer_size: int = 1 << 20,
                 recipients: Sequence["X25519Recipient"] = (), sign_key: Optional[bytes] = None) -> None:
        self.directory = directory
        self.header = header
        self.tmp = os.path.join(directory, f"{TEMP_PREFIX}{header.chain_id[:12]}-{header.seq:08d}.tmp")
        try:
            fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:  # a full disk (no inode left): said as the watch's error, not a traceback
            raise DeltaError(f"creating segment {self.tmp} failed: {exc.strerror or exc}") from exc
        os.fchmod(fd, 0o600)
        self._fh: Optional[BinaryIO] = os.fdopen(fd, "w+b", buffering=buffer_size)
        self._sealer: Optional["SealingSink"] = None
        self._sign_key = sign_key
        self._hash = hashlib.sha256()
        self._pending: List[bytes] = []
        self._pending_size = 0
        self.size = 0
        self.txns = 0
        self.events = 0
        self.leases = 0
        self.last_revision = header.start_revision - 1
        self.last_time_ms = header.start_time_ms
        self.catchup_until = 0
        try:
            if recipients:
                from etcd_agent.chain.seal import SealingSink

                self._sealer = SealingSink(self._fh, recipients, sign_key)
            head = json_bytes(header.to_json())
            self._write(MAGIC + U32.pack(len(head)) + head)
        except BaseException:
            self.abort()
            raise

    @property
    def sealed(self) -> bool:
        return self._sealer is not None

    @property
    def is_open(self) -> bool:
        """False once closed or aborted (a failed write or close aborts it: its temp is gone)."""
        return self._fh is not None

    def _sink(self, data: bytes) -> None:
        assert self._fh is not None, "segment already closed"
        try:
            if self._sealer is not None:
                self._sealer.write(data)
            else:
                self._fh.write(data)
        except OSError as exc:  # a full disk: nothing half-written stays, the error names the dir
            self.abort()
            raise DeltaError(f"writing segment {self.tmp} failed: {exc.strerror or exc}") from exc

    def _write(self, data: bytes) -> None:
        # records are ~1 KiB, one a revision: hashed and encrypted 64 KiB at a time, not each
        # (at 500 revisions/s the per-call cost was most of the writer's share of the watch)
        self._pending.append(data)
        self._pending_size += len(data)
        self.size += len(data)  # of the plain segment, what close_bytes counts
        if self._pending_size >= PENDING:
            self._flush_pending()

    def _flush_pending(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_size = 0
        self._hash.update(data)
        self._sink(data)

    def add_txn(self, txn: Txn) -> None:
        """Append one revision; revisions must follow each other without a gap."""
        if txn.revision != self.last_revision + 1:
            raise DeltaError(f"segment {self.tmp}: revision {txn.revision} does not follow {self.last_revision}")
        if not txn.events:
            raise DeltaError(f"segment {self.tmp}: revision {txn.revision} has no events")
        data = encode_txn(txn)
        if len(data) > MAX_RECORD:
            raise DeltaError(f"revision {txn.revision} is {len(data)} bytes, over the {MAX_RECORD}-byte record limit")
        # time never goes backwards inside a chain, even if the wall clock is stepped back
        if txn.time_ms < self.last_time_ms:
            txn = Txn(txn.revision, self.last_time_ms, txn.events, txn.catchup)
            data = encode_txn(txn)
        self._write(data)
        self.txns += 1
        self.events += len(txn.events)
        self.last_revision = txn.revision
        self.last_time_ms = txn.time_ms
        if txn.catchup:
            self.catchup_until = txn.revision

    def add_lease(self, rec: LeaseRecord) -> None:
        self._write(encode_lease(rec))
        self.leases += 1

    def close(self, end_time_ms: int, *, confirmed: bool, checkpoints: Sequence[Checkpoint] = ()) -> SegmentInfo:
        """Footer, digest, fsync, link to the final name; returns what the next segment chains to.
        ``checkpoints``: full backups inside the chain this segment vouches for (``segments.Checkpoint``)."""
        footer = SegmentFooter(
            end_revision=self.last_revision,
            end_time_ms=max(end_time_ms, self.last_time_ms),
            txns=self.txns,
            events=self.events,
            leases=self.leases,
            confirmed=confirmed,
            catchup_until=self.catchup_until,
            checkpoints=tuple(checkpoints),
        )
        assert self._fh is not None, "segment already closed"
        try:
            self._flush_pending()  # every byte before the footer hashed: what its signature covers
            if self._sign_key is not None and self._sealer is None:  # (an encrypted one's seal is signed)
                footer = segsign.sign(footer, self._sign_key, self._hash.digest())
            body = json_bytes(footer.to_json())
            footer_at = self.size
            self._write(REC_HEAD.pack(REC_FOOTER, len(body)) + body + U64.pack(footer_at))
            self._flush_pending()
            digest = self._hash.digest()
            whole = self._hash.copy()
            whole.update(digest)
            self._sink(digest)
            self.size += DIGEST
            size = self.size
            if self._sealer is not None:
                self._sealer.seal(self.header, footer, self.size, whole.hexdigest())
                whole, size = _file_sha256(self._fh)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
            final = os.path.join(self.directory, segment_name(
                self.header.start_revision, footer.end_revision, footer.end_time_ms, sealed=self.sealed))
            os.link(self.tmp, final)  # never replaces an existing segment
            os.unlink(self.tmp)
            fsync_dir(self.directory)
        except OSError as exc:
            self.abort()
            raise DeltaError(f"closing segment {self.tmp} failed: {exc.strerror or exc}") from exc
        return SegmentInfo(final, size, whole.hexdigest(), self.header, footer)

    def abort(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def _file_sha256(fh: BinaryIO) -> Tuple[Any, int]:
    """sha256 and size of the whole file ``fh`` (flushed; from the page cache): what the next
    encrypted segment names, which only exists once its seal is written in front."""
    fh.flush()
    h = hashlib.sha256()
    fd = fh.fileno()
    at = 0
    while True:
        chunk = os.pread(fd, 1 << 20, at)
        if not chunk:
            return h, at
        h.update(chunk)
        at += len(chunk)


def remove_stale_temps(directory: str) -> List[str]:
    """Remove temp files of segments that were open when a watcher died (hold the dir lock)."""
    removed = []
    for entry in os.listdir(directory):
        if entry.startswith(TEMP_PREFIX) and entry.endswith(".tmp"):
            os.unlink(os.path.join(directory, entry))
            removed.append(entry)
    if removed:
        log.info("removed %d unfinished segment(s) of an earlier watcher: %s", len(removed), ", ".join(removed))
    return removed
