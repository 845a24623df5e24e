"""The one bounded reader of backup tarballs: verify, list, restore and import all go through it.

Every byte of a tarball is hostile until checked: backups hold every Kubernetes Secret and a
restore rewrites every master. So this module parses tar headers itself (no ``tarfile``: it would
read a pax header of any size, expand a GNU sparse member to its full size and trust the file
name's extension), and checks everything *before* it writes a byte:

- the format comes from the content (gzip ``1f8b``, zstd ``28b52ffd``, tar ``ustar``), never
  from the name: ``tar czf etcd-2019-08-07.tar ...`` is a gzip stream in a ``.tar`` name;
- members: only ``etcd.conf``, ``etcd.service``, ``etcd_snapshot.db``, ``manifest.json``,
  optionally ``./``-prefixed, plus one ``./`` directory entry; ``..``, absolute paths, links,
  devices, fifos, duplicates, unknown names, GNU sparse members, and pax / GNU long-name headers
  larger than ``Limits.max_ext_header`` are refused where their header is read;
- sizes: each checked against ``Limits``, against the manifest when one came first (agent
  archives), and against the free space of the staging dir before the copy is created; data past
  a member's size or past the end of the archive is refused as it streams;
- the snapshot: its bbolt meta pages are checked as soon as its first pages arrive, and nothing is
  written before that; its sha256 trailer and size at the end; who it belongs to
  (``SnapshotIdentity``) is read from its own database afterwards (``etcd/snapdb``);
- JSON (the manifest) is size- and depth-limited (``manifest``).

A plain tar is read in place: its snapshot stays in the archive (``SnapshotSource`` points at the
member's data); a compressed one is decompressed once, its snapshot copied (0600) into a private
directory in ``staging_dir``. Either way the archive is read once.

An encrypted snapshot (``etcd_snapshot.db.age``, ``sealed``) is decrypted into that private
directory when an identity is given, and then checked like any snapshot; without one, the
archive still reads (``Archive.sealed`` says what its bytes showed, ``snapshot`` and ``identity``
are None), and a caller that needs the snapshot itself (``need_plaintext``) is refused.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Dict, List, Optional, Tuple

from ..errors import AgentError, BackupCorrupt, IdentityRefused, RefusedError, SnapshotFormatError
from ..etcd.snapdb import SnapshotIdentity, parse_identity
from . import manifest as M
from .manifest import Manifest
from .sealed import OVERHEAD_MAX, Sealed, check_member, compare, decrypt_member, locked
from .snapcheck import SnapshotFacts, StreamCheck, check_size
from .tarstream import BLOCK, CHUNK, Header, Stream, headers, normalise, refuse_type, sniff

if TYPE_CHECKING:  # pragma: no cover
    from ..age import Identities

log = logging.getLogger(__name__)

KNOWN = (M.CONF, M.UNIT, M.SNAPSHOT, M.SNAPSHOT_AGE, M.MANIFEST)
STAGE_PREFIX = ".etcd-agent-stage-"

_CORRUPT = "the file is damaged or incomplete: use another backup (etcd-agent backup list)"
_HOSTILE = ("nothing was extracted: neither etcd-agent nor the runbook (etcdctl snapshot save + tar) makes "
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


@dataclass(frozen=True)
class SnapshotSource:
    """Where the snapshot bytes are, and what they are."""

    path: str  # plain tar: the archive itself; compressed: the extracted 0600 copy
    offset: int  # of the first snapshot byte in ``path``
    size: int
    extracted: bool
    sha256: Optional[str]  # our own hash of the bytes (None if not hashed)
    facts: SnapshotFacts

    def open(self) -> BinaryIO:
        """A reader of exactly those bytes (for shipping)."""
        fh = open(self.path, "rb")
        fh.seek(self.offset)
        return _Window(fh, self.size)  # type: ignore[return-value]

    def read_at(self, offset: int, n: int) -> bytes:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, max(0, min(n, self.size - offset)), self.offset + offset)
        finally:
            os.close(fd)


class _Window:
    """A file object limited to ``size`` bytes from where it stands."""

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self._fh, self._left = fh, size

    def read(self, n: int = -1) -> bytes:
        if n < 0 or n > self._left:
            n = self._left
        data = self._fh.read(n)
        self._left -= len(data)
        return data

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "_Window":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Archive:
    path: str
    kind: str  # "agent" (has a manifest) | "runbook" (etcdctl snapshot save + tar, by hand)
    compression: str  # "none" | "gzip" | "zstd", from the content
    manifest: Optional[Manifest]
    signature: str  # "valid" | "invalid" | "unsigned" | "unknown-key"
    conf: Optional[bytes]
    unit: Optional[bytes]
    snapshot: Optional[SnapshotSource]  # None: encrypted and not decrypted (no identity)
    identity: Optional[SnapshotIdentity]  # from the snapshot's own db; None as ``snapshot``
    checked: Tuple[str, ...]
    not_checked: Tuple[str, ...]
    members: Tuple[str, ...] = ()  # member names in archive order, normalised
    mtimes: Tuple[Tuple[str, int], ...] = ()  # each member's mtime from its tar header (a claim)
    sealed: Optional[Sealed] = None  # the snapshot was encrypted: what its ciphertext showed
    _stage: Optional[str] = field(default=None, repr=False, compare=False)

    def plaintext(self) -> Tuple[SnapshotSource, SnapshotIdentity]:
        """The snapshot and whose it is; IdentityRefused when it is encrypted and was not decrypted."""
        if self.snapshot is None or self.identity is None:
            raise locked(self.path, self.manifest)
        return self.snapshot, self.identity

    @property
    def snapshot_member(self) -> str:
        return M.SNAPSHOT_AGE if self.sealed is not None else M.SNAPSHOT

    def close(self) -> None:
        """Remove an extracted copy (and its private staging dir)."""
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- the reader


@dataclass
class _Found:
    size: int
    sha256: str
    data: Optional[bytes] = None


class _Reading:
    """One pass over one archive."""

    def __init__(self, path: str, staging_dir: Optional[str], hash_snapshot: bool, extract: bool,
                 limits: Limits, identities: Optional["Identities"] = None, need_plaintext: bool = False) -> None:
        self.path = path
        self.staging_dir = staging_dir or os.path.dirname(os.path.abspath(path))
        self.hash_snapshot = hash_snapshot
        self.extract = extract
        self.limits = limits
        self.found: Dict[str, _Found] = {}
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
        advice = _HOSTILE if isinstance(exc, RefusedError) else _CORRUPT
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
        self.found[norm] = _Found(h.size, hashlib.sha256(data).hexdigest(), data)
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


def open_archive(
    path: str,
    *,
    staging_dir: Optional[str] = None,
    hash_snapshot: bool = True,
    key: Optional[bytes] = None,
    limits: Limits = DEFAULT_LIMITS,
    extract: bool = False,
    identities: Optional["Identities"] = None,
    need_plaintext: bool = False,
) -> Archive:
    """Read, check and (when compressed, or with ``extract``) stage the archive at ``path``.

    ``hash_snapshot=False`` (plain tar only: listing) reads the snapshot's meta and identity pages
    but not all of its bytes, so its sha256 and trailer are not checked (``not_checked`` says so);
    a compressed snapshot is always hashed, as it must stream past anyway. ``key``: the cluster's
    manifest key, for the signature. ``extract``: copy a plain tar's snapshot into ``staging_dir``
    too, in the same pass (for tools that need a file of its own: ``snapshot status``).
    ``identities``: decrypt an encrypted snapshot with them (into ``staging_dir``);
    ``need_plaintext``: refuse (IdentityRefused) an encrypted one that cannot be decrypted.
    Raises BackupCorrupt or RefusedError, each one sentence with what the operator can do."""
    r = _Reading(path, staging_dir, hash_snapshot, extract, limits, identities, need_plaintext)
    try:
        return _open(r, key)
    except AgentError as exc:
        if r.stage is not None:
            shutil.rmtree(r.stage, ignore_errors=True)
        raise r.fail(exc) from None
    except OSError as exc:
        if r.stage is not None:
            shutil.rmtree(r.stage, ignore_errors=True)
        raise BackupCorrupt(f"{path}: cannot read it ({exc.strerror or exc}); check the path and permissions") from None
    except BaseException:
        if r.stage is not None:
            shutil.rmtree(r.stage, ignore_errors=True)
        raise


def _open(r: _Reading, key: Optional[bytes]) -> Archive:
    path = r.path
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a fifo must not block us
    with os.fdopen(fd, "rb") as fh:
        import stat as _stat

        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise RefusedError("not a regular file")
        head = fh.read(BLOCK)
        fh.seek(0)
        compression = sniff(head)
        if compression == "unknown":
            if not head:
                raise BackupCorrupt("empty file")
            raise BackupCorrupt("not a tar archive (no ustar header, no gzip or zstd magic)")
        if compression == "none" and (r.extract or r.identities is not None):
            # the snapshot is copied before a plain tar's manifest (last) would be read: read the
            # headers and the manifest first (seeks only), so sizes are checked against it before
            # a byte is written; then the one read of the data
            r.prescan = True
            r.walk(fh, compression)
            r.prescan = False
            r.found, r.order, r.mtimes = {}, [], {}
            fh.seek(0)
        r.walk(fh, compression)
    checked: List[str] = []
    not_checked: List[str] = []
    what = {"none": "plain tar", "gzip": "gzip-compressed tar (magic 1f8b)", "zstd": "zstd-compressed tar (magic 28b52ffd)"}
    checked.append(f"format: {what[compression]}, read from the content; members "
                   f"{', '.join(r.order)}: names, types and sizes all allowed")
    if r.snap_path is None and r.sealed is None:
        raise BackupCorrupt(f"no {M.SNAPSHOT} in the archive")
    if r.sealed is not None and r.snap_path is None:
        return _sealed_archive(r, compression, checked, not_checked, key)
    assert r.snap_path is not None
    if r.check is None and r.hash_snapshot:
        r.hash_in_place()
    facts: SnapshotFacts
    if r.check is not None:
        facts = r.check.finish()
    else:
        from ..etcd.snapdb import read_meta

        meta = read_meta(lambda off, n: _pread(r.snap_path or "", r.snap_offset + off, n), r.snap_size)
        facts = SnapshotFacts(r.snap_size, None, meta.page_size, meta.txid, meta.high_water, meta.root, False)
    source = SnapshotSource(r.snap_path, r.snap_offset, r.snap_size, r.stage is not None, facts.sha256, facts)
    try:
        identity = parse_identity(source.read_at, source.size)
    except SnapshotFormatError as exc:
        raise BackupCorrupt(f"{M.SNAPSHOT}: {exc.message}") from None
    checked.append(f"{M.SNAPSHOT}: {facts.lines()}")
    if facts.sha256 is None:
        not_checked.append(f"{M.SNAPSHOT}: not hashed this time (listing): sha256 and etcd's trailer not compared")
    checked.append(f"{M.SNAPSHOT}: identity read from its own db: {describe_identity(identity)}")
    sealed = r.sealed
    if sealed is not None:
        sealed = compare(sealed, r.manifest, facts.sha256, checked, not_checked)
    kind, sig = _manifest_lines(r, facts, key, checked, not_checked)
    return Archive(
        path=r.path, kind=kind, compression=compression, manifest=r.manifest, signature=sig,
        conf=_data(r, M.CONF), unit=_data(r, M.UNIT),
        snapshot=source, identity=identity, checked=tuple(checked), not_checked=tuple(not_checked),
        members=tuple(r.order), mtimes=tuple(sorted(r.mtimes.items())), sealed=sealed, _stage=r.stage,
    )


def _data(r: _Reading, name: str) -> Optional[bytes]:
    f = r.found.get(name)
    return f.data if f is not None else None


def _sealed_archive(r: _Reading, compression: str, checked: List[str], not_checked: List[str],
                    key: Optional[bytes]) -> Archive:
    """An encrypted snapshot read without its key: everything but the snapshot itself."""
    assert r.sealed is not None
    if r.need_plaintext:
        raise locked(r.path, r.manifest)
    sealed = compare(r.sealed, r.manifest, None, checked, not_checked)
    kind, sig = _manifest_lines(r, None, key, checked, not_checked)
    return Archive(
        path=r.path, kind=kind, compression=compression, manifest=r.manifest, signature=sig,
        conf=_data(r, M.CONF), unit=_data(r, M.UNIT), snapshot=None, identity=None,
        checked=tuple(checked), not_checked=tuple(not_checked), members=tuple(r.order),
        mtimes=tuple(sorted(r.mtimes.items())), sealed=sealed, _stage=r.stage,
    )


def _manifest_lines(r: _Reading, facts: Optional[SnapshotFacts], key: Optional[bytes], checked: List[str],
                    not_checked: List[str]) -> Tuple[str, str]:
    """(kind, signature state), the members compared with the manifest, and what that proved."""
    conf = r.found.get(M.CONF)
    unit = r.found.get(M.UNIT)
    m = r.manifest
    if m is None:
        kind, sig = "runbook", "unsigned"
        not_checked.append("no manifest.json (a runbook tarball): no recorded sha256 to compare the files with, "
                           "no record of when, where or by whom it was taken")
    else:
        kind = "agent"
        sig = m.signature_state(key)
        _compare(r, m, facts, checked, not_checked)
        if sig == "valid":
            assert m.signature is not None
            checked.append(f"manifest signature valid (key {m.signature.key_id}): its checksums are the writer's")
        elif sig == "invalid":  # the caller refuses it; listing shows it quarantined
            not_checked.append("manifest signature INVALID: it was changed after it was signed, "
                               "nothing it says can be trusted")
        elif sig == "unsigned":
            not_checked.append("manifest unsigned: its claims (time, host, cluster) are trusted for nothing")
        else:
            not_checked.append(f"manifest signed with a key this host does not have "
                               f"({m.signature.key_id if m.signature else '?'}): its claims are trusted for nothing")
        for n, why in sorted(m.rendered.items()):
            not_checked.append(f"{n}: rendered by the agent ({why}), not a copy of the host's file")
    for n, f in ((M.CONF, conf), (M.UNIT, unit)):
        if f is None and not (m is not None and n in m.missing):
            not_checked.append(f"{n}: not in the archive")
    return kind, sig


@dataclass(frozen=True)
class Peek:
    """What listing learns cheaply: a compressed archive is read only up to its snapshot."""

    path: str
    kind: str
    compression: str
    manifest: Optional[Manifest]
    signature: str
    identity: Optional[SnapshotIdentity]  # None: compressed or encrypted, snapshot not read
    snapshot_size: int
    encrypted: bool = False  # the snapshot member is etcd_snapshot.db.age


def peek_archive(path: str, *, key: Optional[bytes] = None, limits: Limits = DEFAULT_LIMITS) -> Peek:
    """A cheap look for ``backup list``: a plain tar is read as by ``open_archive`` but without
    hashing the snapshot (its meta and identity pages are read in place); a compressed one up to
    the snapshot's header only (our manifest comes first in it). Same errors as open_archive."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a fifo must not block us
    try:
        import stat as _stat

        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise RefusedError(f"{path}: not a regular file; {_HOSTILE}", details=["not a regular file"])
        head = os.pread(fd, BLOCK, 0)
    finally:
        os.close(fd)
    if sniff(head) not in ("gzip", "zstd"):  # plain tar, or not a tar: open_archive says which
        a = open_archive(path, hash_snapshot=False, key=key, limits=limits)
        size = a.snapshot.size if a.snapshot is not None else a.sealed.plaintext_size if a.sealed is not None else 0
        return Peek(path, a.kind, a.compression, a.manifest, a.signature, a.identity, size, a.sealed is not None)
    r = _Reading(path, None, False, False, limits)
    r.peek = True
    try:
        with open(path, "rb") as fh:
            r.walk(fh, sniff(head))
    except AgentError as exc:
        raise r.fail(exc) from None
    except OSError as exc:
        raise BackupCorrupt(f"{path}: cannot read it ({exc.strerror or exc}); check the path and permissions") from None
    if not r.stopped:
        raise r.fail(BackupCorrupt(f"no {M.SNAPSHOT} in the archive"))
    m = r.manifest
    sig = m.signature_state(key) if m is not None else "unsigned"
    encrypted = M.SNAPSHOT_AGE in r.order
    return Peek(path, "agent" if m is not None else "runbook", sniff(head), m, sig, None, r.snap_size, encrypted)


