"""One pass over one archive's members, for ``reader``: what each may be, how big, where its bytes go.

``Reading`` walks the tar headers (``tarstream``), refuses what no backup holds, checks every
size against ``Limits`` and the manifest when one came first, and keeps the small members in
memory; the snapshot is left in place, or copied (0600) into a private staging dir only once its
meta pages are proven, or decrypted there (``sealed``). What the pass found is ``reader``'s to
judge and to turn into an ``Archive``.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Dict, List, Optional

from etcd_agent.backup import manifest as M
from etcd_agent.backup.manifest import Manifest
from etcd_agent.backup.sealed import OVERHEAD_MAX, Sealed, check_member, decrypt_member, locked
from etcd_agent.backup.snapcheck import StreamCheck, check_size
from etcd_agent.backup.tarstream import BLOCK, CHUNK, Header, Stream, headers, normalise, refuse_type
from etcd_agent.errors import AgentError, BackupCorrupt, IdentityRefused, RefusedError

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities

KNOWN = (M.CONF, M.UNIT, M.SNAPSHOT, M.SNAPSHOT_AGE, M.MANIFEST)
STAGE_PREFIX = ".etcd-agent-stage-"

_CORRUPT = "the file is damaged or incomplete: use another backup (etcd-agent backup list)"
HOSTILE = ("nothing was extracted: neither etcd-agent nor the runbook (etcdctl snapshot save + tar) makes "
           "such a tarball, so do not restore from it")


@dataclass(frozen=True)
class Limits:
    """Bounds on what a tarball may make the reader do."""

    max_snapshot: int = 64 << 30
    max_small: int = 1 << 20  # etcd.conf, etcd.service
    max_manifest: int = M.MAX_MANIFEST
    max_json_depth: int = M.MAX_DEPTH
    max_ext_header: int = 4096  # a pax or GNU long-name header
    max_headers: int = 16  # header blocks of any kind (members, ./, pax)
    max_trailing: int = 1 << 20  # decompressed bytes after the end-of-archive blocks (all zero)
    space_margin: int = 16 << 20  # left free in the staging dir


DEFAULT_LIMITS = Limits()


@dataclass
class Found:
    size: int
    sha256: str
    data: Optional[bytes] = None


class Reading:
    """One pass over one archive."""

    def __init__(self, path: str, staging_dir: Optional[str], hash_snapshot: bool, extract: bool,
                 limits: Limits, identities: Optional["Identities"] = None, need_plaintext: bool = False) -> None:
        self.path = path
        self.staging_dir = staging_dir or os.path.dirname(os.path.abspath(path))
        self.hash_snapshot = hash_snapshot
        self.extract = extract
        self.limits = limits
        self.found: Dict[str, Found] = {}
        self.order: List[str] = []
        self.mtimes: Dict[str, int] = {}
        self.manifest: Optional[Manifest] = None
        self.stage: Optional[str] = None
        self.snap_path: Optional[str] = None
        self.snap_offset = 0
        self.snap_size = 0
        self.check: Optional[StreamCheck] = None
        self.written = 0
        self.identities = identities
        self.need_plaintext = need_plaintext
        self.sealed: Optional[Sealed] = None
        self.peek = False  # stop at a compressed snapshot's header (listing)
        self.prescan = False  # headers and the manifest only (a plain tar's manifest comes last)
        self.stopped = False

    def fail(self, exc: AgentError) -> AgentError:
        if isinstance(exc, IdentityRefused):  # says itself what to do; nothing was decrypted
            return IdentityRefused(exc.message if exc.message.startswith(self.path) else f"{self.path}: {exc.message}")
        advice = HOSTILE if isinstance(exc, RefusedError) else _CORRUPT
        if isinstance(exc, RefusedError) and exc.message.startswith("not enough space"):
            advice = "free some space there or pass another staging dir; nothing was written"
        cls = type(exc) if isinstance(exc, (RefusedError, BackupCorrupt)) else BackupCorrupt
        # details[0]: the problem alone (for one-line listings)
        return cls(f"{self.path}: {exc.message}; {advice}", details=[exc.message] + list(exc.details))

    # -- member data

    def small(self, st: Stream, h: Header, norm: str) -> None:
        limit = self.limits.max_manifest if norm == M.MANIFEST else self.limits.max_small
        if h.size > limit:
            raise RefusedError(f"member {norm} is {h.size} bytes, larger than any real one (limit {limit})")
        data = st.read(h.size)
        if len(data) < h.size:
            raise BackupCorrupt(f"truncated: member {norm!r} declares {h.size} bytes, only {len(data)} present")
        self.found[norm] = Found(h.size, hashlib.sha256(data).hexdigest(), data)
        if norm == M.MANIFEST:
            self.manifest = Manifest.from_json(data, where=M.MANIFEST, max_bytes=self.limits.max_manifest,
                                               max_depth=self.limits.max_json_depth)

    def snapshot(self, st: Stream, h: Header) -> None:
        if h.size > self.limits.max_snapshot:
            raise RefusedError(f"{M.SNAPSHOT} declares {h.size} bytes (limit {self.limits.max_snapshot})")
        check_size(h.size, M.SNAPSHOT)
        self.snap_size = h.size
        copy = st.compression != "none" or self.extract
        if not copy:  # in place: checked after the walk, in one read of its bytes
            self.snap_path, self.snap_offset = self.path, h.offset_data
            got = st.skip(h.size)
            if got < h.size:
                raise BackupCorrupt(
                    f"truncated: member {M.SNAPSHOT!r} declares {h.size} bytes, only {got} present "
                    f"(archive ends at byte {h.offset_data + got})"
                )
            return
        free = shutil.disk_usage(self.staging_dir).free
        if free < h.size + self.limits.space_margin:
            raise RefusedError(
                f"not enough space in {self.staging_dir} to stage the {h.size}-byte snapshot ({free} bytes free)"
            )
        self.stage = tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=self.staging_dir)
        self.snap_path, self.snap_offset = os.path.join(self.stage, M.SNAPSHOT), 0
        check = StreamCheck(declared=h.size, what=M.SNAPSHOT)
        self.check = check
        fd = os.open(self.snap_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        held: List[bytes] = []
        with os.fdopen(fd, "wb") as out:
            left = h.size
            while left:
                chunk = st.read(min(CHUNK if check.meta_ok else 1 << 14, left))
                if not chunk:
                    raise BackupCorrupt(
                        f"truncated: member {M.SNAPSHOT!r} declares {h.size} bytes, about {h.size - left} could "
                        "be read before the archive ran out"
                    )
                left -= len(chunk)
                check.update(chunk)  # raises on a bad meta page after the first pages
                if not check.meta_ok:
                    held.append(chunk)  # nothing is written before the meta pages are proven
                    continue
                for part in held + [chunk]:
                    out.write(part)
                    self.written += len(part)
                held = []
            for part in held:
                out.write(part)
                self.written += len(part)
            out.flush()
            os.fsync(out.fileno())

    def sealed_member(self, st: Stream, h: Header) -> None:
        """``etcd_snapshot.db.age``: decrypted into a private staging dir with an identity, checked
        without the key otherwise (``sealed``)."""
        if h.size > self.limits.max_snapshot + OVERHEAD_MAX:
            raise RefusedError(f"{M.SNAPSHOT_AGE} declares {h.size} bytes (limit {self.limits.max_snapshot})")
        self.snap_size = h.size
        if self.identities is None:
            if self.need_plaintext and st.compression != "none":
                raise locked(self.path, self.manifest)  # said at once: a compressed stream is slow to skip
            self.sealed = check_member(st, h.size, hash_it=self.hash_snapshot or st.compression != "none",
                                       archive_path=self.path, offset=h.offset_data)
            return
        free = shutil.disk_usage(self.staging_dir).free
        if free < h.size + self.limits.space_margin:
            raise RefusedError(
                f"not enough space in {self.staging_dir} to decrypt the {h.size}-byte snapshot ({free} bytes free)"
            )
        self.stage = tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=self.staging_dir)
        self.snap_path, self.check, self.sealed = decrypt_member(st, h.size, self.identities, self.stage)
        self.snap_offset, self.snap_size = 0, self.check.size
        self.written = self.check.size

    def hash_in_place(self) -> None:
        assert self.snap_path is not None
        check = StreamCheck(declared=self.snap_size, what=M.SNAPSHOT)
        with open(self.snap_path, "rb") as fh:
            fh.seek(self.snap_offset)
            left = self.snap_size
            while left:
                chunk = fh.read(min(CHUNK, left))
                if not chunk:
                    raise BackupCorrupt(f"truncated: {M.SNAPSHOT} ends {left} bytes early")
                left -= len(chunk)
                check.update(chunk)
        self.check = check

    # -- the walk

    def walk(self, fh: BinaryIO, compression: str) -> None:
        st = Stream(fh, compression)
        for h in headers(st, self.limits.max_headers, self.limits.max_ext_header):
            norm = normalise(h.name)
            refuse_type(h, norm)
            if norm == "" and h.type == b"5":
                continue
            if norm not in KNOWN:
                raise RefusedError(f"unexpected member {h.name!r} (a backup holds only {', '.join(KNOWN)})")
            if norm in self.found or (norm in M.SNAPSHOTS and (self.snap_path is not None or self.sealed is not None
                                                               or any(n in M.SNAPSHOTS for n in self.order))):
                raise RefusedError(f"duplicate member {norm!r}" if norm in self.order else
                                   f"two snapshots ({M.SNAPSHOT} and {M.SNAPSHOT_AGE})")
            if self.manifest is not None and norm != M.MANIFEST:
                want = self.manifest.files.get(norm)
                if want is None:
                    raise RefusedError(f"member {norm} is not listed in the manifest")
                if h.size != want.size:
                    raise RefusedError(f"member {norm} declares {h.size} bytes, the manifest says {want.size}")
            self.order.append(norm)
            self.mtimes[norm] = h.mtime
            if norm in M.SNAPSHOTS and self.peek and compression != "none":
                self.snap_size, self.stopped = h.size, True
                return
            if self.prescan and norm != M.MANIFEST:
                st.skip(h.size)
            elif norm == M.SNAPSHOT:
                self.snapshot(st, h)
            elif norm == M.SNAPSHOT_AGE:
                self.sealed_member(st, h)
            else:
                self.small(st, h, norm)
            pad = -h.size % BLOCK
            if st.skip(pad) < pad and norm not in M.SNAPSHOTS:
                pass  # a missing last padding is harmless: the data was complete
        if compression != "none":
            self.drain(st)

    def drain(self, st: Stream) -> None:
        """After the end blocks: tar pads to its record size with zeros; anything else (or more
        than the limit) is data past the end, refused."""
        left = self.limits.max_trailing
        while True:
            data = st.read(min(CHUNK, left + 1))
            if not data:
                return
            if data.strip(b"\0"):
                raise RefusedError("data after the end of the tar archive")
            left -= len(data)
            if left < 0:
                raise RefusedError(f"more than {self.limits.max_trailing} bytes after the end of the tar archive")
