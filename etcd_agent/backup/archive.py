"""The backup archive: ``etcd-YYYY-MM-DD-HH-MM-SS.tar[.gz|.zst]`` and its manifest.

Members: ``etcd.conf``, ``etcd.service`` (each only if it existed; the manifest says when not),
``etcd_snapshot.db`` and ``manifest.json`` (every other file's size and sha256).

With recipients (``[backup] encrypt_to``) the snapshot member is ``etcd_snapshot.db.age``: the
snapshot is encrypted to them as it streams (``etcd_agent.age``), in the same single pass; the
in-stream checks still run on the plaintext, the few pages the revision lookup needs are read back
through the encryptor (the key never leaves this process), and the manifest records the
recipients and the plaintext's size and sha256 (``manifest.Encryption``). No plaintext byte of
the snapshot is written to the backup dir.

Plain ``.tar`` is written in a single pass: the snapshot member's header goes out with a
placeholder size, the snapshot streams from etcd straight into the file (hashed and checked on
the way, see ``snapcheck``), then the header is rewritten in place with the real size and
checksum. Memory stays flat whatever the db size; the data is written exactly once. The manifest
comes last (it holds the snapshot's sha256).

Every archive is written under a hidden temporary name in the backup dir (``.NAME.partial``),
fsynced, linked to its final name (never overwriting) and the dir fsynced: a crash leaves only a
hidden partial file, which the next run removes and which no reader ever lists.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import tarfile
import zlib
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
)

from etcd_agent.backup.manifest import (
    CONF,
    ENCRYPTED_FORMAT_VERSION,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST,
    SNAPSHOT,
    SNAPSHOT_AGE,
    UNIT,
    Encryption,
    Manifest,
)
from etcd_agent.backup.outstream import (
    SKIPPABLE_HEADER,
    Chunk,
    FileOut,
    ZstdFrames,
    compress_bound,
    pump,
    zstandard_module,
)
from etcd_agent.backup.snapcheck import SnapshotFacts, StreamCheck
from etcd_agent.errors import BackupCorrupt, BackupError, SnapshotFormatError
from etcd_agent.etcd.snapdb import SnapshotIdentity, parse_identity
from etcd_agent.fs import fsync_dir, open_regular

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import X25519Recipient

log = logging.getLogger(__name__)

__all__ = ["CONF", "FORMAT", "FORMAT_VERSION", "MANIFEST", "SNAPSHOT", "SNAPSHOT_AGE", "UNIT"]
MEMBER_NAMES = (CONF, UNIT, SNAPSHOT, MANIFEST)
EXTENSIONS = {"none": ".tar", "gzip": ".tar.gz", "zstd": ".tar.zst"}
NAME_RE = re.compile(r"^etcd-(\d{4})-(\d\d)-(\d\d)-(\d\d)-(\d\d)-(\d\d)\.tar(\.gz|\.zst)?$")
PARTIAL_RE = re.compile(r"^\.etcd-.*\.partial$")
BLOCK = 512
RECORD = 20 * BLOCK
COPY_CHUNK = 1 << 20


# ---------------------------------------------------------------- names


def archive_name(when: datetime, compression: str = "none") -> str:
    return when.strftime("etcd-%Y-%m-%d-%H-%M-%S") + EXTENSIONS[compression]


def parse_name(name: str) -> Optional[Tuple[datetime, str]]:
    """(naive timestamp from the name, compression) or None if it is not a backup name."""
    m = NAME_RE.match(name)
    if not m:
        return None
    try:
        y, mo, d, h, mi, s = (int(x) for x in m.groups()[:6])
        when = datetime(y, mo, d, h, mi, s)
    except ValueError:
        return None
    comp = {None: "none", ".gz": "gzip", ".zst": "zstd"}[m.group(7)]
    return when, comp


def compression_of(path: str) -> str:
    """The compression a name asks for (writing only: readers go by the content, ``reader.sniff``)."""
    if path.endswith(".tar.gz"):
        return "gzip"
    if path.endswith(".tar.zst"):
        return "zstd"
    return "none"


# ---------------------------------------------------------------- writing


@dataclass(frozen=True)
class FileInfo:
    size: int
    sha256: str


@dataclass(frozen=True)
class Written:
    path: str
    size: int
    manifest: Manifest
    facts: SnapshotFacts
    identity: SnapshotIdentity
    sha256: str  # of the snapshot (the plaintext when encrypted), as hashed while it streamed

    @property
    def encryption(self) -> Optional[Encryption]:
        return self.manifest.encryption

    @property
    def revision(self) -> int:
        return self.identity.revision


def _header(name: str, size: int, mtime: int) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = mtime
    ti.mode = 0o600
    ti.uname = ti.gname = "root"
    # GNU format: sizes >= 8 GiB go base-256 in the same 12 bytes, so the header is always 512
    buf = ti.tobuf(format=tarfile.GNU_FORMAT)
    if len(buf) != BLOCK:
        raise BackupError(f"tar header for {name} is {len(buf)} bytes, expected {BLOCK}")
    return buf


def _pad(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


def _member(name: str, data: bytes, mtime: int) -> bytes:
    return _header(name, len(data), mtime) + data + _pad(len(data))


def _manifest_member(manifest: Manifest, mtime: int) -> bytes:
    """The manifest as a tar member, refused when larger than any reader accepts (MAX_MANIFEST):
    an archive whose manifest cannot be read back is no backup, whatever its compression."""
    data = manifest.to_bytes()
    if len(data) > MAX_MANIFEST:
        raise BackupError(f"the manifest is {len(data)} bytes, more than a reader accepts ({MAX_MANIFEST})")
    return _member(MANIFEST, data, mtime)


def _checked_into(check: StreamCheck, write: Callable[[Chunk], None]) -> Callable[[List[Chunk]], None]:
    """A ``pump`` consumer: every chunk through the stream check, then to ``write``."""
    def consume(batch: List[Chunk]) -> None:
        for chunk in batch:
            check.update(chunk)
            write(chunk)
    return consume


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# (files, snapshot facts, identity read from the snapshot's db) -> manifest
ManifestBuilder = Callable[[Dict[str, FileInfo], SnapshotFacts, SnapshotIdentity], Manifest]


def write_archive(
    directory: str,
    name: str,
    *,
    chunks: Iterable[Chunk],
    files: Dict[str, bytes],
    build_manifest: ManifestBuilder,
    mtime: int,
    encrypt_to: Sequence["X25519Recipient"] = (),
    key: Optional[bytes] = None,
) -> Written:
    """Stream ``chunks`` (the snapshot) and ``files`` into ``directory/name`` atomically.

    ``build_manifest(files, snapshot facts, identity)`` returns the manifest once the snapshot is
    in; the writer adds the encryption it did and signs it with ``key`` (None: unsigned).
    ``encrypt_to``: encrypt the snapshot to these recipients (plain tar only). Raises
    BackupCorrupt / BackupError; never leaves a visible file on failure.
    """
    compression = compression_of(name)
    if encrypt_to and compression != "none":
        raise BackupError(f"{name}: an encrypted snapshot is written to a plain tar only (ciphertext does not "
                          "compress)")

    def finish(man: Manifest) -> Manifest:
        return man.signed(key) if key is not None else man

    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.partial")
    infos = {n: FileInfo(len(d), _sha256(d)) for n, d in files.items()}
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            if compression == "none":
                facts, identity, manifest = _write_plain(fd, chunks, files, infos, build_manifest, finish, mtime,
                                                         encrypt_to)
            elif compression == "gzip":
                facts, identity, manifest = _write_gzip(fd, os.path.join(directory, f".{name}.snapshot.partial"),
                                                        chunks, files, infos, build_manifest, finish, mtime)
            else:
                facts, identity, manifest = _write_zstd(fd, chunks, files, infos, build_manifest, finish, mtime)
            # the file's mtime is the archive's time (its name's): a file modified later than its
            # name says, or in the future, is then a sign of tampering or a wrong clock
            os.utime(fd, (mtime, mtime))
            os.fsync(fd)
        finally:
            os.close(fd)
        # link, not rename: never replace an existing backup of the same name
        os.link(tmp, final)
        os.unlink(tmp)
        fsync_dir(directory)
    except BaseException as exc:
        _unlink_quietly(tmp)
        if isinstance(exc, OSError):
            raise BackupError(f"writing {final} failed: {exc.strerror or exc}; partial file removed") from exc
        raise
    size = os.stat(final).st_size
    return Written(final, size, manifest, facts, identity, facts.sha256 or "")


def _small_members(files: Dict[str, bytes], mtime: int) -> bytes:
    return b"".join(_member(n, files[n], mtime) for n in (CONF, UNIT) if n in files)


def _end_blocks(at: int) -> bytes:
    """Two zero blocks, then zeros up to the next 10 KiB record (as tar writes it)."""
    end = at + 2 * BLOCK
    return b"\0" * (2 * BLOCK + (-end % RECORD))


def _write_plain(
    fd: int,
    chunks: Iterable[Chunk],
    files: Dict[str, bytes],
    infos: Dict[str, FileInfo],
    build_manifest: ManifestBuilder,
    finish: Callable[[Manifest], Manifest],
    mtime: int,
    encrypt_to: Sequence["X25519Recipient"] = (),
) -> Tuple[SnapshotFacts, SnapshotIdentity, Manifest]:
    out = FileOut(fd)
    out.write(_small_members(files, mtime))
    header_at = out.pos
    member = SNAPSHOT_AGE if encrypt_to else SNAPSHOT
    out.write(_header(member, 0, mtime))  # placeholder size, patched below
    data_at = out.pos
    check = StreamCheck()
    if encrypt_to:
        from etcd_agent.age import Encryptor

        enc = Encryptor(encrypt_to)
        ct_sha = hashlib.sha256()  # the manifest's sha256 of the member as stored: the ciphertext

        def seal(batch: List[Chunk]) -> None:
            for chunk in batch:
                check.update(chunk)  # etcd's trailer, the bbolt meta, the size: on the plaintext
                sealed = enc.update(chunk)
                if sealed:
                    ct_sha.update(sealed)
                    out.write(sealed)

        pump(chunks, seal)
        sealed = enc.finish()
        ct_sha.update(sealed)
        out.write(sealed)
        size = enc.ciphertext_size
        facts = check.finish()
        # the revision lookup reads a few pages: decrypted back from what was just written
        read_at = enc.plaintext_reader(lambda off, n: os.pread(fd, n, data_at + off))
        infos[SNAPSHOT_AGE] = FileInfo(size, ct_sha.hexdigest())
    else:

        def store(batch: List[Chunk]) -> None:
            for chunk in batch:
                check.update(chunk)
            out.write_all(batch)

        pump(chunks, store)
        size = check.size
        facts = check.finish()

        def read_at(off: int, n: int) -> bytes:
            return os.pread(fd, n, data_at + off)

        infos[SNAPSHOT] = FileInfo(facts.size, facts.sha256 or "")
    out.write(_pad(size))
    identity = _identity(read_at, facts.size)
    os.pwrite(fd, _header(member, size, mtime), header_at)
    manifest = build_manifest(infos, facts, identity)
    if encrypt_to:
        manifest = replace(manifest, format_version=ENCRYPTED_FORMAT_VERSION, encryption=Encryption(
            tuple(str(r) for r in enc.recipients), facts.size, facts.sha256 or ""))
    manifest = finish(manifest)
    out.write(_manifest_member(manifest, mtime))
    out.write(_end_blocks(out.pos))
    return facts, identity, manifest


def head_room(files: Dict[str, bytes]) -> int:
    """Bytes reserved at the start of a zstd archive for its head: the manifest (at most
    MAX_MANIFEST: a reader refuses a larger one), etcd.conf, etcd.service and the snapshot's header,
    compressed, and the skippable frame's header."""
    most = 2 * BLOCK + MAX_MANIFEST + BLOCK + len(_small_members(files, 0))
    return compress_bound(most) + SKIPPABLE_HEADER


