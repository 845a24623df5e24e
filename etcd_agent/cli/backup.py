"""`etcd-agent backup` and `backup list | verify FILE | import FILE | prune [--dry-run]`."""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from etcd_agent.cli.main import Context, Output
from etcd_agent.errors import EXIT_FAILED, EXIT_OK, BackupError, UsageError
from etcd_agent.fs import size_text

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.backup.boundaries import Boundary, Record
    from etcd_agent.backup.catalog import Entry
    from etcd_agent.chain.chains import ChainSummary, Scan
    from etcd_agent.config import Config

# state.locks.SHORT_WAIT, as a restore waits (not imported here: the CLI starts without tenacity)
BACKUP_WAIT = 60.0

log = logging.getLogger(__name__)

IDENTITY_HELP = "an age identity file (mode 0600) holding the secret key of one of an encrypted backup's recipients"


def load_identity(path: Optional[str]) -> Any:
    """``--identity FILE`` loaded (refused unless only its owner can read it), or None."""
    if path is None:
        return None
    from etcd_agent.age import load_identities

    return load_identities(path)


def register(sub: Any) -> None:
    p = sub.add_parser("backup", help="take a backup now (or: backup list | verify FILE | prune)")
    p.add_argument("--member", metavar="NAME", help="snapshot this member's etcd (default: the local member)")
    p.add_argument(
        "--verify", action="store_true",
        help="also run the full verify (extract + snapshot status) before the backup counts",
    )
    p.add_argument("--no-prune", action="store_true", help="do not apply the retention policy afterwards")
    p.add_argument(
        "--wait", type=float, default=BACKUP_WAIT, metavar="SECONDS",
        help="while another backup, prune or import on this host holds its lock (the daemon's own full "
             f"backup, a second cron line), wait up to this long, then take this one (default {BACKUP_WAIT:g}; "
             "0: busy at once, exit 4); anything else holding it is busy at once",
    )
    p.set_defaults(func=cmd_backup)
    bsub = p.add_subparsers(dest="backup_command", metavar="SUBCOMMAND")

    pl = bsub.add_parser("list", help="backups in the backup dir, newest first")
    pl.add_argument("--remote", action="store_true", help="list the off-host copies ([backup.remote]) instead")
    pl.set_defaults(func=cmd_list)

    pv = bsub.add_parser("verify", help="check an archive: members, every sha256, the snapshot, its identity")
    pv.add_argument("file", metavar="FILE", help="a path, a file name in the backup dir, a date prefix, or latest")
    pv.add_argument("--no-status", action="store_true", help="skip `snapshot status` (no staged copy)")
    pv.add_argument("--identity", metavar="FILE", help=IDENTITY_HELP + "; without it an encrypted backup is "
                    "checked as far as its ciphertext allows")
    pv.set_defaults(func=cmd_verify)

    pi = bsub.add_parser("import", help="turn a tarball made by hand (etcdctl snapshot save + tar) into a backup")
    pi.add_argument("file", metavar="FILE", help="the tarball (etcd.conf, etcd.service, etcd_snapshot.db)")
    pi.add_argument("--dry-run", action="store_true", help="check it and print the name it would get; write nothing")
    pi.add_argument("--identity", metavar="FILE", help=IDENTITY_HELP + " (it is re-encrypted to [backup] encrypt_to)")
    pi.set_defaults(func=cmd_import)

    pu = bsub.add_parser("push", help="copy to the bucket now whatever it lacks (full backups, checkpoints, delta "
                         "segments), in order, once; the daemon does the same by itself and retries")
    pu.add_argument("--dry-run", action="store_true", help="list what the bucket lacks, copy nothing")
    pu.set_defaults(func=cmd_push)

    pf = bsub.add_parser("fetch", help="bring a backup from the bucket, with its chain's segments and checkpoints, "
                         "into the backup dir (resumable; each file appears only whole and checked)")
    pf.add_argument("backup", metavar="BACKUP", help="latest, a file name in the bucket, or a date like 2019-08-07")
    pf.add_argument("--dry-run", action="store_true", help="list the objects it would fetch; fetch nothing")
    pf.set_defaults(func=cmd_fetch)

    pp = bsub.add_parser("prune", help="apply the retention policy; every decision is printed with its reason")
    pp.add_argument("--dry-run", action="store_true", help="decide and print, delete nothing")
    pp.add_argument("--remote", action="store_true", help="apply the remote retention to the off-host copies instead")
    pp.set_defaults(func=cmd_prune)


