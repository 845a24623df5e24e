"""``backup verify``: is this archive complete, intact, restorable and ours? Says what it proved.

Everything goes through the bounded reader (``reader.open_archive``) in one pass: member names,
types and sizes, every sha256 against the manifest (agent archives), the snapshot's trailer, meta
pages and size, the manifest signature, and whose snapshot it is from its own db (``identity``).
Then ``snapshot status`` runs on the staged copy, and its revision must be the one read from the
db. A runbook tarball (no manifest) is called what it is, and checked for all it can be; what
cannot be proven (no recorded sha256 to compare) is listed, not hidden.
"""
from __future__ import annotations

import logging
import tarfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from etcd_agent.backup.archive import MEMBER_NAMES
from etcd_agent.backup.identity import Evidence, Verdict, judge
from etcd_agent.backup.reader import Archive, open_archive
from etcd_agent.backup.readpass import DEFAULT_LIMITS, Limits
from etcd_agent.errors import BackupCorrupt, IdentityRefused, RefusedError

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities
    from etcd_agent.config import Config

log = logging.getLogger(__name__)

StatusFn = Callable[[str], Dict[str, Any]]


@dataclass
class VerifyReport:
    path: str
    problems: List[str] = field(default_factory=list)
    checked: List[str] = field(default_factory=list)
    not_checked: List[str] = field(default_factory=list)
    manifest: Optional[Dict[str, Any]] = None  # as a dict (restore's older code reads it so)
    status: Optional[Dict[str, Any]] = None
    kind: Optional[str] = None
    signature: Optional[str] = None
    compression: Optional[str] = None
    revision: Optional[int] = None  # read from the snapshot's own db
    verdict: Optional[Verdict] = None
    tool_failed: bool = False  # `snapshot status` itself failed (may be the tool, not the file)
    encryption: Optional[Dict[str, Any]] = None  # the snapshot is encrypted: for whom, and was it decrypted

    @property
    def keyless(self) -> bool:
        """An encrypted snapshot checked without its key: good as far as it goes, not all of it."""
        return self.encryption is not None and not self.encryption["decrypted"]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> Dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "kind": self.kind,
            "compression": self.compression,
            "signature": self.signature,
            "revision": self.revision,
            "problems": self.problems,
            "checked": self.checked,
            "not_checked": self.not_checked,
            "identity": None if self.verdict is None else {
                "ok": self.verdict.ok, "same_cluster": self.verdict.same_cluster,
                "proven": list(self.verdict.proven), "unproven": list(self.verdict.unproven),
                "refused": list(self.verdict.refused),
            },
            "snapshot_status": self.status,
            "encryption": self.encryption,
        }


def member_problem(ti: tarfile.TarInfo, seen: Dict[str, int]) -> Optional[str]:
    """Why this tar member must not be extracted, or None (for tarfile-based callers)."""
    name = ti.name
    if name.startswith(("/", "\\")):
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
    tmp_parent: Optional[str] = None,
    key: Optional[bytes] = None,
    cfg: Optional["Config"] = None,
    evidence: Optional[Evidence] = None,
    new_cluster: bool = False,
    limits: Limits = DEFAULT_LIMITS,
    identities: Optional["Identities"] = None,
) -> VerifyReport:
    """Check ``path`` completely; problems are collected in the report, never raised.

    With ``cfg`` (and ``evidence``: what could be found of the current cluster) the snapshot's
    identity is judged too; ``status_fn`` runs ``snapshot status`` on a staged copy. An encrypted
    snapshot is decrypted with ``identities`` into the staging dir; without them everything that
    needs no key is checked, and the report says what was not (IdentityRefused for a wrong key)."""
    report = VerifyReport(path)
    try:
        arc = open_archive(path, staging_dir=tmp_parent, key=key, limits=limits, extract=status_fn is not None,
                           identities=identities)
    except IdentityRefused:
        raise  # a wrong key is the operator's to fix, not a problem of the file
    except (BackupCorrupt, RefusedError) as exc:
        report.problems.append(exc.message)
        return report
    try:
        _fill(report, arc, status_fn, cfg, evidence, new_cluster)
    finally:
        arc.close()
    return report


def _fill(report: VerifyReport, arc: Archive, status_fn: Optional[StatusFn], cfg: Optional["Config"],
          evidence: Optional[Evidence], new_cluster: bool) -> None:
    report.kind, report.signature, report.compression = arc.kind, arc.signature, arc.compression
    report.manifest = arc.manifest.to_json() if arc.manifest is not None else None
    report.checked += list(arc.checked)
    report.not_checked += list(arc.not_checked)
    if arc.sealed is not None:
        report.encryption = {"format": "age", "recipients": list(arc.sealed.recipients),
                             "decrypted": arc.sealed.decrypted, "plaintext_size": arc.sealed.plaintext_size}
    if arc.signature == "invalid":
        report.problems.append("manifest.json was changed after it was signed (signature invalid): "
                               "do not trust this backup")
    m = arc.manifest
    if arc.snapshot is None or arc.identity is None:  # encrypted, no identity given
        if status_fn is not None:
            report.not_checked.append("`snapshot status` not run: the snapshot is encrypted (pass --identity FILE "
                                      "to decrypt it into the staging dir first)")
        report.not_checked.append("identity not judged: the snapshot's members are inside the encrypted db")
        return
    snap, ident = arc.snapshot, arc.identity
    report.revision = ident.revision
    if m is not None and m.revision != ident.revision:
        report.problems.append(f"the manifest says revision {m.revision}, the snapshot's db holds {ident.revision}")
    if status_fn is not None:
        try:
            st = status_fn(snap.path)
        except BackupCorrupt as exc:
            report.tool_failed = True
            report.problems.append(exc.message.replace(snap.path, "etcd_snapshot.db"))
        else:
            report.status = st
            if st.get("revision") != ident.revision:
                report.problems.append(f"`snapshot status` says revision {st.get('revision')}, "
                                       f"the db holds {ident.revision}")
            else:
                report.checked.append(f"snapshot status ok on the {'decrypted' if arc.sealed else 'staged'} copy: "
                                      f"revision {st.get('revision')}, {st.get('totalKey')} keys, hash {st.get('hash')}")
    else:
        report.not_checked.append("`snapshot status` not run (no staged copy asked for)")
    if cfg is not None:
        verdict = judge(ident, cfg, evidence or Evidence(), new_cluster=new_cluster)
        report.verdict = verdict
        report.checked += [f"identity: {p}" for p in verdict.proven]
        report.not_checked += [f"identity: {u}" for u in verdict.unproven]
        report.problems += list(verdict.refused)
    else:
        report.not_checked.append("identity not judged: no config to compare the snapshot's members with")
    if m is not None and (m.cluster_id is not None or m.members is not None):
        report.not_checked.append("the manifest's cluster id and member list are claims: ignored for identity")
