"""Point-in-time restore, before the cluster is touched: which full backup, how far its chain
goes, the replay into a throwaway member (its work dirs and their housekeeping: ``pitr.workdirs``;
the lines the restore plan shows: ``pitr.report``).

``prepare`` decides from headers, footers and every segment's verified bytes (``check_chain``)
where the replay stops, and refuses (nothing touched) a target the chain cannot reach - past a
gap, a damaged segment or the chain's end - naming the last good point and, when there is one,
the newer full backup that covers what comes after. It also chooses where the replay starts:
the newest checkpoint the chain vouches for at or before the stop (a full backup the daemon took
inside the chain), which the replay uses only if its snapshot is exactly what the chain vouches
for, folding only what follows it; else an older one, or the full backup. ``replay_kept`` runs
the replay (``replayrun.replay``: scratch etcd on loopback, its own ports and dir under
``<backup dir>/.pitr``, or - an encrypted backup or chain - under ``private_dir``: the backup dir
is copied off-host and backed up by other tools, so it never holds plaintext) and keeps the result there, named after the full backup and the stop
revision, with its ``ReplayResult`` beside it: re-running the same restore after a crash reuses it, so the resumed
restore ships the very bytes the journal names. The restore removes it when it ends.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from etcd_agent.chain import chains
from etcd_agent.chain import sign as segsign
from etcd_agent.chain.chains import events_after
from etcd_agent.chain.check import BaseBackup, ChainCheck, Opener, check_chain
from etcd_agent.chain.errors import ReplayError
from etcd_agent.chain.seal import open_sealed
from etcd_agent.chain.segments import Checkpoint, SegmentInfo, list_segments, ms_to_datetime, parse_name
from etcd_agent.continuous import status
from etcd_agent.errors import BackupCorrupt, IdentityRefused, PartialChainShort, RefusedError, UsageError
from etcd_agent.fs import open_regular, write_atomic
from etcd_agent.pitr import fullpick
from etcd_agent.pitr.replay import Plan, ReplayResult, Target, find_base, plan_replay
from etcd_agent.pitr.replayrun import replay
from etcd_agent.pitr.workdirs import in_work_dir, work_dir
from etcd_agent.safejson import load as load_json
from etcd_agent.scratch.member import EtcdBinaries, ScratchOptions

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities
    from etcd_agent.backup.catalog import Entry
    from etcd_agent.config import Config

log = logging.getLogger(__name__)

FUTURE_MARGIN_MS = 2000
MAX_KEPT_RESULT = 1 << 22  # a kept replay's result (<name>.json)
# a segment dated later than now by more than this is not trusted (as the catalogue's full backups)
SEGMENT_CLOCK_MARGIN_MS = 5 * 60 * 1000


def when_text(ms: Optional[int]) -> str:
    """A chain time (ms since the epoch) as the plan shows it; "?" when unknown."""
    return ms_to_datetime(ms).isoformat(timespec="milliseconds") if ms else "?"


@dataclass(frozen=True)
class Prepared:
    entry: "Entry"  # the full backup
    target: Target
    check: ChainCheck
    plan: Plan
    breaks: Tuple[status.BreakRecord, ...]  # recorded breaks of this chain
    start: Optional["Start"] = None  # the checkpoint the replay starts from (None: the full backup)
    passed_over: Tuple[str, ...] = ()  # newer checkpoints the chain vouches for that are not used, and why
    # which full backup and which chain, and why: the backups ``--from latest`` passed over, the
    # chain's first segment, the files at its base that are not its own (``ChainCheck.passed``)
    choice: Tuple[str, ...] = ()
    signatures: str = ""  # the plan's line about the chain's signatures (``segsign.verdict``)

    @property
    def kept_name(self) -> str:
        return f"{self.entry.name}.to-{self.plan.stop_revision}.db"


@dataclass(frozen=True)
class Start:
    """A checkpoint a replay may start from: what the chain vouches for, and its file here."""

    checkpoint: Checkpoint
    path: str
    events_after: int  # of the chain up to the stop: what a replay from it folds (estimated)

    @property
    def name(self) -> str:
        return self.checkpoint.name

    @property
    def revision(self) -> int:
        return self.checkpoint.revision


def choose_start(cfg: "Config", entry: "Entry", outline: ChainCheck, target: Target,
                 skip: Optional[Dict[str, str]] = None) -> Tuple[Optional[Start], List[str]]:
    """The newest checkpoint the chain ``outline`` (headers and footers only) vouches for after
    ``entry`` and surely at or before the target's stop, whose file is here and good and, where
    the catalogue knows its snapshot's sha256, the one vouched for; and a line for each newer one
    passed over. Its content is checked when the replay reads it (``replayrun._checkpoint_file``)
    and its vouching segment when the chain is verified from ``leases_from`` (``prepare``)."""
    from etcd_agent.backup import catalog, keys

    skip = skip or {}
    bound = _surely_reached(outline, target)
    vouched: Dict[str, Checkpoint] = {}
    for seg in outline.segments:
        for cp in seg.footer.checkpoints:
            if entry.revision is not None and entry.revision < cp.revision <= bound:
                vouched.setdefault(cp.name, cp)
    key = keys.local_key(cfg).key  # a signed manifest's sha256 tells a swapped file early
    passed: List[str] = []
    for cp in sorted(vouched.values(), key=lambda c: c.revision, reverse=True):
        path = os.path.join(cfg.backup.dir, cp.name)
        if cp.name in skip:
            passed.append(f"{cp.name}: {skip[cp.name]}")
            continue
        if not os.path.isfile(path):
            log.info("checkpoint %s (revision %d) is gone (pruned): not a starting point", cp.name, cp.revision)
            continue
        try:
            e = catalog.entry_for(path, utc=cfg.backup.utc, key=key)
        except OSError:
            continue
        # a runbook tarball under the name (no manifest: nothing says which snapshot it holds, and
        # the daemon's checkpoints always have one) is never taken on its name: were its content
        # judged only when the replay reads it, a partial chain would be staged and published
        # around it and the restore refused late instead of fetching the rest
        if not e.complete or e.kind == "runbook" or (e.snapshot_sha256 and e.snapshot_sha256 != cp.sha256):
            what = e.problem or ("a runbook tarball under its name, no manifest" if e.kind == "runbook"
                                 else "another snapshot sha256")
            why = f"checkpoint {cp.name} is not the one its chain vouches for ({what}): not a starting point"
            log.warning("%s", why)
            passed.append(why)
            continue
        return Start(cp, path, events_after(outline.segments, cp.revision, bound)), passed
    return None, passed


def _surely_reached(outline: ChainCheck, target: Target) -> int:
    """A revision the replay's stop is at least (from headers and footers alone)."""
    if target.kind == "revision" and target.revision is not None:
        return min(target.revision, outline.end_revision)
    if target.kind == "time" and target.time_ms is not None:
        done = [s.end_revision for s in outline.segments if s.footer.end_time_ms <= target.time_ms]
        return max(done, default=outline.base_revision)
    return outline.end_revision


