"""`etcd-agent restore --from NAME|PATH|DATE|latest | --from-bucket NAME|DATE|latest [--key-file F] [--to-time T | --to-revision N | --to newest]
[--accept-unsigned-chain] [--dry-run] [--yes] [--new-token T] [--new-cluster]`,
`restore rollback [--dry-run] [--yes]` and `restore cleanup [--dry-run] [--keep N] [--yes]`.

Progress goes to stderr as it happens; the plan (dry run) or the outcome goes to stdout.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any, List, Optional

from etcd_agent.cli.main import Context, Output
from etcd_agent.errors import EXIT_REFUSED, RefusedError, UsageError

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config
    from etcd_agent.node.replies import CleanupReply
    from etcd_agent.pitr.replay import Target
    from etcd_agent.restore.orchestrator.frombucket import BucketPlan


def register(sub: Any) -> None:
    p = sub.add_parser("restore", help="restore the whole cluster from a backup (all hosts, all or nothing)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from", dest="spec", metavar="BACKUP", help="a path, a file name in the backup dir, a date like 2019-08-07, or latest")
    src.add_argument("--from-bucket", dest="bucket_spec", metavar="BACKUP",
                     help="the same words (a file name, a date, latest), looked up in the bucket of [backup.remote]: "
                          "the backup (and, for a point in time, its chain) is fetched into the backup dir, checked "
                          "from its content, then restored - for masters whose backup dir is gone too")
    p.add_argument("--key-file", metavar="FILE",
                   help="the cluster's manifest key (a copy of manifest.key kept off the masters, mode 0600): "
                        "manifests and delta segments are checked with it instead of this host's cached key")
    p.add_argument("--dry-run", action="store_true", help="print the plan per host and run the pre-checks; change nothing")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--new-token", metavar="TOKEN", help="initial cluster token of the restored cluster (default: a new one)")
    p.add_argument(
        "--new-cluster", action="store_true",
        help="seed the cluster of this config from the backup even though the backup is of another cluster "
             "(other members, addresses or cluster id)",
    )
    p.add_argument("--identity", metavar="FILE",
                   help="an age identity file (mode 0600) with the secret key of one of the backup's recipients: "
                        "an encrypted backup is decrypted on this master only")
    to = p.add_mutually_exclusive_group()
    to.add_argument("--to-time", metavar="TIME",
                    help="point in time: replay the backup's delta chain up to this ISO time with its zone "
                         "(2026-12-01T10:03:00Z); with --from latest, the newest full backup at or before it")
    to.add_argument("--to-revision", type=int, metavar="N", help="point in time: replay the delta chain up to revision N")
    to.add_argument("--to", dest="to_newest", choices=["newest"],
                    help="newest: replay everything the delta chain holds (the usual choice after a disaster)")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="point in time: replay the whole chain from the full backup, not from the newest checkpoint "
                        "the chain vouches for (the result is the same; only slower)")
    p.add_argument("--accept-unsigned-chain", action="store_true",
                   help="point in time: replay a delta chain that is not signed with the cluster's manifest key "
                        "(written before segments were signed, or without the key); the plan says so")
    p.set_defaults(func=cmd_restore)
    rsub = p.add_subparsers(dest="restore_command", metavar="SUBCOMMAND")
    pc = rsub.add_parser("cleanup", help="list / remove set-aside data dirs (<data dir>.pre-restore-*), keeping the newest")
    pc.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    pc.add_argument("--keep", type=int, default=1, metavar="N", help="set-aside dirs to keep per member (default 1)")
    pc.add_argument("--yes", action="store_true", help="do not ask before deleting")
    pc.set_defaults(func=cmd_cleanup)
    pr = rsub.add_parser("rollback", help="roll back an unfinished (crashed) restore journaled on the hosts")
    pr.add_argument("--dry-run", action="store_true", help="show the unfinished restores; change nothing")
    pr.add_argument("--yes", action="store_true", help="do not ask")
    pr.set_defaults(func=cmd_rollback)


def _progress(line: str) -> None:
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} restore: {line}\n")
    sys.stderr.flush()


def cmd_restore(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.cli.backup import load_identity
    from etcd_agent.restore.orchestrator.options import Options
    from etcd_agent.restore.orchestrator.orchestrate import restore
    from etcd_agent.restore.orchestrator.plan import render_plan

    if not args.spec and not args.bucket_spec:
        raise UsageError("restore needs --from BACKUP (a path, a file name, a date like 2019-08-07, or latest) or "
                         "--from-bucket BACKUP")
    identities = load_identity(args.identity)  # refused before anything else when others can read it
    target = _target(args)
    if args.accept_unsigned_chain and target is None:
        raise UsageError("--accept-unsigned-chain is for a point-in-time restore (--to-time, --to-revision, --to newest)")
    cfg = ctx.config()
    if args.key_file:
        cfg = with_key_file(cfg, args.key_file)
    spec, fetched = args.spec, None
    if args.bucket_spec:
        from etcd_agent.restore.orchestrator import frombucket

        bp = _bucket_plan(cfg, args, target)
        if args.dry_run:
            return _bucket_dry_run(cfg, bp, identities)
        fetched = frombucket.fetch_checked(
            cfg, bp, target, identities=identities, new_cluster=args.new_cluster,
            checkpoints=not args.no_checkpoint, accept_unsigned=args.accept_unsigned_chain, key_file=args.key_file,
            progress=(lambda s: None) if ctx.json else _progress)
        spec = bp.file
    before = "".join(f"  {x}\n" for x in (["from the bucket:"] + fetched.checked if fetched else []))

    def confirm(text: str) -> bool:
        sys.stderr.write(before + text)
        return ctx.confirm("Restore the whole cluster as planned above?", args.yes)

    opts = Options(
        spec=spec, dry_run=args.dry_run, new_token=args.new_token, new_cluster=args.new_cluster,
        confirm=None if args.yes else confirm, progress=_progress, identities=identities,
        target=target, checkpoints=not args.no_checkpoint, accept_unsigned=args.accept_unsigned_chain,
        command=as_typed(args),
        checked=fetched.chain if fetched else None,
    )
    try:
        out = restore(cfg, opts)
    finally:  # a chain check the restore did not take: its decrypted copies and lock go (again harmless)
        if fetched is not None and fetched.chain is not None:
            fetched.chain.release()
    data = {**out.to_json(), **({"bucket": fetched.to_json()} if fetched else {})}
    text = render_plan(out.plan)
    if args.dry_run:
        replayed = "" if not target else (
            " (the point-in-time tail would be written into the restored members; nothing was folded or replayed)"
            if out.plan.tail_to is not None else " (the point-in-time replay ran in a throwaway etcd on loopback)")
        return Output(data, text + (f"dry run: nothing changed{replayed}\n" if out.plan.ok
                                    else "dry run: pre-checks FAILED\n"),
                      exit_code=0 if out.plan.ok else EXIT_REFUSED)
    return Output(data, f"restored from {out.plan.backup} in {out.duration:.1f}s (op {out.plan.op})")


MAX_TYPED = 64  # of the backup and the time as typed, in the command other operators are shown


def as_typed(args: argparse.Namespace) -> str:
    """The restore as the operator typed it, its backup and its point in time only (never a key or
    identity path): what a second operator's busy refusal names (the file a point-in-time restore
    opens, ``<backup>.to-<rev>.db``, is one nobody typed)."""
    spec = args.bucket_spec or os.path.basename(args.spec)
    words = ["restore", "--from-bucket" if args.bucket_spec else "--from", _shown(spec)]
    if args.to_newest:
        words += ["--to", "newest"]
    elif args.to_revision is not None:
        words += ["--to-revision", str(args.to_revision)]
    elif args.to_time is not None:
        words += ["--to-time", _shown(args.to_time.strip())]
    return " ".join(words)


def _shown(word: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in word[:MAX_TYPED])


def with_key_file(cfg: "Config", path: str) -> "Config":
    """``cfg`` checking signatures with the manifest key in ``path`` (``--key-file``): refused
    unless it holds a key and only its owner can read it."""
    import dataclasses

    from etcd_agent.backup.keys import read_key_file

    state = read_key_file(path)
    if state.key is None:
        raise UsageError(f"--key-file {path}: " + ("; ".join(state.warnings) or "no such file"))
    if state.warnings:  # its mode: a key others can read signs nothing anyone can trust
        raise UsageError(f"--key-file {path}: {'; '.join(state.warnings)} (chmod 600 it)")
    return dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, manifest_key=path))


def _bucket_plan(cfg: "Config", args: argparse.Namespace, target: Optional["Target"]) -> "BucketPlan":
    from etcd_agent.cli.backup import require_remote
    from etcd_agent.restore.orchestrator.frombucket import plan_fetch

    require_remote(cfg)
    return plan_fetch(cfg, args.bucket_spec, target, checkpoints=not args.no_checkpoint)


def _bucket_dry_run(cfg: "Config", bp: "BucketPlan", identities: Any) -> Output:
    """What a restore from the bucket would fetch, object by object, and every host's pre-check
    (sessions, locks, tools, room for a snapshot of the full backup's size); nothing large is
    fetched, so what needs the snapshot's bytes (its members, the chain) is named, not run."""
    from etcd_agent.bucket.staging import room
    from etcd_agent.restore.orchestrator.frombucket import host_checks
    from etcd_agent.restore.orchestrator.options import Options

    hosts = host_checks(cfg, Options(spec="", dry_run=True, progress=_progress, identities=identities), bp.full.size)
    try:  # the staging here: the whole plan must fit (bucket.staging.room), as the fetch checks first
        room(cfg, bp.items, cfg.backup.dir)
        here: List[str] = []
    except RefusedError as exc:
        here = [exc.message]
    ok = not here and all(not problems for _m, _h, problems in hosts)
    lines = [f"restore from the bucket: {bp.full.name}" + (f" (chain {bp.full.chain[:16]}...)" if bp.full.chain else
                                                          " (a legacy copy at the top of the prefix)")]
    lines += [f"  {x}" for x in bp.lines(cfg.backup.dir)]
    lines += [f"room for the fetch in {cfg.backup.dir}: " + ("ok" if not here else "FAILED: " + here[0])]
    lines += [f"{m} ({h}): pre-check {'ok' if not p else 'FAILED: ' + '; '.join(p)}" for m, h, p in hosts]
    lines += [
        "after the fetch, before any master is touched (not run by a dry run: they read the fetched bytes):",
        "  each object's size and sha256 against its metadata, as it streams",
        "  the manifest's signature (with --key-file, or the manifest key on this host)",
        "  the snapshot's members from its own db against this config's names and peer URLs",
        "  for a point in time: the chain's continuity and sha256 links, its signatures",
        "  then the restore's own plan and every host's pre-checks again, as restore --from the fetched file",
        "dry run: nothing fetched (`etcd-agent backup fetch` brings it here, then `restore --from NAME --dry-run` "
        "shows the whole plan)" if ok else "dry run: pre-checks FAILED; nothing fetched",
    ]
    data = {"dry_run": True, "bucket": bp.to_json(), "room": here,
            "hosts": [{"member": m, "host": h, "problems": p} for m, h, p in hosts]}
    return Output(data, "\n".join(lines) + "\n", exit_code=0 if ok else EXIT_REFUSED)


def _target(args: argparse.Namespace) -> Optional["Target"]:
    """The point-in-time target, parsed once here (``newest``, a revision, an ISO time with its
    zone) and carried typed through the restore; None for a plain restore."""
    from etcd_agent.chain.errors import ReplayError
    from etcd_agent.pitr.replay import Target

    if args.to_newest:
        return Target.newest()
    if args.to_revision is not None:
        if args.to_revision < 1:
            raise UsageError("--to-revision must be a revision (>= 1)")
        return Target.to_revision(args.to_revision)
    if args.to_time is not None:
        if args.to_time.strip().isdigit() or args.to_time.strip() == "newest":
            raise UsageError(f"--to-time {args.to_time!r}: give an ISO time with its zone, e.g. 2026-12-01T10:03:00Z")
        try:
            return Target.parse(args.to_time)
        except ReplayError as exc:
            raise UsageError(f"--to-time: {exc.message}") from None
    return None


def cmd_cleanup(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.restore.orchestrator.commands import cleanup

    if args.keep < 0:
        raise UsageError("--keep must be >= 0")
    cfg = ctx.config()
    if not args.dry_run:
        # deleting old data dirs cannot be undone: show the list, then ask
        preview = cleanup(cfg, args.keep, True)
        doomed = [d.path for r in preview for d in r.decisions if not d.keep]
        if not doomed:
            return _cleanup_output(preview, True)
        for path in doomed:
            sys.stderr.write(f"  would remove {path}\n")
        if not ctx.confirm(f"delete these {len(doomed)} set-aside data dir(s)?", args.yes):
            raise RefusedError("cleanup not confirmed; nothing removed")
    return _cleanup_output(cleanup(cfg, args.keep, args.dry_run), args.dry_run)


def _cleanup_output(rows: List["CleanupReply"], dry_run: bool) -> Output:
    lines: List[str] = []
    for r in rows:
        if r.error:
            lines.append(f"{r.member}: ERROR {r.error}")
        for d in r.decisions:
            verb = "keep" if d.keep else ("would remove" if dry_run else "removed")
            lines.append(f"{r.member}: {verb:<12} {d.path}  ({d.reason})")
        if not r.decisions and not r.error:
            lines.append(f"{r.member}: no set-aside data dirs")
    return Output({"members": [r.to_json() for r in rows], "dry_run": dry_run}, "\n".join(lines),
                  exit_code=1 if any(r.error for r in rows) else 0)


def cmd_rollback(args: argparse.Namespace, ctx: Context) -> Output:
    from etcd_agent.restore.orchestrator.commands import rollback_open

    res = rollback_open(ctx.config(), _progress, dry_run=args.dry_run,
                        confirm=None if args.yes else (lambda q: ctx.confirm(q, False)))
    return Output(res, res.get("note") or "rolled back: " + ", ".join(res.get("rolled_back", {})))
