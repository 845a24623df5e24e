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

import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, List, Optional, Tuple

from etcd_agent.backup import manifest as M
from etcd_agent.backup.manifest import Manifest
from etcd_agent.backup.readpass import DEFAULT_LIMITS, HOSTILE, STAGE_PREFIX, Limits, Reading
from etcd_agent.backup.sealed import Sealed, compare, locked
from etcd_agent.backup.snapcheck import SnapshotFacts
from etcd_agent.backup.tarstream import BLOCK, sniff
from etcd_agent.errors import AgentError, BackupCorrupt, RefusedError, SnapshotFormatError
from etcd_agent.etcd.snapdb import SnapshotIdentity, parse_identity
from etcd_agent.fs import NotARegularFile, open_regular, regular_fd

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities

log = logging.getLogger(__name__)


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
        fh = open_regular(self.path, follow_symlinks=True)
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
    r = Reading(path, staging_dir, hash_snapshot, extract, limits, identities, need_plaintext)
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


def _open(r: Reading, key: Optional[bytes]) -> Archive:
    path = r.path
    try:
        fh = open_regular(path, follow_symlinks=True)  # a fifo must not block us
    except NotARegularFile:
        raise RefusedError("not a regular file") from None
    with fh:
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
        from etcd_agent.etcd.snapdb import read_meta

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


def _data(r: Reading, name: str) -> Optional[bytes]:
    f = r.found.get(name)
    return f.data if f is not None else None


def _sealed_archive(r: Reading, compression: str, checked: List[str], not_checked: List[str],
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


def _manifest_lines(r: Reading, facts: Optional[SnapshotFacts], key: Optional[bytes], checked: List[str],
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
    try:
        fd = regular_fd(path, follow_symlinks=True)  # a fifo must not block us
    except NotARegularFile:
        raise RefusedError(f"{path}: not a regular file; {HOSTILE}", details=["not a regular file"]) from None
    try:
        head = os.pread(fd, BLOCK, 0)
    finally:
        os.close(fd)
    if sniff(head) not in ("gzip", "zstd"):  # plain tar, or not a tar: open_archive says which
        a = open_archive(path, hash_snapshot=False, key=key, limits=limits)
        size = a.snapshot.size if a.snapshot is not None else a.sealed.plaintext_size if a.sealed is not None else 0
        return Peek(path, a.kind, a.compression, a.manifest, a.signature, a.identity, size, a.sealed is not None)
    r = Reading(path, None, False, False, limits)
    r.peek = True
    try:
        with open_regular(path, follow_symlinks=True) as fh:
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


def _compare(r: Reading, m: Manifest, facts: Optional[SnapshotFacts], checked: List[str],
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


def stale_stages(directory: str) -> List[str]:
    """The staging dirs in ``directory`` of readers that died (their pid is gone): names."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if not n.startswith(STAGE_PREFIX):
            continue
        pid = n[len(STAGE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        out.append(n)
    return out


def remove_stale_stages(directory: str) -> List[str]:
    """Staging dirs left by a reader that died (its pid is gone); call with the operation lock."""
    removed = stale_stages(directory)
    for n in removed:
        shutil.rmtree(os.path.join(directory, n), ignore_errors=True)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