def _vouched_in(check: ChainCheck, start: Start) -> bool:
    """A segment the check verified vouches for exactly this checkpoint."""
    return any(s.sha256 and start.checkpoint in s.footer.checkpoints for s in check.segments)


def resolve_full(cfg: "Config", spec: str, target: Target) -> Tuple["Entry", List[str]]:
    """``--from`` with a target, and the plan's lines on the choice. ``latest`` is the newest
    good full backup at or before the target (a later one cannot be rolled back to it) whose
    delta chain reaches it (``fullpick``: a newer backup at the same revision may have none), that
    is not a checkpoint (a checkpoint is where a chain's replay may start, found from the chain;
    never the base of one); anything else resolves as usual."""
    from etcd_agent.backup import catalog, keys

    if spec.strip() != "latest":
        return catalog.resolve_from(cfg, spec), []
    key = keys.local_key(cfg).key
    entries = catalog.list_backups(cfg.backup.dir, utc=cfg.backup.utc, cfg=cfg, key=key)
    entries = [e for e in entries if not e.checkpoint_of]
    goods = catalog.good(entries)
    if target.kind == "newest":
        _best, skipped = catalog.latest(entries)
        for s in skipped:
            log.warning("%s", s)
        if not goods:
            raise UsageError(f"--from latest: no good full backup in {cfg.backup.dir}" + _quarantined(entries))
    cands = [e for e in goods if target.kind == "newest"
             or (target.kind == "time" and target.time_ms is not None and e.time.timestamp() * 1000 <= target.time_ms)
             or (target.kind == "revision" and e.revision is not None and target.revision is not None
                 and e.revision <= target.revision)]
    if cands:
        return fullpick.pick(chains.scan(cfg.backup.dir), cands, target, key is not None)
    oldest = f"the oldest good one is {goods[-1].name} (revision {goods[-1].revision})" if goods else "there is none"
    raise UsageError(f"--from latest --to {target.describe()}: no full backup in {cfg.backup.dir} at or before it "
                     f"({oldest})")


