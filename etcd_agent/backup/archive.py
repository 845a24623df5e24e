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

import gzip
import hashlib
import io
import logging
import os
import re
import tarfile
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import (
    TYPE_CHECKING,
    Any,
    BinaryIO,
    Callable,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
)

from ..errors import BackupCorrupt, BackupError, SnapshotFormatError
from ..etcd.snapdb import SnapshotIdentity, parse_identity
from ..fs import fsync_dir
from .manifest import (
    CONF,
    ENCRYPTED_FORMAT_VERSION,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SNAPSHOT,
    SNAPSHOT_AGE,
    UNIT,
    Encryption,
    Manifest,
)
from .snapcheck import SnapshotFacts, StreamCheck

if TYPE_CHECKING:  # pragma: no cover
    from ..age import X25519Recipient

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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# (files, snapshot facts, identity read from the snapshot's db, `snapshot status` or None) -> manifest
ManifestBuilder = Callable[[Dict[str, FileInfo], SnapshotFacts, SnapshotIdentity, Optional[Dict[str, Any]]], Manifest]


def write_archive(
    directory: str,
    name: str,
    *,
    chunks: Iterable[bytes],
    files: Dict[str, bytes],
    build_manifest: ManifestBuilder,
    mtime: int,
    status_of_file: Optional[Callable[[str], Dict[str, Any]]] = None,
    encrypt_to: Sequence["X25519Recipient"] = (),
    key: Optional[bytes] = None,
) -> Written:
    """Stream ``chunks`` (the snapshot) and ``files`` into ``directory/name`` atomically.

    ``build_manifest(files, snapshot facts, identity, status)`` returns the manifest once
    the snapshot is in; the writer adds the encryption it did and signs it with ``key`` (None:
    unsigned). ``status_of_file(path)`` (``snapshot status``) is only run when the snapshot exists
    as a file of its own anyway (compressed archives); plain archives rely on the stream checks.
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
    spool: Optional[str] = None
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "wb", buffering=COPY_CHUNK) as out:
            if compression == "none":
                facts, identity, manifest = _write_plain(out, chunks, files, infos, build_manifest, finish, mtime,
                                                         encrypt_to)
            else:
                # Compressed: the manifest (which needs the snapshot's sha256) goes first so that
                # listing reads one member, and tar headers cannot be patched inside a compressed
                # stream - so the snapshot is spooled to a 0600 temp file first (one extra write).
                spool = os.path.join(directory, f".{name}.snapshot.partial")
                facts, identity = _spool(spool, chunks)
                status = status_of_file(spool) if status_of_file is not None else None
                infos[SNAPSHOT] = FileInfo(facts.size, facts.sha256 or "")
                manifest = finish(build_manifest(infos, facts, identity, status))
                _write_compressed(out, compression, manifest, files, spool, mtime)
            out.flush()
            # the file's mtime is the archive's time (its name's): a file modified later than its
            # name says, or in the future, is then a sign of tampering or a wrong clock
            os.utime(out.fileno(), (mtime, mtime))
            os.fsync(out.fileno())
        # link, not rename: never replace an existing backup of the same name
        os.link(tmp, final)
        os.unlink(tmp)
        fsync_dir(directory)
    except BaseException as exc:
        _unlink_quietly(tmp)
        if isinstance(exc, OSError):
            raise BackupError(f"writing {final} failed: {exc.strerror or exc}; partial file removed") from exc
        raise
    finally:
        if spool is not None:
            _unlink_quietly(spool)
    size = os.stat(final).st_size
    return Written(final, size, manifest, facts, identity, facts.sha256 or "")


def _write_plain(
    out: BinaryIO,
    chunks: Iterable[bytes],
    files: Dict[str, bytes],
    infos: Dict[str, FileInfo],
    build_manifest: ManifestBuilder,
    finish: Callable[[Manifest], Manifest],
    mtime: int,
    encrypt_to: Sequence["X25519Recipient"] = (),
) -> Tuple[SnapshotFacts, SnapshotIdentity, Manifest]:
    for n in (CONF, UNIT):
        if n in files:
            out.write(_member(n, files[n], mtime))
    header_at = out.tell()
    member = SNAPSHOT_AGE if encrypt_to else SNAPSHOT
    out.write(_header(member, 0, mtime))  # placeholder size, patched below
    fd = out.fileno()
    data_at = header_at + BLOCK
    check = StreamCheck()
    if encrypt_to:
        from ..age import Encryptor

        enc = Encryptor(encrypt_to)
        ct_sha = hashlib.sha256()
        for chunk in chunks:
            check.update(chunk)  # etcd's trailer, the bbolt meta, the size: on the plaintext
            sealed = enc.update(chunk)
            if sealed:
                ct_sha.update(sealed)
                out.write(sealed)
        sealed = enc.finish()
        ct_sha.update(sealed)
        out.write(sealed)
        size = enc.ciphertext_size
        out.write(_pad(size))
        out.flush()
        facts = check.finish()
        # the revision lookup reads a few pages: decrypted back from what was just written
        read_at = enc.plaintext_reader(lambda off, n: os.pread(fd, n, data_at + off))
        infos[SNAPSHOT_AGE] = FileInfo(size, ct_sha.hexdigest())
    else:
        for chunk in chunks:
            check.update(chunk)
            out.write(chunk)
        size = check.size
        out.write(_pad(size))
        out.flush()
        facts = check.finish()

        def read_at(off: int, n: int) -> bytes:
            return os.pread(fd, n, data_at + off)

        infos[SNAPSHOT] = FileInfo(facts.size, facts.sha256 or "")
    identity = _identity(read_at, facts.size)
    os.pwrite(fd, _header(member, size, mtime), header_at)
    manifest = build_manifest(infos, facts, identity, None)
    if encrypt_to:
        manifest = replace(manifest, format_version=ENCRYPTED_FORMAT_VERSION, encryption=Encryption(
            tuple(str(r) for r in enc.recipients), facts.size, facts.sha256 or ""))
    manifest = finish(manifest)
    out.write(_member(MANIFEST, manifest.to_bytes(), mtime))
    end = out.tell() + 2 * BLOCK
    out.write(b"\0" * (2 * BLOCK + (-end % RECORD)))
    return facts, identity, manifest


def _identity(read_at: Callable[[int, int], bytes], size: int) -> SnapshotIdentity:
    """Who the snapshot just written belongs to, read back from its own db (a handful of pages)."""
    try:
        return parse_identity(read_at, size)
    except SnapshotFormatError as exc:
        raise BackupCorrupt(f"snapshot: {exc.message}") from None


def _spool(path: str, chunks: Iterable[bytes]) -> Tuple[SnapshotFacts, SnapshotIdentity]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "r+b", buffering=COPY_CHUNK) as fh:
        check = StreamCheck()
        for chunk in chunks:
            check.update(chunk)
            fh.write(chunk)
        fh.flush()
        facts = check.finish()
        identity = _identity(lambda off, n: os.pread(fd, n, off), facts.size)
    return facts, identity


def _write_compressed(
    out: BinaryIO, compression: str, manifest: Manifest, files: Dict[str, bytes], spool: str, mtime: int
) -> None:
    stream: Any
    if compression == "gzip":
        stream = gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=mtime)
    else:
        stream = _zstd().ZstdCompressor(level=3).stream_writer(out, closefd=False)
    with tarfile.open(fileobj=stream, mode="w|", format=tarfile.GNU_FORMAT) as tar:
        for n, data in [(MANIFEST, manifest.to_bytes())] + [(n, files[n]) for n in (CONF, UNIT) if n in files]:
            tar.addfile(_info(n, len(data), mtime), io.BytesIO(data))
        with open(spool, "rb") as src:
            tar.addfile(_info(SNAPSHOT, os.fstat(src.fileno()).st_size, mtime), src)
    stream.close()


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise BackupError("zstd archives need the Python package zstandard (pip install zstandard)") from None
    return zstandard


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
    from .reader import remove_stale_stages

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
    from .tarstream import sniff

    with open(path, "rb") as fh:
        comp = sniff(fh.read(512))
    if comp == "gzip":
        return tarfile.open(path, "r|gz")
    if comp == "zstd":
        zstandard = _zstd()
        fh = open(path, "rb")
        reader = zstandard.ZstdDecompressor().stream_reader(fh, closefd=True)
        return tarfile.open(fileobj=reader, mode="r|")
    return tarfile.open(path, "r:" if seekable else "r|")


def read_manifest(path: str) -> Dict[str, Any]:
    """The archive's manifest as a dict (checked by the bounded reader); BackupCorrupt if none."""
    from .reader import open_archive

    with open_archive(path, hash_snapshot=False) as a:
        if a.manifest is None:
            raise BackupCorrupt(f"{path}: no manifest.json (a runbook tarball, or not an etcd-agent backup)")
        return a.manifest.to_json()