def _pread(path: str, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a fifo must not block us
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _compare(r: _Reading, m: Manifest, facts: Optional[SnapshotFacts], checked: List[str],
             not_checked: List[str]) -> None:
    """Every member against the manifest: present, same size, same sha256 (an encrypted snapshot
    is ``sealed.compare``'s)."""
    if r.sealed is None and m.encryption is not None:
        raise BackupCorrupt(f"the manifest says the snapshot is encrypted ({M.SNAPSHOT_AGE}), the archive holds "
                            f"{M.SNAPSHOT}")
    for n in M.FILE_NAMES:
        want = m.files.get(n)
        if n == M.SNAPSHOT_AGE:
            continue
        if n == M.SNAPSHOT:
            if want is None or facts is None:
                continue
            if facts.size != want.size:
                raise BackupCorrupt(f"{n}: {facts.size} bytes, the manifest says {want.size}")
            if facts.sha256 is None:
                continue
            if facts.sha256 != want.sha256:
                raise BackupCorrupt(f"{n}: sha256 mismatch (manifest {want.sha256[:16]}..., archive {facts.sha256[:16]}...)")
            checked.append(f"{n}: {facts.size} bytes, sha256 matches the manifest")
            continue
        got = r.found.get(n)
        if want is None and got is None:
            if n in m.missing:
                not_checked.append(f"{n}: not in the backup ({m.missing[n]})")
            continue
        if want is None:
            raise BackupCorrupt(f"{n}: in the archive but not in the manifest")
        if got is None:
            raise BackupCorrupt(f"{n}: listed in the manifest but missing from the archive")
        if got.sha256 != want.sha256:
            raise BackupCorrupt(f"{n}: sha256 mismatch (manifest {want.sha256[:16]}..., archive {got.sha256[:16]}...)")
        checked.append(f"{n}: {got.size} bytes, sha256 matches the manifest")


def describe_identity(ident: SnapshotIdentity) -> str:
    members = ", ".join(
        f"{m.id_hex} {m.name or '(unnamed)'} {','.join(m.peer_urls) or '-'}{' learner' if m.is_learner else ''}"
        for m in ident.members
    ) or "no members"
    out = f"members {members}; revision {ident.revision}"
    if ident.compact_revision:
        out += f", compacted at {ident.compact_revision}"
    if ident.removed_member_ids:
        out += f"; {len(ident.removed_member_ids)} removed member id(s)"
    return out


def remove_stale_stages(directory: str) -> List[str]:
    """Staging dirs left by a reader that died (its pid is gone); call with the operation lock."""
    removed: List[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for n in names:
        if not n.startswith(STAGE_PREFIX):
            continue
        pid = n[len(STAGE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(os.path.join(directory, n), ignore_errors=True)
        removed.append(n)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