def _quarantined(entries: Sequence["Entry"]) -> str:
    """Why the backups here are not good (a clock that jumped leaves every one "modified in the
    future"): said with the refusal, not only by `backup list`."""
    bad = [e for e in entries if not e.complete]
    if not bad:
        return ""
    return (f" ({len(bad)} quarantined: " + "; ".join(f"{e.name}: {e.problem}" for e in bad[:3])
            + ("; ..." if len(bad) > 3 else "") + ")")


def prepare(cfg: "Config", spec: str, target: Target, *, now_ms: Optional[int] = None,
            identities: Optional["Identities"] = None, staging: Optional[str] = None,
            checkpoints: bool = True, skip: Optional[Dict[str, str]] = None,
            accept_unsigned: bool = False) -> Prepared:
    """Choose the full backup and plan the replay; RefusedError for a target the chain cannot reach.

    Encrypted segments (``.seg.age``) are decrypted with ``identities`` into ``staging`` (the
    caller's private dir outside the backup dir, ``private_dir``, removed when the restore ends) and checked whole as
    they are; without an identity an encrypted chain is checked as far as its bytes allow and the
    restore refused (IdentityRefused, nothing touched).

    With ``checkpoints`` the replay starts from the newest checkpoint the chain vouches for at or
    before the target (``choose_start``: from headers and footers), and only the segments from
    its lease census on are verified (and decrypted); the ones before it are never read whole.
    ``checkpoints`` False (``--no-checkpoint``): from the full backup, every segment verified.
    ``skip``: checkpoints found unusable by an earlier attempt (name -> why).

    Signatures (``segsign``): checked with this host's manifest key; a forged segment stops the
    chain, and a restore that would reach it - ``newest`` too - is refused; a chain not signed
    with the key (legacy) is refused unless ``accept_unsigned`` (``--accept-unsigned-chain``)."""
    entry, picked = _full_backup(cfg, spec, target, identities, staging)
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if target.kind == "time" and target.time_ms is not None and target.time_ms > now_ms + FUTURE_MARGIN_MS:
        raise UsageError(f"target {target.describe()} is in the future (now {when_text(now_ms)})")
    assert entry.revision is not None  # _full_backup refused one without
    paths = list_segments(cfg.backup.dir)
    base = find_base(paths, entry.revision)
    # the chain of exactly this backup: another backup at the same revision (the cluster before an
    # etcd 3.4 restore) has a chain of its own, whose events are not this backup's history
    chain = _Chain(paths, base, entry.base if base == entry.revision else None, now_ms + SEGMENT_CLOCK_MARGIN_MS,
                   _opener(cfg, identities, staging), _key(cfg))
    outline = chain.outline()
    keyless = ""
    if checkpoints and outline.stop is not None and outline.stop.kind == "gap" and not outline.segments:
        chain, outline, keyless = _partial(chain, outline)  # no file at all where the chain begins
    start, passed = choose_start(cfg, entry, outline, target, skip) if checkpoints else (None, [])
    check, plan, start = _verified(entry, target, chain, start, passed)
    _refuse_before(entry, target, plan)
    _total, breaks = status.read_breaks(cfg.backup.dir)
    mine = tuple(b for b in breaks if b.base_revision == base)
    choice = tuple(picked + fullpick.chain_lines(entry, check) + ([keyless] if keyless else []))
    prep = Prepared(entry, target, check, plan, mine, start, tuple(passed), choice)
    forged = check.stop is not None and check.stop.kind == "forged"
    if not plan.complete and (target.kind != "newest" or forged):  # a forged tail is never cut off silently
        raise (PartialChainShort if keyless else RefusedError)(
            f"{target.describe()} cannot be reached from {entry.name}: {stop_sentence(prep)}"
            f"{'; ' + keyless if keyless else ''}; nothing touched", details=refusal_hints(cfg, prep))
    return _signed(cfg, prep, chain.key, accept_unsigned)


