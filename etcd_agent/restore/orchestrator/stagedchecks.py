"""What a restore from the bucket checks in the staging dir before a fetched file is let into the
backup dir (``frombucket`` step 3): the files under their own names in ``<staging>/checked/``,
read as a restore reads them - each segment's name against what it holds (``bucket.staging``, as
``backup fetch`` checks it), the full backup's
manifest signature and members, the chain through ``pitr.prepare`` on a config pointed there -
and, once let in, the full backup's check recorded as its writer would have (``remember``). The
chain's check is carried to the restore (``pitr.carried``): it is not made twice."""
from __future__ import annotations

import dataclasses
import os
import shutil
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from etcd_agent.bucket import fetch
from etcd_agent.bucket.staging import named_as_they_hold
from etcd_agent.config import Config
from etcd_agent.errors import RefusedError

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities
    from etcd_agent.pitr.carried import CheckedChain, Inode
    from etcd_agent.pitr.replay import Target
    from etcd_agent.restore.orchestrator.frombucket import BucketPlan

CHECKED_DIR = "checked"  # under the staging dir: the fetched files under their own names, while checked


def remember(directory: str, file: str, facts: Dict[str, Any]) -> None:
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


def check_staged(cfg: Config, staging: str, staged: Sequence[fetch.Staged], bp: "BucketPlan",
                  target: Optional["Target"], *, identities: Optional["Identities"], new_cluster: bool,
                  checkpoints: bool, accept_unsigned: bool, key_file: Optional[str]
                  ) -> Tuple[List[str], Dict[str, Any], Optional["CheckedChain"]]:
    """The fetched files, under their own names in a dir of the staging dir, read as a restore
    reads them: the full backup (signature, identity from its db) and, for a point in time, its
    chain. The lines say what was checked and what could not be; the facts, what the full
    backup's content showed (``remember``); the chain's check, to be carried into the restore once
    ``pitr.carried.rerooted`` to the backup dir (None: the restore checks it)."""
    from etcd_agent.pitr.carried import inode

    checked = os.path.join(staging, CHECKED_DIR)
    shutil.rmtree(checked, ignore_errors=True)  # a killed run's
    os.mkdir(checked, 0o700)
    try:
        for s in staged:
            os.link(s.part if s.part is not None else os.path.join(cfg.backup.dir, s.file),
                    os.path.join(checked, s.file))
        # which file each name is before anything reads it: what the carried check vouches for
        before = {os.path.join(checked, s.file): inode(os.path.join(checked, s.file)) for s in staged}
        named_as_they_hold(staged, lambda s: os.path.join(checked, s.file), "nothing restored")
        here = dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, dir=checked))
        # a point in time ships the replay's db, never this snapshot: nothing later would hash it
        # against the sha256 its manifest names (and its chain's first segment), so it is hashed here
        lines, facts = _check_full(here, bp.file, identities=identities, new_cluster=new_cluster,
                                   key_file=key_file, hash_now=target is not None)
        chain = None
        if target is not None:
            more, chain = _check_chain(cfg, here, bp.file, target, before, identities=identities,
                                       checkpoints=checkpoints, accept_unsigned=accept_unsigned)
            lines += more
        return lines, facts, chain
    finally:
        shutil.rmtree(checked, ignore_errors=True)


def _check_full(here: Config, file: str, *, identities: Optional["Identities"], new_cluster: bool,
                key_file: Optional[str], hash_now: bool) -> Tuple[List[str], Dict[str, Any]]:
    from etcd_agent.backup.identity import layout_problems
    from etcd_agent.backup.keys import key_path, local_key
    from etcd_agent.restore.orchestrator.source import open_source

    key = local_key(here)
    src = open_source(here, file, here.backup.dir, hash_now=hash_now, identities=identities)
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


def _check_chain(cfg: Config, here: Config, file: str, target: "Target", before: Dict[str, Optional["Inode"]], *,
                 identities: Optional["Identities"], checkpoints: bool,
                 accept_unsigned: bool) -> Tuple[List[str], Optional["CheckedChain"]]:
    """The chain checked as ``pitr.prepare`` checks it for a restore, and that check to carry
    (``before``: the files' inodes before it); encrypted segments are decrypted into a private
    dir outside the backup dir, carried with the check (with the one-replay lock that keeps it)
    or removed here."""
    from etcd_agent.pitr import carried, workdirs
    from etcd_agent.pitr import prepare as pitr

    held = workdirs.lock(cfg) if identities is not None else None
    private: Optional[str] = None
    chain: Optional["CheckedChain"] = None
    try:
        private = workdirs.open_staging(cfg) if identities is not None else None
        prep = pitr.prepare(here, file, target, identities=identities, staging=private,
                            checkpoints=checkpoints, accept_unsigned=accept_unsigned)
        stop = prep.check.stop
        if stop is not None and target.kind == "newest":
            # from the bucket the chain is all there is: a gap, a damaged or foreign segment is not
            # cut off by `newest` - the operator names the last good point to restore up to it
            raise RefusedError(f"--to newest: {pitr.stop_sentence(prep)}; nothing restored. To restore up to its "
                               f"last good point, say so: --to-revision {stop.last_good_revision}")
        chain = carried.carry(prep, before, checkpoints=checkpoints, accept_unsigned=accept_unsigned,
                              private=private, lock=held)
    finally:
        if chain is None:  # not carried: the decrypted copies and the lock go now, as after any check
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)
            if held is not None:
                held.release()
    lines = [f"delta chain: {len(prep.plan.segments)} segment(s) link from {file}'s revision to revision "
             f"{prep.plan.stop_revision} ({target.describe()}), each by its sha256"]
    lines += list(prep.choice)
    if prep.signatures:
        lines.append(prep.signatures)
    return lines, chain
