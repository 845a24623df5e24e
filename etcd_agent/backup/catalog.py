"""The backups in the backup dir: listing that a hostile file cannot break, and ``--from``.

Every regular, non-hidden file in the dir is an entry: our ``etcd-…`` archives, runbook tarballs
(``etcd-2019-08-07.tar``), anything else that landed there - except delta segments
(``etcd-delta-….seg``), which belong to the chain of a full backup (``delta.chains``). An entry is *good* (``complete``) or
*quarantined* with one line saying why: unreadable, corrupt, foreign (another cluster layout, or
member ids that match nothing of the current cluster), or dated in the future (by its name's
timestamp or its mtime, beyond ``CLOCK_MARGIN``). Quarantined files are never chosen, never take
a retention slot and are never deleted; they are shown so the operator can deal with them.

*Verified* means the bytes on disk were checked (``checks``): never what a manifest says.
Listing reads little: a cached check when the file is unchanged since, else ``reader.peek_archive``
(a plain tar's headers, manifest, meta and identity pages; a compressed one up to its snapshot).
"""
from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Tuple

from etcd_agent.backup import checks as C
from etcd_agent.backup.checks import SYSTEM_WALL_CLOCK, WallClock
from etcd_agent.backup.identity import Evidence, judge, layout_problems, shares_members
from etcd_agent.backup.manifest import ORIGINS, SNAPSHOT
from etcd_agent.backup.reader import Peek, peek_archive
from etcd_agent.errors import AgentError, RefusedError, UsageError


class DrillSummary(Protocol):
    """What a listing shows of the last restore drill of a backup (``drill.record.with_drills``
    attaches it: drills sit above backups, the catalog only carries the record)."""

    @property
    def ok(self) -> bool: ...

    def to_json(self) -> Dict[str, Any]: ...

    def summary(self) -> str: ...


if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.chain.chains import Scan
    from etcd_agent.chain.check import BaseBackup
    from etcd_agent.config import Config
    from etcd_agent.etcd.snapdb import SnapshotIdentity

log = logging.getLogger(__name__)

CLOCK_MARGIN = timedelta(minutes=5)
DATE_SPEC_RE = re.compile(r"^\d{4}(-\d{2}){0,5}$")
# any name that starts with a timestamp the runbook or the agent would write
STAMP_RE = re.compile(r"^etcd-(\d{4})-(\d\d)-(\d\d)(?:-(\d\d)(?:-(\d\d)(?:-(\d\d))?)?)?(?=[._-]|$)")


@dataclass(frozen=True)
class Entry:
    name: str
    path: str
    time: datetime  # aware: the name's timestamp, else the mtime
    size: int
    revision: Optional[int]
    verified: bool  # the bytes on disk were checked (and found good) and have not changed since
    compression: str
    problem: Optional[str] = None  # why it is quarantined (None: a good backup)
    manifest: Optional[Dict[str, Any]] = None
    kind: str = "?"  # agent | runbook | ?
    signature: str = "?"
    check: Optional[str] = None  # how and when it was checked, or why it is unchecked
    member_ids: Tuple[str, ...] = ()
    notes: Tuple[str, ...] = field(default=())
    encrypted: bool = False  # the snapshot member is age-encrypted (etcd_snapshot.db.age)
    drill: Optional[DrillSummary] = None  # the last restore drill of exactly these bytes
    # the snapshot db's sha256: as the agent found it checking these bytes, else a signed
    # manifest's; None when neither is known (a delta chain names it: ``delta.segchain.continues``)
    snapshot_sha256: Optional[str] = None
    origin: str = "operator"  # who took it: "operator" (cron, by hand) | "daemon" (continuous backup)
    # the daemon took it inside this delta chain (its id) as a checkpoint (signed manifests only):
    # not a chain's base, counted apart by retention (``retention.plan_checkpoints``)
    checkpoint_of: Optional[str] = None

    @property
    def base(self) -> "BaseBackup":
        """What a delta chain continuing this backup must name (``delta.segchain``)."""
        from etcd_agent.chain.check import BaseBackup

        return BaseBackup(self.snapshot_sha256 or "", int(self.time.timestamp() * 1000))

    @property
    def complete(self) -> bool:
        """A good backup (not quarantined): one that may be chosen and that takes a slot."""
        return self.problem is None

    @property
    def stamp(self) -> str:
        m = STAMP_RE.match(self.name)
        return "-".join(x for x in m.groups() if x) if m else self.name

    def to_json(self) -> Dict[str, Any]:
        m = self.manifest or {}
        return {
            "name": self.name,
            "path": self.path,
            "time": self.time.isoformat(),
            "size": self.size,
            "revision": self.revision,
            "verified": self.verified,
            "check": self.check,
            "kind": self.kind,
            "signature": self.signature,
            "compression": self.compression,
            "member": m.get("member"),
            "member_ids": list(self.member_ids),
            "problem": self.problem,
            "quarantined": self.problem is not None,
            "encrypted": self.encrypted,
            "encryption": m.get("encryption"),
            "origin": self.origin,
            "checkpoint_of": self.checkpoint_of,
            "notes": list(self.notes),
            "drill": None if self.drill is None else {**self.drill.to_json(), "summary": self.drill.summary()},
        }


