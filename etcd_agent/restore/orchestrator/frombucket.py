"""`restore --from-bucket`: the disaster where every master lost its data dir *and* its backup dir,
and the bucket is all that is left.

What runs, in order, before any master is touched:

1. **List** (``plan_fetch``): the full backup the spec names (the same words as ``--from``:
   ``latest``, a file name, a date), chosen among the bucket's full backups - for a point in time,
   the newest at or before the target - and, for a point in time, its chain's segments and
   checkpoints (``bucket.fetch.plan``; names from the bucket are hostile: only ours are taken).
   ``--dry-run`` stops here: it lists every object and its size and fetches nothing.
2. **Fetch into the staging dir** (``<backup dir>/.fetch/``, 0700, hidden from the catalog): each
   object streamed into its part file, its size and sha256 checked against the object's metadata
   as it streams (``bucket.fetch.stage_one``); a run killed halfway is continued by the next.
3. **Check from the content, still in the staging dir** (``_check_staged``): the full backup is
   read with the one bounded reader - its manifest's signature with the manifest key (the copy the
   operator kept off-host: ``--key-file``), the snapshot's members from its own db against the
   config's names and peer URLs; for a point in time the chain is checked as a restore checks it
   (continuity from the full backup's revision, each segment's sha256 links, signatures with the
   same key). The metadata of the bucket vouches for nothing but the bytes it came with: an object
   that passed its sha256 still has to pass these.
4. **Move into the backup dir** (``bucket.fetch.publish``): each file linked under its own name,
   never over a different file. Only then does the restore run, exactly as ``restore --from`` of
   that file (the orchestrator's plan, the pre-checks on every host, the confirmation).

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
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from etcd_agent.bucket import fetch, layout
from etcd_agent.config import Config
from etcd_agent.errors import AgentError, BackupCorrupt, RefusedError
from etcd_agent.fs import size_text

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities
    from etcd_agent.bucket.client import Bucket
    from etcd_agent.bucket.remote import RemoteObject
    from etcd_agent.pitr.replay import Target

log = logging.getLogger(__name__)

CHECKED_DIR = "checked"  # under the staging dir: the fetched files under their own names, while checked
PROGRESS_EVERY = 2.0  # seconds between two progress lines of one object


@dataclass(frozen=True)
class BucketPlan:
    """The full backup chosen in the bucket and every object a restore from it fetches."""

    full: "RemoteObject"
    items: Tuple[fetch.Wanted, ...]
    skipped: Tuple[str, ...] = ()  # what the bucket holds for it that this restore does not need, and why

    @property
    def total(self) -> int:
        return sum(w.size for w in self.items)

    @property
    def file(self) -> str:
        """The full backup's file name in the backup dir once fetched."""
        return self.full.name

    def to_json(self) -> Dict[str, Any]:
        return {"backup": self.full.name, "chain": self.full.chain or None, "bytes": self.total,
                "objects": [w.to_json() for w in self.items], "not_fetched": list(self.skipped)}

    def lines(self, directory: str) -> List[str]:
        out = [f"fetch {w.name} ({size_text(w.size)})" for w in self.items]
        out += [f"not fetched: {s}" for s in self.skipped]
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
    kept = []
    for w in items:
        if w.kind == layout.CHECKPOINT and not checkpoints:
            continue
        if w.kind == layout.SEGMENT and target.kind == "revision" and target.revision is not None:
            rng = parse_name(w.file)
            if rng is not None and rng[0] > target.revision:
                continue
        kept.append(w)
    return BucketPlan(full, tuple(kept), _skipped(items, kept, f"not needed to reach {target.describe()}"))


def _choice(cfg: Config, target: Optional["Target"]) -> Dict[str, Any]:
    """How ``latest`` narrows the bucket's full backups for a point in time: the newest at or
    before the target time, or at or below the target revision (``bucket.fetch.select``)."""
    from datetime import datetime, timezone

    if target is None:
        return {}
    if target.kind == "time" and target.time_ms is not None:
        when = datetime.fromtimestamp(target.time_ms / 1000, tz=timezone.utc)
        # the catalog's names are in UTC or in local time ([backup] utc); compare like with like
        naive = when.replace(tzinfo=None) if cfg.backup.utc else when.astimezone().replace(tzinfo=None)
        return {"not_after": naive}
    if target.kind == "revision" and target.revision is not None:
        return {"max_revision": target.revision}
    return {}


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

    def to_json(self) -> Dict[str, Any]:
        return {**self.plan.to_json(), "objects": [f.to_json() for f in self.objects], "checked": self.checked,
                "seconds": round(self.seconds, 3), "bytes_read": self.bytes_read}


