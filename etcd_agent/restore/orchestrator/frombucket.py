"""`restore --from-bucket`: the disaster where every master lost its data dir *and* its backup dir,
and the bucket is all that is left.

What runs, in order, before any master is touched:

1. **List** (``plan_fetch``): the full backup the spec names (the same words as ``--from``:
   ``latest``, a file name, a date), chosen among the bucket's full backups - for a point in time,
   the newest at or before the target - and, for a point in time, its chain's segments and
   newest checkpoint at or before the target (``bucket.fetch.plan``; names from the bucket are
   hostile: only ours are taken; the other checkpoints, each a full backup's size, stay there).
   ``--dry-run`` stops here: it lists every object and its size and fetches nothing.
2. **Fetch into the staging dir** (``<backup dir>/.fetch/``, 0700, hidden from the catalog): each
   object streamed into its part file, its size and sha256 checked against the object's metadata
   as it streams, 4 at once (``bucket.staging.stage_all``, as ``backup fetch``); a run killed
   halfway is continued by the next.
3. **Check from the content, still in the staging dir** (``stagedchecks.check_staged``): the full backup is
   read with the one bounded reader - its manifest's signature with the manifest key (the copy the
   operator kept off-host: ``--key-file``), the snapshot's members from its own db against the
   config's names and peer URLs; each segment's name against the revisions and end time its header
   and footer hold (a name that lies is refused: two swapped segments would replay right but enter
   the backup dir misnamed); for a point in time the chain is checked as a restore checks it
   (continuity from the full backup's revision, each segment's sha256 links, signatures with the
   same key). The metadata of the bucket vouches for nothing but the bytes it came with: an object
   that passed its sha256 still has to pass these.
4. **Move into the backup dir** (``bucket.fetch.publish``): each file linked under its own name,
   never over a different file. Only then does the restore run, exactly as ``restore --from`` of
   that file (the orchestrator's plan, the pre-checks on every host, the confirmation), except
   that the chain's check of step 3 is carried into it, not made again (``pitr.carried``: taken
   only while every file in the backup dir is still the very inode that was checked).

A refusal at 1-3 writes nothing outside the staging dir (and removes what it fetched: bytes that
failed a check are not kept to be continued); a fault (the store unreachable, credentials
refused, a full disk) keeps the parts for the next run to continue.

Without a key file the manifest's signature cannot be checked (the key that signed it lived in the
cluster that is gone): the plan says so, and a point-in-time restore of a signed chain is refused
unless ``--accept-unsigned-chain`` says to restore it checked from its content alone.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from etcd_agent.bucket import fetch, layout
from etcd_agent.bucket.staging import Stopped, stage_all
from etcd_agent.config import Config
from etcd_agent.errors import AgentError, BackupCorrupt, PartialChainShort, RefusedError
from etcd_agent.fs import size_text
from etcd_agent.restore.orchestrator import stagedchecks

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities
    from etcd_agent.bucket.remote import RemoteObject
    from etcd_agent.pitr.carried import CheckedChain
    from etcd_agent.pitr.replay import Target
    from etcd_agent.restore.orchestrator.options import Options

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class BucketPlan:
    """The full backup chosen in the bucket and every object a restore from it fetches."""

    full: "RemoteObject"
    items: Tuple[fetch.Wanted, ...]
    skipped: Tuple[str, ...] = ()  # what the bucket holds for it that this restore does not need, and why
    # the chain's segments before the checkpoint's lease census, left in the bucket (``bucket.partial``):
    # fetched only when the run fetched does not hold what the replay needs
    rest: Tuple[fetch.Wanted, ...] = ()
    notes: Tuple[str, ...] = ()  # why what might have been left is fetched

    def whole(self) -> "BucketPlan":
        """The plan with the segments it left in the bucket fetched too (``rest``)."""
        return BucketPlan(self.full, tuple(fetch.order(list(self.items) + list(self.rest))), self.skipped[1:])

    @property
    def total(self) -> int:
        return sum(w.size for w in self.items)

    @property
    def file(self) -> str:
        """The full backup's file name in the backup dir once fetched."""
        return self.full.name

    def to_json(self) -> Dict[str, Any]:
        return {"backup": self.full.name, "chain": self.full.chain or None, "folder": self.full.folder or None,
                "bytes": self.total,
                "objects": [w.to_json() for w in self.items], "not_fetched": list(self.skipped),
                "notes": list(self.notes)}

    def lines(self, directory: str) -> List[str]:
        out = [f"from the folder of host {self.full.folder} (the prefix's {{host}})"] if self.full.folder else []
        out += [f"fetch {w.name} ({size_text(w.size)})" for w in self.items]
        out += [f"not fetched: {s}" for s in self.skipped]
        out += list(self.notes)
        out.append(f"{len(self.items)} object(s), {size_text(self.total)}, into {directory} (checked in "
                   f"{os.path.join(directory, fetch.STAGING)} first)")
        return out