def _write_zstd(
    fd: int,
    chunks: Iterable[Chunk],
    files: Dict[str, bytes],
    infos: Dict[str, FileInfo],
    build_manifest: ManifestBuilder,
    finish: Callable[[Manifest], Manifest],
    mtime: int,
) -> Tuple[SnapshotFacts, SnapshotIdentity, Manifest]:
    """A zstd-compressed tar in one pass: the manifest first (listing reads one frame), yet
    written last, into room kept for it (``outstream.ZstdFrames``)."""
    room = head_room(files)
    frames = ZstdFrames(FileOut(fd, room), room)
    check = StreamCheck()
    pump(chunks, _checked_into(check, frames.write))
    frames.end_snapshot()
    facts = check.finish()
    frames.tail(_pad(facts.size) + b"\0" * (2 * BLOCK))
    identity = _identity(frames.read_at, facts.size)
    infos[SNAPSHOT] = FileInfo(facts.size, facts.sha256 or "")
    manifest = finish(build_manifest(infos, facts, identity))
    frames.head(_manifest_member(manifest, mtime) + _small_members(files, mtime) + _header(SNAPSHOT, facts.size, mtime))
    return facts, identity, manifest


def _write_gzip(
    fd: int,
    spool: str,
    chunks: Iterable[Chunk],
    files: Dict[str, bytes],
    infos: Dict[str, FileInfo],
    build_manifest: ManifestBuilder,
    finish: Callable[[Manifest], Manifest],
    mtime: int,
) -> Tuple[SnapshotFacts, SnapshotIdentity, Manifest]:
    """gzip, for configs that name it (zstd is the better choice: see the README). A gzip stream
    cannot take a header patched after the data, and the manifest goes first, so the snapshot is
    spooled to a 0600 file beside the archive (one extra write of the db, checked as it lands),
    then the tar is streamed through gzip -1. Memory stays flat; the spool is always removed."""
    sfd = os.open(spool, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(sfd, 0o600)
        check = StreamCheck()
        pump(chunks, _checked_into(check, FileOut(sfd).write))
        facts = check.finish()
        identity = _identity(lambda off, n: os.pread(sfd, n, off), facts.size)
        infos[SNAPSHOT] = FileInfo(facts.size, facts.sha256 or "")
        manifest = finish(build_manifest(infos, facts, identity))
        out = FileOut(fd)
        gz = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: a gzip wrapper
        at = 0

        def put(data: bytes) -> None:
            nonlocal at
            at += len(data)
            piece = gz.compress(data)
            if piece:
                out.write(piece)

        put(_manifest_member(manifest, mtime) + _small_members(files, mtime)
            + _header(SNAPSHOT, facts.size, mtime))
        done = 0
        while done < facts.size:
            block = os.pread(sfd, min(COPY_CHUNK, facts.size - done), done)
            if not block:
                raise BackupError(f"{spool}: the spooled snapshot ended at {done} of {facts.size} bytes")
            put(block)
            done += len(block)
        put(_pad(facts.size))
        put(_end_blocks(at))
        out.write(gz.flush())
        return facts, identity, manifest
    finally:
        os.close(sfd)
        _unlink_quietly(spool)


def _identity(read_at: Callable[[int, int], bytes], size: int) -> SnapshotIdentity:
    """Who the snapshot just written belongs to, read back from its own db (a handful of pages)."""
    try:
        return parse_identity(read_at, size)
    except SnapshotFormatError as exc:
        raise BackupCorrupt(f"snapshot: {exc.message}") from None


def _info(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode = size, mtime, 0o600
    ti.uname = ti.gname = "root"
    return ti


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover - nothing better to do
        log.warning("could not remove %s: %s", path, exc)


def remove_partials(directory: str) -> List[str]:
    """Remove hidden partial files left by a crashed run, and staging dirs of readers that died
    (call with the operation lock held)."""
    from etcd_agent.backup.reader import remove_stale_stages

    removed = remove_stale_stages(directory)
    for entry in os.listdir(directory):
        if PARTIAL_RE.match(entry):
            _unlink_quietly(os.path.join(directory, entry))
            removed.append(entry)
    if removed:
        log.info("removed %d partial file(s) left by an interrupted backup: %s", len(removed), ", ".join(removed))
    return removed


def now(utc: bool) -> datetime:
    """The archive timestamp: UTC (default) or local wall-clock time, to the second."""
    t = datetime.now(timezone.utc) if utc else datetime.now().astimezone()
    return t.replace(microsecond=0)


# ---------------------------------------------------------------- reading (compatibility)


def open_tar(path: str, *, seekable: bool) -> tarfile.TarFile:
    """A tarfile reader, the compression found from the content (not the name). For code not yet
    on ``reader.open_archive``, which is the bounded reader every new caller should use."""
    from etcd_agent.backup.tarstream import sniff

    with open_regular(path, follow_symlinks=True) as fh:
        comp = sniff(fh.read(512))
    if comp == "gzip":
        return tarfile.open(path, "r|gz")
    if comp == "zstd":
        zstandard = zstandard_module()
        fh = open_regular(path, follow_symlinks=True)
        # read_across_frames: the archives written here are several frames (outstream.ZstdFrames)
        reader = zstandard.ZstdDecompressor().stream_reader(fh, closefd=True, read_across_frames=True)
        return tarfile.open(fileobj=reader, mode="r|")
    return tarfile.open(path, "r:" if seekable else "r|")


def read_manifest(path: str) -> Dict[str, Any]:
    """The archive's manifest as a dict (checked by the bounded reader); BackupCorrupt if none."""
    from etcd_agent.backup.reader import open_archive

    with open_archive(path, hash_snapshot=False) as a:
        if a.manifest is None:
            raise BackupCorrupt(f"{path}: no manifest.json (a runbook tarball, or not an etcd-agent backup)")
        return a.manifest.to_json()