def name_time(name: str, utc: bool = True) -> Optional[datetime]:
    """The timestamp in a backup-like name (``etcd-2019-08-07[-13-00-05]…``), aware, or None."""
    m = STAMP_RE.match(name)
    if not m:
        return None
    y, mo, d, h, mi, sec = (int(x) if x else 0 for x in m.groups())
    try:
        naive = datetime(y, mo, d, h, mi, sec)
    except ValueError:
        return None
    return naive.replace(tzinfo=timezone.utc) if utc else naive.astimezone()


def _candidates(directory: str) -> List[str]:
    """Names that may be backups: not hidden, not a delta segment (``delta.chains`` lists those
    with the full backup they continue)."""
    from etcd_agent.chain.segments import parse_name as segment_range

    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if not n.startswith(".") and segment_range(n) is None)


def entry_for(
    path: str,
    *,
    utc: bool = True,
    clock: WallClock = SYSTEM_WALL_CLOCK,
    cfg: Optional["Config"] = None,
    evidence: Optional[Evidence] = None,
    key: Optional[bytes] = None,
    cache: Optional[Dict[str, C.Check]] = None,
) -> Entry:
    """Describe one file; whatever is wrong with it becomes ``problem``, never an exception
    (except FileNotFoundError: it vanished)."""
    name = os.path.basename(path)
    st = os.stat(path, follow_symlinks=False)
    mtime = datetime.fromtimestamp(st.st_mtime, timezone.utc)
    when = name_time(name, utc) or mtime
    base = Entry(name, path, when, st.st_size, None, False, "?")
    if stat.S_ISLNK(st.st_mode):
        return replace(base, problem="a symlink (not followed): backups are regular files")
    if not stat.S_ISREG(st.st_mode):
        return replace(base, problem="not a regular file")
    future = _future(when, mtime, clock.now())
    cached = C.lookup(cache if cache is not None else C.load(os.path.dirname(path)), name, st)
    if cached is not None and not cached.ok:
        return _q(base, cached.problem or "failed its last check", cached)
    try:
        peek = peek_archive(path, key=key)
    except AgentError as exc:
        msg = exc.details[0] if exc.details else exc.message.replace(path + ": ", "")
        what = "refused" if isinstance(exc, RefusedError) else "unreadable or corrupt"
        return replace(base, problem=f"{what}: {msg}")
    except OSError as exc:
        return replace(base, problem=f"unreadable: {exc.strerror or exc}")
    info = _described(base, peek, cached)
    if peek.signature == "invalid":
        return replace(info, problem="its manifest was changed after it was signed (signature invalid)")
    if future is not None:
        return replace(info, problem=future)
    if peek.identity is not None and cfg is not None:
        info = _whose(info, peek.identity, cfg, evidence)
        if info.problem is not None:
            return info
    if cached is not None:
        how = f"verified ({cached.how}, {datetime.fromtimestamp(cached.at, timezone.utc).isoformat(timespec='seconds')})"
        return replace(info, verified=True, check=how)
    return replace(info, check="unchecked: its bytes were not checked since they last changed")


def _future(when: datetime, mtime: datetime, now: datetime) -> Optional[str]:
    """Why a file dated ahead of the clock (a clock that once ran ahead) is not a backup to trust."""
    if when > now + CLOCK_MARGIN:
        return f"dated in the future by its name ({when.isoformat()}; now {now.isoformat(timespec='seconds')})"
    if mtime > now + CLOCK_MARGIN:
        return f"modified in the future (mtime {mtime.isoformat(timespec='seconds')}; now {now.isoformat(timespec='seconds')})"
    return None


