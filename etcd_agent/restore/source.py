"""The backup a restore reads from: its snapshot bytes, what is claimed about them, what was checked.

``open_source`` reads the archive once: its members are checked against the manifest and the
snapshot is extracted into a private staging dir, from which every host is shipped.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Dict, List, Optional, Tuple

from ..backup import archive
from ..backup.verify import member_problem, verify
from ..config import Config
from ..errors import RefusedError


@dataclass
class Source:
    path: str
    kind: str  # "agent" | "runbook"
    manifest: Dict[str, Any]
    snapshot_path: str
    offset: int
    size: int
    sha256: Optional[str]  # the manifest's claim; checked against the bytes as they are shipped
    revision: Optional[int]
    etcd_version: Optional[str]
    member_ids: Tuple[str, ...] = ()  # of the snapshot's own members (from its db)
    checked: List[str] = field(default_factory=list)
    staging: Optional[str] = None

    def open(self) -> BinaryIO:
        fh = open(self.snapshot_path, "rb")
        fh.seek(self.offset)
        return fh

    def close(self) -> None:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None


def open_source(cfg: Config, spec: str, staging_parent: str) -> Source:
    """The backup ``spec`` names (``--from``: a path, a name, a date, latest), read and checked."""
    from ..backup.catalog import resolve_from
    from ..etcd.tools import snapshot_status
    from ..hosts.local import LocalHost

    path = resolve_from(cfg, spec).path
    staging = tempfile.mkdtemp(prefix=".etcd-agent-restore-", dir=staging_parent)
    try:
        rep = verify(path, status_fn=lambda p: snapshot_status(LocalHost(), cfg, p), tmp_parent=staging)
        if not rep.ok:
            raise RefusedError(f"backup {path} fails verification; nothing touched", details=rep.problems)
        manifest = rep.manifest or {}
        snap = _extract_snapshot(path, staging, manifest)
        info = manifest["files"][archive.SNAPSHOT]
        rev = manifest.get("revision")
        return Source(path, "agent", manifest, snap, 0, int(info["size"]), str(info["sha256"]),
                      rev if isinstance(rev, int) else None,
                      manifest.get("etcd_version") if isinstance(manifest.get("etcd_version"), str) else None,
                      checked=list(rep.checked), staging=staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _extract_snapshot(path: str, dest: str, manifest: Dict[str, Any]) -> str:
    """Extract the snapshot into ``dest`` (0700); every member is checked before a byte is
    written, only our snapshot is written, with O_EXCL|O_NOFOLLOW: nothing lands outside."""
    seen: Dict[str, int] = {}
    tar = archive.open_tar(path, seekable=False)
    target = os.path.join(dest, archive.SNAPSHOT)
    try:
        while True:
            ti = tar.next()
            if ti is None:
                break
            problem = member_problem(ti, seen)
            if problem:
                raise RefusedError(f"{path}: refused: {problem}; nothing restored")
            seen[ti.name] = ti.offset
            if ti.name != archive.SNAPSHOT:
                continue
            src = tar.extractfile(ti)
            assert src is not None
            h = hashlib.sha256()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    h.update(chunk)
                    fh.write(chunk)
            want = (manifest.get("files") or {}).get(ti.name, {}).get("sha256")
            if want != h.hexdigest():
                raise RefusedError(f"{path}: {ti.name} sha256 does not match the manifest; nothing restored")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise RefusedError(f"{path}: unreadable archive ({exc}); nothing restored") from None
    finally:
        tar.close()
    if not os.path.exists(target):
        raise RefusedError(f"{path}: no {archive.SNAPSHOT} in the archive")
    return target
