"""``backup verify``: is this archive complete, intact, restorable and ours?

Reads the archive once as a stream: every member is checked against the manifest (size, sha256),
the snapshot is also run through the stream checks (etcd's sha256 trailer, bbolt meta pages) and
extracted into a private 0700 temp dir for ``snapshot status``. Members that could escape that dir
or that we never write (``..``, absolute paths, links, devices, duplicates, unknown names) are
refused before anything is written. Every problem is reported precisely, not just "corrupt".
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import BackupCorrupt
from .archive import (
    MANIFEST,
    MAX_MANIFEST,
    MEMBER_NAMES,
    SNAPSHOT,
    compression_of,
    open_tar,
    parse_manifest,
    parse_name,
)
from .snapcheck import StreamCheck

log = logging.getLogger(__name__)

CHUNK = 1 << 20
StatusFn = Callable[[str], Dict[str, Any]]


@dataclass
class VerifyReport:
    path: str
    problems: List[str] = field(default_factory=list)
    checked: List[str] = field(default_factory=list)
    manifest: Optional[Dict[str, Any]] = None
    status: Optional[Dict[str, Any]] = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> Dict[str, Any]:
        m = self.manifest or {}
        return {
            "path": self.path,
            "ok": self.ok,
            "problems": self.problems,
            "checked": self.checked,
            "revision": m.get("revision"),
            "cluster_id": (m.get("cluster") or {}).get("id"),
            "snapshot_status": self.status,
        }


def member_problem(ti: tarfile.TarInfo, seen: Dict[str, int]) -> Optional[str]:
    """Why this tar member must not be extracted, or None."""
    name = ti.name
    if name.startswith("/") or name.startswith("\\"):
        return f"member {name!r} has an absolute path"
    if ".." in name.replace("\\", "/").split("/"):
        return f"member {name!r} contains '..'"
    if ti.issym() or ti.islnk():
        return f"member {name!r} is a link (to {ti.linkname!r})"
    if ti.ischr() or ti.isblk() or ti.isfifo():
        return f"member {name!r} is a device or fifo"
    if not ti.isreg():
        return f"member {name!r} is not a regular file (type {ti.type!r})"
    if name not in MEMBER_NAMES:
        return f"unexpected member {name!r} (a backup holds only {', '.join(MEMBER_NAMES)})"
    if name in seen:
        return f"duplicate member {name!r}"
    return None


def verify(
    path: str,
    *,
    status_fn: Optional[StatusFn] = None,
    expect_cluster_id: Optional[str] = None,
    tmp_parent: Optional[str] = None,
    lineage: Sequence[str] = (),
) -> VerifyReport:
    """Check ``path`` completely; problems are collected in the report, never raised.

    ``lineage``: earlier ids of this cluster (a restore makes a new cluster id; its backups from
    before the restore are still this cluster's, not foreign)."""
    report = VerifyReport(path)
    try:
        archive_size = os.stat(path).st_size
    except OSError as exc:
        report.problems.append(f"cannot read {path}: {exc.strerror or exc}")
        return report
    if parse_name(os.path.basename(path)) is None:
        report.checked.append("note: file name is not etcd-YYYY-MM-DD-HH-MM-SS.tar[.gz|.zst]")
    tmpdir = tempfile.mkdtemp(prefix=".etcd-agent-verify-", dir=tmp_parent)  # mkdtemp: 0700
    try:
        found = _read_members(path, archive_size, tmpdir, report)
        if report.manifest is not None:
            _compare(report, found)
            snap = os.path.join(tmpdir, SNAPSHOT)
            if status_fn is not None and not report.problems and os.path.exists(snap):
                _status(report, status_fn, snap)
            if expect_cluster_id is not None:
                got = (report.manifest.get("cluster") or {}).get("id")
                if str(got).lower() in {x.lower() for x in lineage}:
                    report.checked.append(f"cluster id {got}: this cluster before a restore (lineage)")
                elif str(got).lower() != expect_cluster_id.lower():
                    report.problems.append(
                        f"foreign cluster: archive is from cluster id {got} "
                        f"({(report.manifest.get('cluster') or {}).get('name')!r}), "
                        f"this cluster's id is {expect_cluster_id}"
                    )
                else:
                    report.checked.append(f"cluster id {got} matches")
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return report


def _read_members(path: str, archive_size: int, tmpdir: str, report: VerifyReport) -> Dict[str, Dict[str, Any]]:
    """Stream every member: hash it, extract the snapshot; returns name -> {size, sha256, ...}."""
    found: Dict[str, Dict[str, Any]] = {}
    seen: Dict[str, int] = {}
    current = None
    done = 0
    try:
        tar = open_tar(path, seekable=False)
    except (tarfile.TarError, OSError, EOFError) as exc:
        report.problems.append(f"not a readable tar archive: {exc}")
        return found
    try:
        while True:
            current = None
            ti = tar.next()
            if ti is None:
                break
            problem = member_problem(ti, seen)
            if problem:
                report.problems.append(f"refused: {problem}; nothing extracted from it")
                return found
            seen[ti.name] = ti.offset
            current, done = ti, 0
            src = tar.extractfile(ti)
            assert src is not None
            sha = hashlib.sha256()
            check = StreamCheck() if ti.name == SNAPSHOT else None
            out = None
            if ti.name == SNAPSHOT:
                fd = os.open(os.path.join(tmpdir, SNAPSHOT), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                out = os.fdopen(fd, "wb")
            body = bytearray() if ti.name == MANIFEST and ti.size <= MAX_MANIFEST else None
            try:
                while True:
                    chunk = src.read(CHUNK)
                    if not chunk:
                        break
                    done += len(chunk)
                    sha.update(chunk)
                    if check is not None:
                        check.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    if body is not None:
                        body += chunk
            finally:
                if out is not None:
                    out.close()
            if done != ti.size:
                raise EOFError("short read")
            found[ti.name] = {"size": done, "sha256": sha.hexdigest(), "check": check}
            if ti.name == MANIFEST:
                if body is None:
                    report.problems.append(f"manifest.json is {ti.size} bytes, larger than any real one")
                else:
                    try:
                        report.manifest = parse_manifest(bytes(body), "manifest.json")
                    except BackupCorrupt as exc:
                        report.problems.append(exc.message)
    except (tarfile.TarError, OSError, EOFError) as exc:
        if current is not None:
            if compression_of(path) == "none":
                # plain tar: the data present is exactly what lies between the header and EOF
                have = max(0, min(current.size, archive_size - current.offset_data))
                report.problems.append(
                    f"truncated: member {current.name!r} declares {current.size} bytes, only {have} present "
                    f"(archive ends at byte {archive_size})"
                )
            else:
                report.problems.append(
                    f"truncated: member {current.name!r} declares {current.size} bytes, about {done} could be "
                    f"decompressed before the {archive_size}-byte archive ran out ({exc})"
                )
        else:
            report.problems.append(f"archive unreadable after {len(seen)} member(s) (archive is {archive_size} bytes): {exc}")
    finally:
        tar.close()
    if report.manifest is None and not any(p.startswith("manifest") for p in report.problems):
        report.problems.append("no manifest.json: incomplete archive or not an etcd-agent backup")
    return found


def _compare(report: VerifyReport, found: Dict[str, Dict[str, Any]]) -> None:
    manifest = report.manifest or {}
    files: Dict[str, Dict[str, Any]] = manifest.get("files", {})
    for name in MEMBER_NAMES:
        if name == MANIFEST:
            continue
        want, got = files.get(name), found.get(name)
        if want is None and got is None:
            missing = (manifest.get("missing") or {}).get(name)
            if missing:
                report.checked.append(f"{name}: not in the backup ({missing})")
            continue
        if want is None:
            report.problems.append(f"{name}: in the archive but not in the manifest")
            continue
        if got is None:
            if not any(p.startswith("truncated") for p in report.problems):
                report.problems.append(f"{name}: listed in the manifest but missing from the archive")
            continue
        if got["size"] != want["size"]:
            report.problems.append(f"{name}: size {got['size']} bytes, manifest says {want['size']}")
        elif got["sha256"] != want["sha256"]:
            report.problems.append(
                f"{name}: sha256 mismatch (manifest {want['sha256'][:16]}..., archive {got['sha256'][:16]}...)"
            )
        else:
            report.checked.append(f"{name}: {got['size']} bytes, sha256 ok")
    snap = found.get(SNAPSHOT)
    if snap is not None and snap.get("check") is not None:
        try:
            facts = snap["check"].finish(SNAPSHOT)
            report.checked.append(
                f"{SNAPSHOT}: etcd sha256 trailer ok, bbolt meta ok ({facts.high_water} pages of {facts.page_size})"
            )
        except BackupCorrupt as exc:
            report.problems.append(exc.message)


def _status(report: VerifyReport, status_fn: StatusFn, snap: str) -> None:
    try:
        st = status_fn(snap)
    except BackupCorrupt as exc:
        report.problems.append(exc.message.replace(snap, SNAPSHOT))
        return
    report.status = st
    want = (report.manifest or {}).get("revision")
    if want is not None and st.get("revision") != want:
        report.problems.append(f"{SNAPSHOT}: snapshot status says revision {st.get('revision')}, manifest says {want}")
    else:
        report.checked.append(
            f"snapshot status ok: revision {st.get('revision')}, {st.get('totalKey')} keys, hash {st.get('hash')}"
        )