def plan_fetch(cfg: Config, spec: str, target: Optional["Target"], *, checkpoints: bool = True) -> BucketPlan:
    """What to fetch (listing and HEADs only): the full backup ``spec`` names in the bucket and,
    for a point in time, its chain's segments and checkpoints; objects the target cannot need are
    left in the bucket (segments that begin after a target revision, checkpoints with
    ``--no-checkpoint``)."""
    from etcd_agent.chain.segments import parse_name

    full, items = fetch.plan(cfg, spec, **_choice(cfg, target))
    if target is None:
        kept = [w for w in items if w.kind == layout.FULL]
        return BucketPlan(full, tuple(kept), _skipped(items, kept, "a plain restore reads the full backup only"))
    chosen = (_checkpoint(fetch.bound(cfg, full.folder), [w for w in items if w.kind == layout.CHECKPOINT], target)
              if checkpoints else None)
    kept = []
    for w in items:
        if w.kind == layout.CHECKPOINT and w != chosen:
            continue
        if w.kind == layout.SEGMENT and target.kind == "revision" and target.revision is not None:
            rng = parse_name(w.file)
            if rng is not None and rng[0] > target.revision:
                continue
        kept.append(w)
    skipped = _skipped(items, kept, f"not needed to reach {target.describe()} (older checkpoints, segments after "
                                    "the target)")
    if chosen is None:
        return BucketPlan(full, tuple(kept), skipped)
    return _from_census(cfg, BucketPlan(full, tuple(kept), skipped), chosen)


def _from_census(cfg: Config, bp: BucketPlan, chosen: fetch.Wanted) -> BucketPlan:
    """``bp`` fetching only what a replay from checkpoint ``chosen`` needs (``bucket.partial``):
    with the manifest key, the segments before its lease census left in the bucket (``rest``);
    without it the whole chain, and the plan says why."""
    from etcd_agent.backup import keys
    from etcd_agent.bucket import partial, remote
    from etcd_agent.bucket.client import Bucket

    if keys.local_key(cfg).key is None:
        return dataclasses.replace(bp, notes=tuple(partial.without_key(bp.items)))
    b = Bucket(fetch.bound(cfg, bp.full.folder))
    try:
        rev = str(remote.checkable(b, chosen.name).metadata.get("revision", ""))
    except AgentError:
        return bp  # the fetch names what is wrong with it
    c = partial.cut(b, bp.items, chosen, int(rev)) if rev.isdigit() else None
    if c is None:
        return bp
    left = set(c.left)
    return dataclasses.replace(bp, items=tuple(w for w in bp.items if w not in left), rest=c.left,
                               skipped=(c.line(),) + bp.skipped)


def _checkpoint(cfg: Config, cps: Sequence[fetch.Wanted], target: "Target") -> Optional[fetch.Wanted]:
    """The one checkpoint worth fetching: the newest at or before the target (by its name's time,
    or for a revision by its object's metadata). Each is a full backup's size: the others are
    left in the bucket. Nothing here is trusted - the chain decides whether the replay may start
    from it (``pitr.prepare``), and without it the replay starts from the full backup."""
    from etcd_agent.backup.catalog import name_time
    from etcd_agent.bucket import remote
    from etcd_agent.bucket.client import Bucket

    def when_ms(w: fetch.Wanted) -> int:
        t = name_time(w.file, cfg.backup.utc)
        return int(t.timestamp() * 1000) if t is not None else 0

    newest_first = sorted(cps, key=when_ms, reverse=True)
    if target.kind == "time" and target.time_ms is not None:
        return next((w for w in newest_first if when_ms(w) <= target.time_ms), None)
    if target.kind == "revision" and target.revision is not None:
        b = Bucket(cfg)
        for w in newest_first:
            rev = str(remote.checkable(b, w.name).metadata.get("revision", ""))
            if rev.isdigit() and int(rev) <= target.revision:
                return w
        return None
    return newest_first[0] if newest_first else None