def _full_backup(cfg: "Config", spec: str, target: Target, identities: Optional["Identities"],
                 staging: Optional[str]) -> Tuple["Entry", List[str]]:
    """The full backup the replay builds on (``resolve_full``), its revision known: read from an
    encrypted one's own db when the catalogue does not know it and it can be decrypted, else
    refused (nothing touched)."""
    entry, picked = resolve_full(cfg, spec, target)
    if entry.revision is None and entry.encrypted and identities is not None and staging is not None:
        entry = _read_sealed(cfg, entry, identities, staging)
    if entry.revision is None:
        how = (f"pass --identity FILE to read it, or run `etcd-agent backup verify {entry.name} --identity FILE`"
               if entry.encrypted else f"run `etcd-agent backup verify {entry.name}`")
        raise RefusedError(f"{entry.name}: its revision is unknown without reading it; {how} first; nothing touched")
    return entry, picked


@dataclass(frozen=True)
class _Chain:
    """The chain of one full backup as ``prepare`` checks it: its segment files, its base revision,
    the backup it must name (None: any at that revision), the latest time a segment may claim, how
    encrypted segments are opened and the manifest key its signatures are checked with."""

    paths: List[str]
    base: int
    of: Optional[BaseBackup]
    not_after_ms: int
    opener: Optional[Opener]
    key: Optional[bytes]
    begins_at: Optional[int] = None  # a partial chain: its first revision here (``check_chain``)

    def outline(self) -> ChainCheck:
        """Headers and footers only (where a replay may start)."""
        return check_chain(self.paths, self.base, verify=False, base=self.of, not_after_ms=self.not_after_ms,
                           begins_at=self.begins_at)

    def verified(self, from_revision: Optional[int] = None) -> ChainCheck:
        """Every segment's bytes verified, from ``from_revision``'s segment on (None: all)."""
        return check_chain(self.paths, self.base, base=self.of, not_after_ms=self.not_after_ms, opener=self.opener,
                           key=self.key, verify_from=from_revision, begins_at=self.begins_at)

    def missing(self) -> str:
        """A partial chain's segments that are not here, for a sentence."""
        return (f"its segments for revisions {self.base + 1}..{(self.begins_at or self.base + 1) - 1} are not here "
                "(a partial chain: a restore from the bucket fetched only those after a checkpoint)")


def _partial(chain: _Chain, outline: ChainCheck) -> Tuple[_Chain, ChainCheck, str]:
    """A chain whose first segments are not here (a restore from the bucket fetched those a replay
    from a checkpoint reads, ``bucket.partial``): followed from the first segment of this base
    that is here, which ``check_chain`` takes only signed with the manifest key and naming this
    backup's snapshot sha256. Nothing of this base here: ``chain`` as it was (the restore then
    says where it stops, as for any chain missing its first segment); without the key, that too,
    with a sentence saying why the run here is not followed."""
    if chain.of is None or not chain.of.sha256:
        return chain, outline, ""
    starts = sorted(r[0] for r in (parse_name(os.path.basename(p)) for p in chain.paths)
                    if r is not None and r[0] > chain.base + 1)
    if not starts:
        return chain, outline, ""
    partial = dataclasses.replace(chain, begins_at=starts[0])
    run = partial.outline()  # headers and footers: whose run it is by the base it names, no signature
    if not run.segments:
        return chain, outline, ""
    if chain.key is None:
        return chain, outline, (f"a partial chain of it is here (revisions {starts[0]}..{run.end_revision}, the "
                                "earlier segments not here), followed only with the manifest key, "
                                "which this host does not have: pass --key-file FILE")
    return partial, run, ""