def cmd_backup(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.backup.service import take_backup
    from etcd_agent.config import security_warnings

    if not 0 <= args.wait <= 3600:
        raise UsageError("--wait must be between 0 and 3600 seconds")
    cfg = ctx.config()
    for w in security_warnings(cfg):  # cron mails / syslogs stderr
        log.warning("%s", w)
    from etcd_agent.bucket.copier import off_host

    res = take_backup(cfg, member=args.member, full_verify=args.verify, prune=not args.no_prune, lock_wait=args.wait,
                      off_host=off_host(cfg))
    text = res.path
    for w in res.warnings:
        log.warning("%s", w)
    return Output(res.to_json(), text)


def cmd_list(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.backup import keys
    from etcd_agent.backup.catalog import latest, list_backups

    cfg = ctx.config()
    if args.remote:
        return _list_remote(cfg)
    from etcd_agent.backup import boundaries
    from etcd_agent.chain import chains
    from etcd_agent.drill.record import with_drills

    entries = with_drills(list_backups(cfg.backup.dir, utc=cfg.backup.utc, cfg=cfg, key=keys.local_key(cfg).key),
                          cfg.backup.dir)
    found = chains.scan(cfg.backup.dir)
    record = boundaries.load(cfg.backup.dir)
    restores = record.boundaries
    active = chains.active_base(cfg.backup.dir)
    rows: List[str] = [f"{'NAME':<36} {'TIME':<25} {'SIZE':>10} {'REVISION':>9} {'KIND':<8} {'SIGNED':<11} VERIFIED"]
    docs = []
    for e in entries:
        more, doc = _entry(e, found, restores, active, entries)
        rows += more
        docs.append(doc)
    orphans = [c for c in found.chains if not any(e.revision == c.base_revision and c.listed_under(e.base)
                                                  for e in entries)]
    rows += _problem_rows(found, orphans, record)
    best, skipped = latest(entries)
    if not entries:
        rows.append(f"(no backups in {cfg.backup.dir})")
    else:
        rows.append(f"latest: {best.name if best else 'none (no good backup)'}")
        rows += skipped
    data = {"dir": cfg.backup.dir, "backups": docs, "latest": best.name if best else None, "notes": skipped,
            "orphan_chains": [c.to_json() for c in orphans],
            "restores": [b.to_json() for b in restores],
            "restore_record_problem": record.problem,
            "damaged_segments": [{"path": p, "problem": w} for p, w in found.unreadable if p not in found.junk],
            "not_segments": [{"path": p, "problem": w} for p, w in found.unreadable if p in found.junk],
            "replay_events_per_second": chains.REPLAY_EVENTS_PER_SECOND}
    return Output(data, "\n".join(rows))


def _entry(e: "Entry", found: "Scan", restores: Sequence["Boundary"], active: Optional[int],
           entries: Sequence["Entry"]) -> Tuple[List[str], Dict[str, Any]]:
    """One backup's lines of ``backup list`` and its JSON document."""
    from etcd_agent.backup import boundaries

    if not e.complete:
        state = f"QUARANTINED: {e.problem}"
    elif e.verified:
        state = f"yes: {e.check}"
    else:
        state = f"no: {e.check}"
    rows = [f"{e.name:<36} {e.time.isoformat():<25} {size_text(e.size):>10} {str(e.revision or '-'):>9} "
            f"{e.kind:<8} {e.signature:<11} {state}"]
    rows += _origin_rows(e, found)
    rows += [f"{'':<36}   {n}" for n in (e.notes if e.complete else ())]
    boundary = boundaries.before(restores, e.time.timestamp())
    if boundary is not None:
        rows.append(f"{'':<36}   BEFORE {boundary.describe()}: the cluster as it was then (a rollback point; "
                    "`restore --from` it with --new-cluster)")
    if e.drill is not None:
        rows.append(f"{'':<36}   {e.drill.summary()}")
    doc = e.to_json()
    doc["before_restore"] = boundary.to_json() if boundary is not None else None
    chain = found.for_full(e.revision, e.base) if e.revision is not None else None
    if chain is None and e.revision is not None:  # a partial chain fetched from the bucket
        chain = next((c for c in found.chains if c.base_revision == e.revision and c.listed_under(e.base)), None)
    if e.complete and not e.checkpoint_of:
        live = " (being written now)" if chain is not None and chain.base_revision == active else ""
        rows.append(f"{'':<36}   delta chain{live}: {chain.describe() if chain else 'none'}")
    doc["chain"] = chain.to_json() if chain else None
    missing = _checkpoints_not_here(chain, entries) if chain is not None and e.complete and not e.checkpoint_of else []
    rows += [f"{'':<36}   {m}" for m in missing]
    if doc["chain"] is not None:
        doc["chain"]["checkpoints_not_here"] = missing
    return rows, doc


def _checkpoints_not_here(chain: "ChainSummary", entries: Sequence["Entry"]) -> List[str]:
    """The checkpoints ``chain`` vouches for (by name, from its footers) that no good backup here
    is: the file under the name is missing, quarantined, or not that checkpoint (a runbook tarball
    or another backup: not a checkpoint of this chain, or a snapshot other than the one the
    footer names by sha256). A restore never starts from those (``pitr.prepare`` checks the same):
    the listing must not promise it."""
    out = []
    for cp in chain.checkpoints:
        e = next((x for x in entries if x.name == cp.name), None)
        if e is None:
            why = "not here"
        elif not e.complete:
            why = f"quarantined ({e.problem})"
        elif e.checkpoint_of != chain.chain_id or e.base.sha256 != cp.sha256:
            why = (f"the file under its name is not it (a {e.kind} backup"
                   + (", no checkpoint of this chain" if e.checkpoint_of != chain.chain_id else "")
                   + (f", snapshot sha256 {(e.base.sha256 or 'unknown')[:12]}..., the chain vouches for "
                      f"{cp.sha256[:12]}...)" if e.base.sha256 != cp.sha256 else ")"))
        else:
            continue
        after = ("a partial chain needs a checkpoint from its own segments on: without one here a restore from "
                 "it is refused" if chain.begins_at else "a restore starts from an older one here or the full backup")
        out.append(f"checkpoint {cp.name} (revision {cp.revision}), which the chain vouches for: {why}; no restore "
                   f"starts from it ({after})")
    return out


def _origin_rows(e: "Entry", found: "Scan") -> List[str]:
    """What ``backup list`` says of a backup the daemon took: a checkpoint, or a chain's start."""
    if e.checkpoint_of:
        vouched = any(c.name == e.name for ch in found.chains if ch.chain_id == e.checkpoint_of
                      for c in ch.checkpoints)
        return [f"{'':<36}   a checkpoint the daemon took inside delta chain {e.checkpoint_of[:8]}: "
                + ("vouched for by the chain, a point-in-time restore starts its replay here" if vouched else
                   "not vouched for by its chain (yet): no restore starts from it")
                + " (kept apart from retention's slots)"]
    if e.origin == "daemon":
        return [f"{'':<36}   taken by the daemon to start a delta chain (retention counts these apart)"]
    return []


def _problem_rows(found: "Scan", orphans: List["ChainSummary"], record: "Record") -> List[str]:
    """The chains and files of the backup dir that ``backup list`` must warn about."""
    from etcd_agent.backup import boundaries

    rows = [f"ORPHANED delta chain after revision {c.base_revision}: no full backup here that it continues "
            f"(pruned at the next backup or prune): {c.describe()}" for c in orphans]
    for path, why in found.unreadable:
        if path in found.junk:  # by its content: no chain's, whatever its name says (never a gap)
            rows.append(f"NOT A SEGMENT {os.path.basename(path)}: {why}; named like one, passed over by every chain")
        else:
            rows.append(f"DAMAGED segment {os.path.basename(path)}: {why}")
    if record.problem:
        rows.append(f"PRUNE HELD: {boundaries.unreadable_message(record.problem)}")
    return rows


def require_remote(cfg: "Config") -> None:
    if not cfg.backup.remote.enabled:
        raise UsageError("no off-host copies configured: set [backup.remote] enabled = true")


def _list_remote(cfg: "Config") -> Output:
    from etcd_agent.bucket import layout
    from etcd_agent.bucket.offsite import chains_of
    from etcd_agent.bucket.remote import list_remote_and_names

    require_remote(cfg)
    objs, listed = list_remote_and_names(cfg)  # one listing for the copies and their chains
    keyed, legacy = chains_of(listed)
    rows = [f"{'NAME':<32} {'TIME':<25} {'SIZE':>10}  {'SHA256':<16}  CHAIN"]
    docs = []
    for o in objs:
        where = f"chains/{o.chain[:16]}…" if o.chain else "legacy (top of the prefix)"
        rows.append(f"{o.name:<32} {o.time.isoformat():<25} {size_text(o.size):>10}  {(o.sha256 or '-')[:16]:<16}  {where}")
        revision = _int_or_none(o.metadata.get("revision"))
        names = keyed.get(o.chain, []) if o.chain else legacy.get(revision, []) if revision is not None else []
        got = layout.reach(names, revision)
        rows.append(f"{'':<32}   {got.describe()}")
        docs.append({**o.to_json(), "chain_reach": got.to_json()})
    if not objs:
        rows.append("(no off-host copies)")
    return Output({"remote": True, "backups": docs}, "\n".join(rows))


def _int_or_none(text: Optional[str]) -> Optional[int]:
    """A revision from an object's metadata (hostile: anything that is not a plain number is None)."""
    return int(text) if text is not None and re.fullmatch(r"[0-9]{1,18}", text) else None


def cmd_push(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.bucket import copier, queue

    cfg = ctx.config()
    require_remote(cfg)
    caches = queue.Caches()
    if args.dry_run:
        plan = copier.pending(cfg, caches)
        rows = [f"would copy {f.path} to {f.name} ({size_text(f.size)})" for f in plan.pending]
        rows += [f"not copied: {p}: {why}" for p, why in zip(plan.unplaced, plan.why_unplaced)]
        return Output({"pending": [f.name for f in plan.pending], "pending_bytes": plan.pending_bytes},
                      "\n".join(rows) or "nothing pending: the bucket holds every backup, checkpoint and segment here")
    res = copier.push(cfg, caches)
    left = res.left
    rows = [f"copied {f.path} to {f.name} ({size_text(f.size)})" for f in res.copied]
    if res.error and not res.plan.pending:  # the listing or the backup dir: nothing known to be pending
        raise BackupError(f"backup push: nothing copied: {res.error} (the daemon retries)")
    if res.error:
        raise BackupError(f"backup push: {len(res.copied)} object(s) copied, then {res.failed} failed: {res.error}; "
                          f"{len(left)} object(s) still pending (the daemon retries them)", details=rows)
    rows.append(f"{len(res.copied)} object(s) copied; nothing pending" if not left else
                f"{len(res.copied)} object(s) copied; {len(left)} appeared meanwhile (the next push or the daemon copies them)")
    return Output({"copied": [f.name for f in res.copied], "pending": [f.name for f in left]}, "\n".join(rows))


def cmd_fetch(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.bucket import fetch, staging

    cfg = ctx.config()
    require_remote(cfg)
    full, listed = fetch.plan(cfg, args.backup)
    items, skipped = staging.checkpoints_kept(cfg, listed)
    total = sum(w.size for w in items)
    data: Dict[str, Any] = {"backup": full.name, "chain": full.chain or None, "folder": full.folder or None,
                            "dry_run": args.dry_run, "objects": [w.to_json() for w in items], "bytes": total,
                            "not_fetched": skipped}
    if args.dry_run:
        plan = [f"would fetch {w.name} ({size_text(w.size)})" for w in items]
        plan += [f"not fetched: {s}" for s in skipped]
        plan.append(f"{len(items)} object(s), {size_text(total)}, into {cfg.backup.dir}; nothing fetched")
        return Output(data, "\n".join(plan))
    got = staging.fetch_into(fetch.bound(cfg, full.folder), items,
                             progress=(lambda s: None) if ctx.json else _fetch_progress)
    data["objects"] = [f.to_json() for f in got]
    rows = [f"{f.how} {f.wanted.file} ({size_text(f.wanted.size)}"
            + (f", continued at byte {f.resumed_at})" if f.resumed_at else ")") for f in got]
    rows += [f"not fetched: {s}" for s in skipped]
    rows.append(f"{full.name}: {len(got)} object(s), {size_text(total)}, in {cfg.backup.dir}")
    return Output(data, "\n".join(rows))


def _fetch_progress(line: str) -> None:
    """A line per object as it begins and ends, and every few seconds of a long one (stderr)."""
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} backup fetch: {line}\n")
    sys.stderr.flush()


def _client(cfg: "Config") -> Any:
    from etcd_agent.etcd.client import EtcdClient

    return EtcdClient.from_config(cfg, timeout=2.0)


def _resolve_file(cfg: "Config", spec: str) -> str:
    from etcd_agent.backup.catalog import resolve

    if os.path.isfile(spec):
        return spec
    candidate = os.path.join(cfg.backup.dir, spec)
    if not spec.startswith(".") and os.path.isfile(candidate):
        return candidate
    return resolve(cfg.backup.dir, spec, utc=cfg.backup.utc).path


def cmd_verify(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.backup import checks, keys
    from etcd_agent.backup.evidence import gather
    from etcd_agent.backup.verify import verify
    from etcd_agent.etcd.tools import snapshot_status
    from etcd_agent.hosts.local import LocalHost

    cfg = ctx.config()
    identities = load_identity(args.identity)
    path = _resolve_file(cfg, args.file)
    with _client(cfg) as client:
        keystate = keys.cluster_key(cfg, client, create=False)
    for w in keystate.warnings:
        log.warning("%s", w)
    evidence = gather(cfg)
    host = LocalHost()
    in_dir = os.path.dirname(os.path.abspath(path)) == os.path.abspath(cfg.backup.dir)
    before = os.stat(path)
    report = verify(
        path,
        status_fn=None if args.no_status else (lambda p: snapshot_status(host, cfg, p)),
        tmp_parent=cfg.backup.dir if in_dir else os.path.dirname(os.path.abspath(path)),
        key=keystate.key,
        cfg=cfg,
        evidence=evidence,
        identities=identities,
    )
    # a failure of `snapshot status` alone may be the tool's (not installed, too old): not recorded
    # against the file, so a good backup is not quarantined for it
    content_verdict = report.ok or not (report.tool_failed and len(report.problems) == 1)
    if report.keyless and report.ok and report.signature != "valid":
        # without the key only a signed ciphertext sha256 ties these bytes to what the writer checked
        content_verdict = False
    if in_dir and content_verdict and checks.stamp_of(os.stat(path)) == checks.stamp_of(before):
        # without the key the revision and member ids stay those the writer read (same bytes)
        prior = checks.lookup(checks.load(cfg.backup.dir), os.path.basename(path), before) if report.keyless else None
        c = checks.Check(stamp=checks.stamp_of(before), ok=report.ok, how="verify-nokey" if report.keyless else "verify",
                         at=checks.SYSTEM_WALL_CLOCK.now().timestamp(), kind=report.kind or "?",
                         revision=report.revision if prior is None else prior.revision,
                         member_ids=() if prior is None else prior.member_ids,
                         problem=report.problems[0] if report.problems else None, signature=report.signature)
        checks.record(cfg.backup.dir, os.path.basename(path), c)
    kind = {"agent": "agent backup", "runbook": "runbook tarball (made by hand: etcdctl snapshot save + tar)"}.get(
        report.kind or "", "unreadable file")
    enc = report.encryption
    sealed = "" if enc is None else (", encrypted (age), decrypted with the identity" if enc["decrypted"] else
                                     ", encrypted (age), checked WITHOUT the key: the snapshot inside was not read")
    lines = [f"{path}: {'OK' if report.ok else 'FAILED'}: {kind}"
             + (f", {'plain tar' if report.compression == 'none' else report.compression}, manifest {report.signature}"
                if report.kind == "agent" else "") + sealed]
    lines += [f"  ok: {c}" for c in report.checked]
    lines += [f"  not checked: {c}" for c in report.not_checked]
    lines += [f"  PROBLEM: {p}" for p in report.problems]
    return Output(report.to_json(), "\n".join(lines), EXIT_OK if report.ok else EXIT_FAILED)


def cmd_import(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.backup.evidence import gather
    from etcd_agent.backup.importer import import_backup
    from etcd_agent.etcd.tools import snapshot_status
    from etcd_agent.hosts.local import LocalHost

    cfg = ctx.config()
    identities = load_identity(args.identity)
    if not os.path.isfile(args.file):
        raise UsageError(f"backup import {args.file}: no such file")
    host = LocalHost()
    with _client(cfg) as client:
        res = import_backup(cfg, args.file, dry_run=args.dry_run, evidence=gather(cfg),
                            status_fn=lambda p: snapshot_status(host, cfg, p), client=client, identities=identities)
    for w in res.warnings:
        log.warning("%s", w)
    head = f"would import {res.source} as {res.path}" if res.dry_run else res.path
    lines = [head, f"  {res.kind} tarball, revision {res.revision}"]
    lines += [f"  ok: {c}" for c in res.checked]
    lines += [f"  identity: {p}" for p in (res.verdict.proven if res.verdict else ())]
    lines += [f"  not proven: {p}" for p in (res.verdict.unproven if res.verdict else ())]
    return Output(res.to_json(), "\n".join(lines))


def cmd_prune(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.backup.service import prune_locked

    cfg = ctx.config()
    if args.remote:
        from etcd_agent.bucket.remote import prune_remote

        require_remote(cfg)
        decisions = prune_remote(cfg, dry_run=args.dry_run)
    else:
        decisions = prune_locked(cfg, dry_run=args.dry_run)
    lines = []
    for d in decisions:
        verb = "keep  " if d.keep else ("would delete" if args.dry_run else "delete")
        lines.append(f"{verb:<12} {d.name}: {d.reason}")
    if not decisions:
        lines.append("(no backups)")
    data = {
        "dry_run": args.dry_run,
        "decisions": [{"name": d.name, "keep": d.keep, "reasons": list(d.reasons)} for d in decisions],
    }
    return Output(data, "\n".join(lines))
