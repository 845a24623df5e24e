"""The backup a restore reads from: its snapshot bytes, what is claimed about them, what was checked.

``open_source`` resolves ``--from`` (a path, a file name in the backup dir in any timestamp form,
a date, ``latest``) and reads the archive with the one bounded reader (``backup.reader``), which
accepts the agent's own tarballs and the runbook's (``etcdctl snapshot save`` + ``tar``, gzip or
not, no manifest). Cheap first: headers, manifest, signature and the snapshot's own identity
(its members, from a few pages of its db) are read without reading the whole snapshot; a plain
tar's snapshot is then shipped straight from the archive (no copy here) and hashed as it is read,
a compressed one is decompressed once into a private staging dir. An encrypted one
(``etcd_snapshot.db.age``) is decrypted here, with ``--identity``, into that private staging dir on
this master only: the other masters receive the plaintext through their node sessions, as always.
Without an identity it is refused before anything is touched.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Optional, Tuple

from ..backup.reader import Archive, open_archive
from ..config import Config
from ..errors import RefusedError
from ..etcd.snapdb import SnapshotIdentity
from .plan import SourceFacts

if TYPE_CHECKING:  # pragma: no cover
    from ..age import Identities


@dataclass
class Source:
    path: str
    kind: str  # "agent" | "runbook"
    size: int
    sha256: Optional[str]  # the signed manifest's, or the reader's own hash; None until shipped
    revision: Optional[int]
    etcd_version: Optional[str]  # the manifest's claim; None for a runbook tarball
    identity: Optional[SnapshotIdentity]  # from the snapshot's own db
    checked: Tuple[str, ...] = ()
    archive: Optional[Archive] = None
    # a component test's source: bytes at (file, offset) without an archive around them
    snapshot_path: Optional[str] = None
    offset: int = 0

    @property
    def member_ids(self) -> Tuple[str, ...]:
        return tuple(f"{x:x}" for x in self.identity.member_ids) if self.identity else ()

    def open(self) -> BinaryIO:
        """A reader of exactly the snapshot's bytes."""
        if self.archive is not None:
            return self.archive.plaintext()[0].open()
        assert self.snapshot_path is not None
        fh = open(self.snapshot_path, "rb")
        fh.seek(self.offset)
        return fh

    def read_at(self, offset: int, n: int) -> bytes:
        """``n`` bytes of the snapshot from ``offset`` (fewer at its end): samples, no stream."""
        if self.archive is not None:
            return self.archive.plaintext()[0].read_at(offset, n)
        assert self.snapshot_path is not None
        fd = os.open(self.snapshot_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, max(0, min(n, self.size - offset)), self.offset + offset)
        finally:
            os.close(fd)

    def facts(self, lines: Tuple[str, ...] = ()) -> SourceFacts:
        return SourceFacts(self.kind, self.revision, self.size, self.sha256, tuple(self.checked) + lines)

    def close(self) -> None:
        if self.archive is not None:
            self.archive.close()


def open_source(cfg: Config, spec: str, staging_parent: str, *, hash_now: bool = False,
                identities: Optional["Identities"] = None) -> Source:
    """The backup ``spec`` names, read and checked (``hash_now``: hash the whole snapshot now, as
    a dry run does; otherwise it is hashed as it is shipped). An encrypted one is decrypted with
    ``identities`` (IdentityRefused without them, or with a wrong key: exit 3, nothing touched)."""
    from ..backup.catalog import resolve_from
    from ..backup.keys import local_key

    path = resolve_from(cfg, spec).path
    arc = open_archive(path, staging_dir=staging_parent, hash_snapshot=hash_now, key=local_key(cfg).key,
                       identities=identities, need_plaintext=True)
    try:
        if arc.signature == "invalid":
            raise RefusedError(f"{path}: its manifest was changed after it was written (the signature does not "
                               "match); nothing touched. Restore another backup, or `backup import` the tarball "
                               "to have it checked from its content alone")
        m = arc.manifest
        snap, ident = arc.plaintext()
        claimed = None
        if m is not None and arc.signature == "valid":
            claimed = m.encryption.plaintext_sha256 if m.encryption is not None else m.files[m.snapshot_member].sha256
        lines = []
        if arc.sealed is not None:
            lines.append(f"encrypted ({arc.sealed.describe()}): decrypted with {arc.sealed.identity_file} into a "
                         "private staging dir on this master only; the other masters receive the plaintext over "
                         "their node sessions, into their 0700 work dirs")
        lines += list(arc.checked)
        if arc.signature in ("unsigned", "unknown-key") and m is not None:
            lines.append(f"manifest {arc.signature}: what it says is trusted for nothing; checked from the content")
        lines += [f"not checked here: {n}" for n in arc.not_checked]
        return Source(
            path=path, kind=arc.kind, size=snap.size, sha256=snap.sha256 or claimed,
            revision=ident.revision, etcd_version=m.etcd_version if m is not None else None,
            identity=ident, checked=tuple(lines), archive=arc,
        )
    except BaseException:
        arc.close()
        raise