def _verified(entry: "Entry", target: Target, chain: _Chain, start: Optional[Start],
              passed: List[str]) -> Tuple[ChainCheck, Plan, Optional[Start]]:
    """The chain verified from ``start``'s lease census on (every segment without one) and the
    replay planned; when the verified chain does not reach ``start``, it is passed over (a line
    in ``passed``) and the whole chain verified instead."""
    if chain.begins_at and (start is None or not start.checkpoint.served_from(chain.begins_at)):
        # a partial chain: a replay from the full backup, or from a checkpoint whose lease census
        # is in a segment not here, would miss what those segments hold
        why = _reachable_here(chain) if start is None else (
            f"checkpoint {start.name}'s lease census is at revision {start.checkpoint.leases_from}")
        raise PartialChainShort(f"{target.describe()} cannot be reached from {entry.name}: {chain.missing()}, and "
                                f"a replay of what is here needs them ({why}); nothing touched")
    check = chain.verified(start.checkpoint.leases_from if start is not None else None)
    plan = _plan(entry, check, target)
    if start is None or (start.revision <= plan.stop_revision and _vouched_in(check, start)):
        return check, plan, start
    if chain.begins_at:  # the whole chain is not here to fall back on
        raise PartialChainShort(f"{target.describe()} cannot be reached from {entry.name}: {chain.missing()}, and "
                                f"the verified run does not reach checkpoint {start.name} "
                                f"({stop_sentence(Prepared(entry, target, check, plan, ()))}); nothing touched")
    # damage between its lease census and it, or a time target met before it: every segment then
    passed.append(f"{start.name}: the verified chain does not reach it "
                  f"({stop_sentence(Prepared(entry, target, check, plan, ()))})")
    check = chain.verified()
    return check, _plan(entry, check, target), None


def _reachable_here(chain: _Chain) -> str:
    """Why no replay of a partial chain starts for the target, and what it reaches instead."""
    run = chain.outline()
    floor = chains.served_floor(run.segments, chain.begins_at or 0)
    if floor is None:
        return "no checkpoint it vouches for"
    cp, at = floor
    return (f"what is here reaches from checkpoint {cp.name} (revision {cp.revision}, from {when_text(at)}) to "
            f"revision {run.end_revision} at {when_text(run.end_time_ms)}")


def _refuse_before(entry: "Entry", target: Target, plan: Plan) -> None:
    """A target before the full backup: only an older full backup reaches it."""
    assert entry.revision is not None
    if target.kind == "revision" and target.revision is not None and target.revision < entry.revision:
        raise RefusedError(f"target revision {target.revision} is before {entry.name} (revision {entry.revision}): "
                           "restore from an older full backup; nothing touched")
    if plan.stop_revision < entry.revision:
        raise RefusedError(f"{target.describe()} predates {entry.name} (revision {entry.revision}): restore from an "
                           "older full backup; nothing touched")


def _key(cfg: "Config") -> Optional[bytes]:
    from etcd_agent.backup import keys

    return keys.local_key(cfg).key


def _signed(cfg: "Config", prep: Prepared, key: Optional[bytes], accept: bool) -> Prepared:
    """``prep`` with the plan's line about the chain's signatures; refused when it is not signed
    with the manifest key and ``accept`` is not given (``segsign.verdict``)."""
    from etcd_agent.backup import keys

    line, refusal = segsign.verdict(prep.check.segments, key is not None, keys.key_path(cfg), accept)
    if refusal is not None:
        raise RefusedError(f"{prep.entry.name}: {refusal}")
    return dataclasses.replace(prep, signatures=line)


def _read_sealed(cfg: "Config", entry: "Entry", identities: "Identities", staging: str) -> "Entry":
    """An encrypted full backup no check of this host remembers (copied here from elsewhere):
    decrypted through the bounded reader into ``staging`` as it streams (every chunk authenticated,
    the plaintext checked as a plain snapshot is), its revision and snapshot sha256 (what its chain
    names) read from its own db, the copy removed. A fault is one refusal naming it: a key that
    opens nothing, a damaged header (its MAC), a damaged chunk, a file cut short."""
    from dataclasses import replace

    from etcd_agent.backup.keys import local_key
    from etcd_agent.backup.reader import open_archive
    from etcd_agent.errors import BackupCorrupt

    try:
        arc = open_archive(entry.path, staging_dir=staging, hash_snapshot=True, key=local_key(cfg).key,
                           identities=identities, need_plaintext=True)
    except BackupCorrupt as exc:  # IdentityRefused (a RefusedError) names the key file itself
        problem = exc.details[0] if exc.details else exc.message
        raise RefusedError(f"{entry.name}: {problem}; it cannot be restored (use another backup); nothing "
                           "touched") from None
    try:
        snap, ident = arc.plaintext()
        return replace(entry, revision=ident.revision, snapshot_sha256=snap.sha256 or entry.snapshot_sha256,
                       member_ids=tuple(m.id_hex for m in ident.members))
    finally:
        arc.close()