def _described(base: Entry, peek: Peek, cached: Optional[C.Check]) -> Entry:
    """The entry with what the archive's first bytes show (and the check cache remembers)."""
    ident = peek.identity
    member_ids: Tuple[str, ...] = tuple(m.id_hex for m in ident.members) if ident is not None else (
        cached.member_ids if cached is not None else ())
    revision = ident.revision if ident is not None else (cached.revision if cached else None)
    notes: List[str] = []
    if peek.kind == "runbook":
        notes.append("runbook tarball: no manifest, so no recorded sha256 to compare with")
    elif peek.signature in ("unsigned", "unknown-key"):
        notes.append(f"manifest {peek.signature}: its claims (time, host, cluster) are trusted for nothing")
    enc = peek.manifest.encryption if peek.manifest is not None else None
    if peek.encrypted:
        to = f", to {len(enc.recipients)} recipient(s)" if enc is not None else ""
        notes.append(f"encrypted (age{to}): listing cannot read its snapshot (backup verify --identity FILE does)")
    elif ident is None:
        notes.append(f"{peek.compression}-compressed: listing does not read its snapshot (verify does)")
    manifest = peek.manifest.to_json() if peek.manifest is not None else None
    signed = peek.manifest if peek.manifest is not None and peek.signature == "valid" else None
    sha = cached.sha256 if cached is not None and cached.sha256 else None
    if sha is None and signed is not None and SNAPSHOT in signed.files:
        sha = signed.files[SNAPSHOT].sha256 or None
    # who took it, as only a signed manifest can say: an unsigned claim of "daemon" would let a
    # forged file send an operator's backup into the daemon's slots, so it counts as an operator's
    origin = signed.origin if signed is not None and signed.origin in ORIGINS else "operator"
    return replace(base, revision=revision, compression=peek.compression, manifest=manifest, kind=peek.kind,
                   signature=peek.signature, member_ids=member_ids, notes=tuple(notes), encrypted=peek.encrypted,
                   snapshot_sha256=sha, origin=origin, checkpoint_of=signed.checkpoint_of if signed else None)


def _whose(info: Entry, ident: "SnapshotIdentity", cfg: "Config", evidence: Optional[Evidence]) -> Entry:
    """``info`` quarantined as foreign, or with a note where its layout differs from the config."""
    # quarantined only when no member is the config's: a backup from before a scale-up or a
    # scale-down is still this cluster's history (restore says what differs)
    layout = layout_problems(ident, cfg)
    if layout and not shares_members(ident, cfg):
        return replace(info, problem=f"foreign: another cluster layout ({'; '.join(layout)})")
    if layout:
        info = replace(info, notes=info.notes + (f"layout differs from the config: {'; '.join(layout)}",))
    if evidence is not None and judge(ident, cfg, evidence, new_cluster=False).same_cluster is False:
        return replace(info, problem=f"foreign: member ids {','.join(info.member_ids)} match nothing of the current cluster")
    return info


def _q(base: Entry, problem: str, cached: C.Check) -> Entry:
    return replace(base, problem=problem, kind=cached.kind, revision=cached.revision,
                   check=f"failed ({cached.how})", member_ids=cached.member_ids)


def list_backups(
    directory: str,
    *,
    utc: bool = True,
    clock: WallClock = SYSTEM_WALL_CLOCK,
    cfg: Optional["Config"] = None,
    evidence: Optional[Evidence] = None,
    key: Optional[bytes] = None,
) -> List[Entry]:
    """Every file in ``directory`` (not hidden), newest first; good and quarantined alike."""
    out = []
    cache = C.load(directory) if os.path.isdir(directory) else {}
    for n in _candidates(directory):
        path = os.path.join(directory, n)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                continue
            e = entry_for(path, utc=utc, clock=clock, cfg=cfg, evidence=evidence, key=key, cache=cache)
            out.append(e)
        except FileNotFoundError:  # pruned while we looked
            continue
        except Exception as exc:  # noqa: BLE001 - one hostile file must never break the listing
            log.warning("cannot describe %s: %s", path, exc)
            st_size = 0
            try:
                st_size = os.lstat(path).st_size
            except OSError:
                pass
            out.append(Entry(n, path, datetime.fromtimestamp(0, timezone.utc), st_size, None, False, "?",
                             problem=f"unreadable: {type(exc).__name__}: {exc}"))
    out.sort(key=lambda e: (e.problem is None, e.time, e.name), reverse=True)
    return out


def good(entries: List[Entry]) -> List[Entry]:
    """The good backups, newest first."""
    return sorted((e for e in entries if e.complete), key=lambda e: (e.time, e.name), reverse=True)