def fetch_checked(cfg: Config, bp: BucketPlan, target: Optional["Target"], *,
                  identities: Optional["Identities"] = None, new_cluster: bool = False,
                  checkpoints: bool = True, accept_unsigned: bool = False, key_file: Optional[str] = None,
                  progress: Callable[[str], None] = lambda s: None) -> Fetched:
    """Fetch ``bp``'s objects into the staging dir, check them from their content, and only then
    move them into the backup dir (see the module doc). RefusedError / BackupCorrupt for content
    that fails a check (nothing outside the staging dir written, the staged bytes removed)."""
    from etcd_agent.bucket.client import Bucket

    t0 = time.monotonic()
    b = Bucket(cfg)
    directory = cfg.backup.dir
    staged: List[fetch.Staged] = []
    with fetch.staging_locked(directory) as staging:
        for i, w in enumerate(bp.items, 1):
            try:
                staged.append(_stage(b, w, directory, f"[{i}/{len(bp.items)}]", progress))
            except AgentError as exc:
                exc.message = (f"restore --from-bucket: {len(staged)} of {len(bp.items)} object(s) fetched, then: "
                               f"{exc.message}; nothing restored" + (
                                   "" if isinstance(exc, (RefusedError, BackupCorrupt)) else
                                   " - the same command continues the fetch where it stopped"))
                raise
        try:
            checked, facts = _check_staged(cfg, staging, staged, bp, target, identities=identities,
                                    new_cluster=new_cluster, checkpoints=checkpoints,
                                    accept_unsigned=accept_unsigned, key_file=key_file)
        except AgentError as exc:
            if _failed_content(exc):  # bytes that failed a check are not kept to be continued
                for s in staged:
                    if s.part is not None:
                        fetch.discard_part(s.part)
            raise
        objects = [fetch.publish(b, s, directory) for s in staged]
    _remember(directory, bp.file, facts)  # the staging dir gone: the file's stamp is final
    took = time.monotonic() - t0
    read = sum(s.bytes_read for s in staged)
    for line in checked:
        progress(f"checked before it was let in: {line}")
    progress(f"{len(objects)} object(s) of {bp.file} checked and in {directory} ({size_text(read)} fetched in "
             f"{took:.1f}s)")
    return Fetched(bp, objects, checked, took, read)


def _remember(directory: str, file: str, facts: Dict[str, Any]) -> None:
    """The fetched full backup's check, as the backup that wrote it recorded one: what the fetch
    read from its content (revision, member ids; the snapshot's sha256 only from a manifest whose
    signature was valid). Without it an encrypted backup is one whose revision and snapshot no
    listing can read: the daemon's chain pruning takes its chain for an orphan and deletes it,
    and its copier copies it again under another chain key (the archive's own sha256), a copy
    with no segments that ``--from-bucket latest`` then picks."""
    from etcd_agent.backup import checks

    c = checks.check_of(os.path.join(directory, file), ok=True, how="fetch", kind="agent", **facts)
    if c is not None:
        checks.record(directory, file, c)


def _failed_content(exc: AgentError) -> bool:
    """A refusal of the fetched bytes themselves (not ours, forged, corrupt), not of what the
    operator brought (the wrong --identity: the bytes are kept and the next run re-hashes them)."""
    from etcd_agent.chain.errors import DeltaError
    from etcd_agent.errors import IdentityRefused

    if isinstance(exc, IdentityRefused):
        return False
    return isinstance(exc, (RefusedError, BackupCorrupt, DeltaError))


def _stage(b: "Bucket", w: fetch.Wanted, directory: str, counter: str,
           progress: Callable[[str], None]) -> fetch.Staged:
    """One object staged, with a line when it begins, every ``PROGRESS_EVERY`` seconds of a long
    one (bytes, MB/s, ETA) and when it is whole."""
    began = time.monotonic()
    last = [began]
    start_at = [-1]

    def tick(done: int, total: int) -> None:
        now = time.monotonic()
        if start_at[0] < 0:
            start_at[0] = done  # a continued part: its first bytes were not read now
        if now - last[0] < PROGRESS_EVERY:
            return
        last[0] = now
        rate = (done - start_at[0]) / max(now - began, 1e-6)
        eta = (total - done) / rate if rate > 0 else float("inf")
        progress(f"{counter} {w.file}: {size_text(done)} of {size_text(total)}, {rate / 1e6:.1f} MB/s, ETA "
                 f"{'?' if eta == float('inf') else f'{eta:.0f}s'}")

    progress(f"{counter} fetching {w.name} ({size_text(w.size)})")
    s = fetch.stage_one(b, w, directory, progress=tick)
    took = time.monotonic() - began
    if s.fetched.how == "already here":
        progress(f"{counter} {w.file}: already in {directory} with the same bytes")
    else:
        at = f", continued at byte {s.fetched.resumed_at}" if s.fetched.resumed_at else ""
        progress(f"{counter} {w.file}: {size_text(s.bytes_read)} in {took:.1f}s "
                 f"({s.bytes_read / max(took, 1e-6) / 1e6:.1f} MB/s{at}), sha256 matches its metadata")
    return s