def _plan(entry: "Entry", check: ChainCheck, target: Target) -> Plan:
    _refuse_locked(entry.name, check)
    try:
        return plan_replay(check, target)
    except ReplayError as exc:
        raise RefusedError(f"{entry.name}: {exc.message}; nothing touched") from None


def _opener(cfg: "Config", identities: Optional["Identities"], staging: Optional[str]) -> Optional[Opener]:
    """Each encrypted segment decrypted into ``staging`` once (a second check of the chain in the
    same prepare takes the copy it made)."""
    if identities is None:
        return None
    if staging is None:
        raise ValueError("decrypting a chain needs a private staging dir")
    from etcd_agent.backup import keys

    key = keys.local_key(cfg).key  # the seals' HMAC is checked when this host has the manifest key
    opened: Dict[str, SegmentInfo] = {}

    def open_once(path: str) -> SegmentInfo:
        if path not in opened:
            opened[path] = open_sealed(path, identities, staging, key=key)
        return opened[path]

    return open_once


def _refuse_locked(name: str, check: ChainCheck) -> None:
    """An encrypted chain checked without its key cannot be replayed: say so, and for whom."""
    locked = [s for s in check.segments if s.sealed is not None and not s.sealed.opened]
    if not locked:
        return
    from etcd_agent.backup.sealed import shown_recipients

    to = sorted({r for s in locked for r in s.sealed.recipients})  # type: ignore[union-attr]
    raise IdentityRefused(f"the delta chain of {name} is encrypted ({len(locked)} of its {len(check.segments)} "
                          f"segment(s), age to {shown_recipients(to)}): pass --identity FILE with the secret key of one of them; "
                          "nothing touched")


def stop_sentence(p: Prepared) -> str:
    """Where the chain stops and why, with its last good point."""
    c = p.check
    passed = ""
    if c.passed:
        passed = "; passed over as not this chain's: " + "; ".join(
            f"{os.path.basename(f)} ({why})" for f, why in c.passed[:3]) + (
            f" and {len(c.passed) - 3} more" if len(c.passed) > 3 else "")
    if c.stop is not None:
        good = c.stop.last_good_time_ms or int(p.entry.time.timestamp() * 1000)  # none: the backup's own time
        return (f"the chain stops at revision {c.stop.at_revision} ({c.stop.kind}: {c.stop.reason}); its last good "
                f"point is revision {c.stop.last_good_revision} at {when_text(good)}; nothing after a "
                f"gap is ever applied{passed}")
    end = f"revision {c.end_revision} at {when_text(c.end_time_ms)}" if c.segments else \
        f"the full backup itself (revision {c.base_revision}: no segment continues it)"
    brk = next((b for b in reversed(p.breaks)), None)
    why = (f"; the daemon recorded a break there: {b_reason(brk)}" if brk is not None else
           " (the newest segment; the watch may still be writing the next one)")
    return f"the chain ends at {end}{why}{passed}"


def b_reason(b: status.BreakRecord) -> str:
    return (f"at revision {b.at_revision} ({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(b.time))}): "
            f"{b.reason}")


def refusal_hints(cfg: "Config", p: Prepared) -> List[str]:
    """What to run instead, naming only restores that would be accepted: up to the last good
    point, or a newer full backup whose own chain reaches the target. Never a checkpoint (known as
    one by the chain that vouches for it, also before the manifest key is on this host): it is
    no chain's base, so ``--from`` it is refused again, or restores it as an operator's backup."""
    c = p.check
    last = c.stop.last_good_revision if c.stop is not None else c.end_revision
    hints = [f"restore up to that point: --from {p.entry.name} --to-revision {last}"]
    from etcd_agent.backup import catalog, keys

    key = keys.local_key(cfg).key
    try:
        found = chains.scan(cfg.backup.dir)
        entries = catalog.list_backups(cfg.backup.dir, utc=cfg.backup.utc, cfg=cfg, key=key)
        goods = [e for e in catalog.good(catalog.chain_checkpoints(entries, found)) if not e.checkpoint_of]
    except Exception:  # noqa: BLE001 - a hint is not worth failing for
        return hints
    active = chains.active_base(cfg.backup.dir)  # the chain the daemon writes now
    newer = [e for e in goods if e.revision is not None and e.revision > last
             and fullpick.reaches(found, e, p.target, key is not None, live=e.revision == active)]
    if newer:
        n = newer[-1]  # the oldest full backup after the stop
        hints.append(f"or from {n.name} (revision {n.revision}, taken after the chain stopped), whose own chain "
                     f"continues from there: --from {n.name}")
    return hints