def chain_checkpoints(entries: List[Entry], found: "Scan") -> List[Entry]:
    """``entries`` with every checkpoint a delta chain here vouches for marked as that chain's
    (``checkpoint_of``), and without a file of a vouched name whose snapshot is not known to be
    the one vouched for. Who a checkpoint is comes from its chain; a manifest says so only when
    signed, and a master restored from the bucket has no manifest key until its daemon's first
    full backup fetches it from etcd: taken for a full backup meanwhile, a checkpoint was copied
    to the bucket as the start of a chain of its own and became the base of a new watch."""
    vouched = {cp.name: (c.chain_id, cp.sha256) for c in found.chains for cp in c.checkpoints}
    out: List[Entry] = []
    for e in entries:
        if e.checkpoint_of or e.name not in vouched:
            out.append(e)
            continue
        chain_id, sha = vouched[e.name]
        if e.snapshot_sha256 == sha and chain_id:
            out.append(replace(e, checkpoint_of=chain_id))
        else:  # a checkpoint's name, and a snapshot not known to be it: neither a base nor a copy
            log.debug("%s: named as a checkpoint of delta chain %s, its snapshot not known to be the one vouched "
                      "for", e.name, chain_id[:8])
    return out


def latest(entries: List[Entry]) -> Tuple[Optional[Entry], List[str]]:
    """The newest good backup, and a sentence for each newer file passed over."""
    goods = good(entries)
    if not goods:
        return None, []
    newest = goods[0]
    skipped = [f"{e.name} is newer but quarantined ({e.problem}); using {newest.name}"
               for e in entries if not e.complete and e.time > newest.time]
    return newest, skipped


def resolve(directory: str, spec: str, *, utc: bool = True, clock: WallClock = SYSTEM_WALL_CLOCK,
            cfg: Optional["Config"] = None, evidence: Optional[Evidence] = None,
            key: Optional[bytes] = None) -> Entry:
    """``spec`` -> a good backup: a path, any file name in ``directory`` (whatever its form), a
    date(-time) prefix (``2019-08-07`` = the newest of that day, ``2019-08-07-13`` of that hour),
    or ``latest`` (the newest good one)."""
    spec = spec.strip()
    if not spec:
        raise UsageError("--from needs a backup: a path, a file name, a date like 2019-08-07, or latest")
    kw: Dict[str, Any] = {"utc": utc, "clock": clock, "cfg": cfg, "evidence": evidence, "key": key}
    if "/" in spec:
        if not os.path.isfile(spec):
            raise UsageError(f"--from {spec}: no such file")
        return _complete(entry_for(os.path.abspath(spec), **kw), spec)
    here = os.path.join(directory, spec)
    if not spec.startswith(".") and os.path.isfile(here):
        return _complete(entry_for(here, **kw), spec)
    entries = list_backups(directory, **kw)
    goods = good(entries)
    if spec == "latest":
        best, skipped = latest(entries)
        if best is None:
            bad = f" ({len(entries)} file(s) there, all quarantined: see `etcd-agent backup list`)" if entries else ""
            raise UsageError(f"--from latest: no good backup in {directory}{bad}")
        for s in skipped:
            log.warning("%s", s)
        return best
    if not DATE_SPEC_RE.match(spec):
        raise UsageError(
            f"--from {spec!r}: not a path, a file in {directory}, a date(-time) prefix like 2019-08-07 or "
            "2019-08-07-13, or latest"
        )
    matches = [e for e in goods if e.stamp == spec or e.stamp.startswith(spec + "-")]
    if not matches:
        have = f"good backups there range from {goods[-1].stamp} to {goods[0].stamp}" if goods else "there are none"
        raise UsageError(f"--from {spec}: no good backup from {spec} in {directory} ({have})")
    return matches[0]


def resolve_from(cfg: "Config", spec: str) -> Entry:
    """``resolve`` against the configured backup dir. No layout check here: a restore with
    ``--new-cluster`` may take another layout's backup on purpose, and judges identity itself."""
    from etcd_agent.backup import keys

    # with this host's manifest key, as `backup list` does: a signed manifest's snapshot sha256 is
    # then known, and a delta chain naming another backup's is judged by it the same way
    return resolve(cfg.backup.dir, spec, utc=cfg.backup.utc, key=keys.local_key(cfg).key)


def _complete(entry: Entry, spec: str) -> Entry:
    if not entry.complete:  # hostile or broken content: a refusal (exit 3), nothing touched
        raise RefusedError(f"--from {spec}: {entry.name} is not usable: {entry.problem}; nothing touched")
    return entry