def _choice(cfg: Config, target: Optional["Target"]) -> Dict[str, Any]:
    """How ``latest`` narrows the bucket's full backups for a point in time: the newest at or
    before the target time, or at or below the target revision (``bucket.fetch.select``)."""
    from datetime import datetime, timezone

    if target is None:
        return {}
    if target.kind == "time" and target.time_ms is not None:
        when = datetime.fromtimestamp(target.time_ms / 1000, tz=timezone.utc)
        # the catalog's names are in UTC or in local time ([backup] utc); compare like with like
        return {"not_after": fetch.catalog_time(cfg, when)}
    if target.kind == "revision" and target.revision is not None:
        return {"max_revision": target.revision, "reach_to": target.revision}
    return {"reach_to": -1}  # newest: the chain that reaches furthest


def _skipped(items: Sequence[fetch.Wanted], kept: Sequence[fetch.Wanted], why: str) -> Tuple[str, ...]:
    left = [w for w in items if w not in kept]
    if not left:
        return ()
    return (f"{len(left)} object(s), {size_text(sum(w.size for w in left))}: {why}",)


@dataclass
class Fetched:
    """What a fetch brought into the backup dir and what was checked before it was let in."""

    plan: BucketPlan
    objects: List[fetch.Fetched]
    checked: List[str]
    seconds: float
    bytes_read: int
    chain: Optional["CheckedChain"] = None  # the chain's check, for the restore to carry (``Options.checked``)
    phases: Dict[str, float] = dataclasses.field(default_factory=dict)  # stage, check, publish: seconds

    def to_json(self) -> Dict[str, Any]:
        return {**self.plan.to_json(), "objects": [f.to_json() for f in self.objects], "checked": self.checked,
                "seconds": round(self.seconds, 3), "bytes_read": self.bytes_read,
                "phases": {k: round(v, 3) for k, v in self.phases.items()}}


def fetch_checked(cfg: Config, bp: BucketPlan, target: Optional["Target"], *,
                  identities: Optional["Identities"] = None, new_cluster: bool = False,
                  checkpoints: bool = True, accept_unsigned: bool = False, key_file: Optional[str] = None,
                  progress: Callable[[str], None] = lambda s: None) -> Fetched:
    """Fetch ``bp``'s objects into the staging dir, check them from their content, and only then
    move them into the backup dir (see the module doc). RefusedError / BackupCorrupt for content
    that fails a check (nothing outside the staging dir written, the staged bytes removed)."""
    from etcd_agent.bucket.client import Bucket

    t0 = time.monotonic()
    b = Bucket(fetch.bound(cfg, bp.full.folder))  # the folder of the master that copied it
    directory = cfg.backup.dir
    staged: List[fetch.Staged] = []
    if bp.full.folder:
        progress(f"{bp.file} is in the folder of host {bp.full.folder} (the prefix's {{host}}: the newest of every "
                 "master's folder found)")
    with fetch.staging_locked(directory) as staging:
        try:
            staged = stage_all(fetch.bound(cfg, bp.full.folder), bp.items, directory, progress, since=t0)
            phases = {"stage": time.monotonic() - t0}
        except Stopped as stop:
            raise stop.sentence("restore --from-bucket", "nothing restored") from None
        def check() -> Tuple[List[str], Dict[str, Any], Optional["CheckedChain"]]:
            return stagedchecks.check_staged(cfg, staging, staged, bp, target, identities=identities,
                                             new_cluster=new_cluster, checkpoints=checkpoints,
                                             accept_unsigned=accept_unsigned, key_file=key_file)

        try:
            try:
                checked, facts, chain = check()
            except PartialChainShort as short:
                if not bp.rest:
                    raise
                # the run fetched does not hold what the replay needs: the rest of the chain, and
                # the whole of it checked from the full backup on
                progress(f"{short.message.removesuffix('; nothing touched')}: fetching the {len(bp.rest)} earlier "
                         "segment(s) too")
                rest, bp = bp.rest, bp.whole()
                try:
                    staged += stage_all(fetch.bound(cfg, bp.full.folder), rest, directory, progress, since=t0)
                except Stopped as stop:
                    raise stop.sentence("restore --from-bucket", "nothing restored") from None
                checked, facts, chain = check()
        except AgentError as exc:
            # the files were checked under a dir of the staging dir that is gone now: named by name
            exc.message = exc.message.replace(os.path.join(staging, stagedchecks.CHECKED_DIR) + os.sep, "")
            if _failed_content(exc):  # bytes that failed a check are not kept to be continued
                for s in staged:
                    if s.part is not None:
                        fetch.discard_part(s.part)
            else:  # what the operator brought was refused, not the bytes: say they need not come again
                exc.message = (f"{exc.message.rstrip('.')}; the {len(staged)} fetched object(s) are kept in {staging}: "
                               f"the same command{_with_identity(exc)} does not fetch them again")
            raise
        try:
            phases["check"] = time.monotonic() - t0 - sum(phases.values())
            staged = _unless_unused(staged, chain, directory, progress)
            objects = [fetch.publish(b, s, directory) for s in staged]
        except BaseException:
            if chain is not None:  # its decrypted copies and lock (an encrypted chain) go with it
                chain.release()
            raise
        if chain is not None:  # the same inodes under the backup dir now (``carried.take`` checks)
            from etcd_agent.pitr.carried import rerooted

            chain = rerooted(chain, os.path.join(staging, stagedchecks.CHECKED_DIR), directory)
    try:
        stagedchecks.remember(directory, bp.file, facts)  # the staging dir gone: the file's stamp is final
    except BaseException:
        if chain is not None:
            chain.release()
        raise
    took = time.monotonic() - t0
    phases["publish"] = took - sum(phases.values())
    read = sum(s.bytes_read for s in staged)
    for line in checked:
        progress(f"checked before it was let in: {line}")
    progress(f"{len(objects)} object(s) of {bp.file} checked and in {directory} ({size_text(read)} fetched in "
             f"{took:.1f}s)")
    return Fetched(bp, objects, checked, took, read, chain, phases)