def scratch_options(cfg: "Config", encrypted: bool = False) -> ScratchOptions:
    """The cluster's own etcd release (the replayed db is then what it writes), on loopback, in a
    private dir beside the backups (the same filesystem that holds them has room for one more);
    ``encrypted``: in ``private_dir``, never under the backup dir."""
    e = cfg.etcd
    if not e.etcdutl:
        raise RefusedError("a point-in-time restore needs etcdutl (etcd >= 3.5) for its throwaway replay member: "
                           "set [etcd] etcdutl; nothing touched")
    return ScratchOptions(binaries=EtcdBinaries(etcd=e.binary, etcdutl=e.etcdutl, etcdctl=e.etcdctl),
                          parent_dir=work_dir(cfg, encrypted))


def kept_path(cfg: "Config", p: Prepared, encrypted: bool) -> str:
    """Where ``replay_kept`` keeps the replay of ``p``."""
    return os.path.join(work_dir(cfg, encrypted), p.kept_name)


def replay_kept(cfg: "Config", p: Prepared, identities: Optional["Identities"] = None, *,
                stop: Optional[threading.Event] = None) -> Tuple[str, ReplayResult, bool]:
    """Replay into ``<backup dir>/.pitr/<kept name>`` (with ``identities``: ``private_dir``),
    reused when a crashed run left it: (path, result, reused). Call it holding ``lock``.
    ``stop``: set, the replay ends at its next step (ReplayError), nothing kept."""
    out = kept_path(cfg, p, identities is not None)
    side = out + ".json"
    if os.path.isfile(out) and os.path.isfile(side):
        try:
            with open_regular(side) as fh:
                res = ReplayResult.from_json(load_json(fh, max_bytes=MAX_KEPT_RESULT), side)
            as_prepared(p, res)
            log.info("reusing the replay %s left by an earlier run of this restore", out)
            return out, res, True
        except (OSError, ValueError, BackupCorrupt, ReplayError) as exc:
            log.warning("cannot reuse %s (%s): replaying again", out, exc)
    for stale in (out, side):
        if os.path.exists(stale):
            os.unlink(stale)
    # the chain as prepare() just chose and verified it (the dir may hold another chain at the same
    # base): the replay reads those segments again, checked to be the same bytes
    # CheckpointUnusable when the checkpoint is not what its chain vouches for: the caller prepares
    # again without it (an older one, or the full backup, and the chain verified from there)
    paths = [s.path for s in p.check.segments] + list(p.check.lost)
    st = p.start
    res = replay(st.path if st else p.entry.path, paths, p.target, output=out,
                 options=scratch_options(cfg, identities is not None),
                 check=p.check, identities=identities,
                 checkpoint=(st.checkpoint.sha256, st.revision) if st else None, stop=stop, planned=p.plan,
                 from_base=st is None and p.entry.revision == p.check.base_revision)
    try:
        as_prepared(p, res)
    except ReplayError:
        remove_kept(out)
        raise
    write_atomic(side, (json.dumps(res.to_json(), indent=1) + "\n").encode(), mode=0o600)
    return out, res, False


def as_prepared(p: Prepared, res: ReplayResult) -> None:
    """A replay is done only at the revision the operator was shown (``p.plan``), as complete as
    planned: the replay checks its own plan, this its result (and a kept one's) once more."""
    if res.reached_revision != p.plan.stop_revision or res.complete != p.plan.complete:
        raise ReplayError(f"the replay reached revision {res.reached_revision}"
                          f"{'' if res.complete else ' (incomplete)'}, the prepared plan revision "
                          f"{p.plan.stop_revision}{'' if p.plan.complete else ' (incomplete)'}: not what was asked")


def remove_kept(path: str) -> None:
    for p in (path, path + ".json"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def kept_result(cfg: "Config", spec: str) -> Optional[Tuple[str, ReplayResult]]:
    """``--from`` naming a kept replay (what a crashed point-in-time restore's journal names)."""
    path = os.path.abspath(spec)
    if not in_work_dir(cfg, path) or not os.path.isfile(path + ".json"):
        return None
    with open_regular(path + ".json") as fh:
        return path, ReplayResult.from_json(load_json(fh, max_bytes=MAX_KEPT_RESULT), path + ".json")