def _check_staged(cfg: Config, staging: str, staged: Sequence[fetch.Staged], bp: BucketPlan,
                  target: Optional["Target"], *, identities: Optional["Identities"], new_cluster: bool,
                  checkpoints: bool, accept_unsigned: bool, key_file: Optional[str]) -> Tuple[List[str], Dict[str, Any]]:
    """The fetched files, under their own names in a dir of the staging dir, read as a restore
    reads them: the full backup (signature, identity from its db) and, for a point in time, its
    chain. The lines say what was checked and what could not be; the facts, what the full
    backup's content showed (``_remember``)."""
    checked = os.path.join(staging, CHECKED_DIR)
    shutil.rmtree(checked, ignore_errors=True)  # a killed run's
    os.mkdir(checked, 0o700)
    try:
        for s in staged:
            os.link(s.part if s.part is not None else os.path.join(cfg.backup.dir, s.file),
                    os.path.join(checked, s.file))
        here = dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, dir=checked))
        lines, facts = _check_full(here, bp.file, identities=identities, new_cluster=new_cluster,
                                   key_file=key_file)
        if target is not None:
            lines += _check_chain(cfg, here, bp.file, target, identities=identities, checkpoints=checkpoints,
                                  accept_unsigned=accept_unsigned)
        return lines, facts
    finally:
        shutil.rmtree(checked, ignore_errors=True)


def _check_full(here: Config, file: str, *, identities: Optional["Identities"], new_cluster: bool,
                key_file: Optional[str]) -> Tuple[List[str], Dict[str, Any]]:
    from etcd_agent.backup.identity import layout_problems
    from etcd_agent.backup.keys import key_path, local_key
    from etcd_agent.restore.orchestrator.source import open_source

    key = local_key(here)
    src = open_source(here, file, here.backup.dir, hash_now=False, identities=identities)
    try:
        arc = src.archive
        signature = arc.signature if arc is not None else "unsigned"
        lines: List[str] = []
        if key.key is None:
            lines.append(f"not checked: the manifest's signature - no manifest key at {key_path(here)} (the key "
                         "lived in the cluster that is gone; pass --key-file with the copy kept off-host to check "
                         "it); the backup is judged from its content alone")
        elif signature == "valid":
            lines.append(f"manifest signature valid with the manifest key {key_path(here)}")
        elif key_file is not None:
            raise RefusedError(f"{file} in the bucket is {_unsigned(signature)} the key in {key_file}: it is "
                               "another cluster's backup or was changed after it was written; nothing restored. "
                               "Check the key file, or leave --key-file out to restore it checked from its "
                               "content alone")
        else:
            lines.append(f"manifest {_unsigned(signature)} the manifest key {key_path(here)}: what it says is "
                         "trusted for nothing; the backup is judged from its content")
        if src.identity is None:
            raise RefusedError(f"{file} in the bucket: the snapshot's members could not be read from its db; "
                               "nothing restored")
        layout = layout_problems(src.identity, here)
        if layout and not new_cluster:
            raise RefusedError(f"{file} in the bucket is a snapshot of another cluster layout "
                               f"({'; '.join(layout)}): nothing restored. Restore it into this config's "
                               "cluster only on purpose, with --new-cluster")
        lines.append(f"the snapshot's members, read from its own db, {'are of another layout (--new-cluster)' if layout else 'have the config names and peer URLs'}"
                     f" (revision {src.revision})")
        lines += list(src.checked)
        facts = {"revision": src.revision, "member_ids": src.member_ids, "signature": signature,
                 "sha256": src.sha256 if signature == "valid" else None}
        return lines, facts
    finally:
        src.close()


def _unsigned(signature: str) -> str:
    return {"invalid": "signed, but not as it reads now, with",
            "unknown-key": "signed with another key than",
            "unsigned": "not signed with"}.get(signature, f"{signature}, not signed with")


def _check_chain(cfg: Config, here: Config, file: str, target: "Target", *,
                 identities: Optional["Identities"], checkpoints: bool, accept_unsigned: bool) -> List[str]:
    """The chain checked as ``pitr.prepare`` checks it for a restore; encrypted segments are
    decrypted into a private dir outside the backup dir (removed here)."""
    from etcd_agent.pitr import prepare as pitr
    from etcd_agent.pitr import workdirs

    held = workdirs.lock(cfg) if identities is not None else None
    try:
        private = workdirs.open_staging(cfg) if identities is not None else None
        try:
            prep = pitr.prepare(here, file, target, identities=identities, staging=private,
                                checkpoints=checkpoints, accept_unsigned=accept_unsigned)
        finally:
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)
    finally:
        if held is not None:
            held.release()
    lines = [f"delta chain: {len(prep.plan.segments)} segment(s) link from {file}'s revision to revision "
             f"{prep.plan.stop_revision} ({target.describe()}), each by its sha256"]
    if prep.check.stop is not None:  # `--to newest` restores up to the last good point: said, never silent
        lines.append(f"WARNING: {pitr.stop_sentence(prep)}")
    lines += list(prep.choice)
    if prep.signatures:
        lines.append(prep.signatures)
    return lines