def _unless_unused(staged: List[fetch.Staged], chain: Optional["CheckedChain"], directory: str,
                   progress: Callable[[str], None]) -> List[fetch.Staged]:
    """``staged`` without a checkpoint fetched that the checked chain does not start its replay
    from (not the snapshot it vouches for: a runbook tarball uploaded under its name): it is not
    let into the backup dir, where it would sit under a checkpoint's name and a date newer than
    its full backup - ``--from latest`` of a plain restore's to take."""
    start = chain.prepared.start if chain is not None else None
    kept = []
    for s in staged:
        w = s.fetched.wanted
        if w.kind == layout.CHECKPOINT and s.part is not None and (start is None or start.name != w.file):
            fetch.discard_part(s.part)
            progress(f"{w.file}: fetched as the checkpoint, but the chain does not start its replay from it: "
                     f"not kept in {directory}")
            continue
        kept.append(s)
    return kept


def _failed_content(exc: AgentError) -> bool:
    """A refusal of the fetched bytes themselves (not ours, forged, corrupt), not of what the
    operator brought (the wrong --identity: the bytes are kept and the next run re-hashes them)."""
    from etcd_agent.chain.errors import DeltaError
    from etcd_agent.errors import IdentityRefused

    if isinstance(exc, IdentityRefused):
        return False
    return isinstance(exc, (RefusedError, BackupCorrupt, DeltaError))


def _with_identity(exc: AgentError) -> str:
    from etcd_agent.errors import IdentityRefused

    return " with the right --identity" if isinstance(exc, IdentityRefused) else ""


def host_checks(cfg: Config, opts: "Options", snapshot_size: int) -> List[Tuple[str, str, List[str]]]:
    """(member, host, problems) of every member before there is a snapshot to plan with (the
    dry run): sessions (locks taken, unreachable hosts noted), then each host's pre-check against
    a snapshot of ``snapshot_size`` bytes, its etcd version and identity left to the real run."""
    from etcd_agent import __version__
    from etcd_agent.restore.orchestrator.orchestrate import Restore
    from etcd_agent.restore.orchestrator.precheck import check_host

    r = Restore(cfg, opts)
    r.open_reachable("restore --from-bucket --dry-run")
    try:
        facts, problems = r.precheck()
    finally:
        r.close_all()
    out = []
    for n in r.nodes:
        for m in n.members:
            found = list(problems.get(m.name, []))
            if m.name in facts:
                found += check_host(cfg, cfg.member(m.name), facts[m.name], snapshot_size=snapshot_size,
                                    snapshot_version=None, agent_version=__version__, resuming=False)
            out.append((m.name, n.where, found))
    return out
