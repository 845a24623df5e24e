"""The cluster-wide restore: every member's host driven through ``Host`` by ``etcd-agent node``.

Phases (each runs on all members in parallel; the next starts when all succeeded):
verify + extract the archive here -> pre-checks everywhere (nothing touched; exit 3 with a
per-host report) -> lock every host (exit 4 if busy) -> begin -> fence -> stop -> aside, ship,
restore, chown, repair -> start -> wait until every member is healthy at one revision ->
unfence -> finish -> unlock. Any failure after the locks rolls *every* member back (old data dir
back, etcd restarted where it ran, apiserver unfenced) and fails with exit 1. Killed midway, the
same command resumes from the journals on the hosts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..backup import archive
from ..backup.catalog import resolve_from
from ..backup.verify import member_problem, verify
from ..cluster.health import wait_converged
from ..cluster.lineage import current_cluster, record_lineage
from ..config import DEFAULT_PATH, Config, Member
from ..errors import (
    AgentError,
    BusyError,
    CommandError,
    OperationFailed,
    RefusedError,
    UsageError,
)
from ..fs import ensure_private_dir
from ..hosts.base import Host
from . import plan as P
from .node import SNAPSHOT, TAR_CONF, TAR_UNIT

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclass
class Options:
    spec: str
    dry_run: bool = False
    new_token: Optional[str] = None
    new_cluster: bool = False
    confirm: Optional[Callable[[str], bool]] = None  # shown the plan; False = abort
    progress: Progress = lambda s: None
    # test hook: called as (member, step) before each step; may raise to inject a failure
    before_step: Optional[Callable[[str, str], None]] = None
    health_timeout: Optional[float] = None


@dataclass
class Outcome:
    plan: P.Plan
    done: bool = False
    duration: float = 0.0
    timings: Dict[str, float] = field(default_factory=dict)
    revisions: Dict[str, int] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        return {
            "plan": self.plan.to_json(),
            "done": self.done,
            "duration": round(self.duration, 3),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "revisions": self.revisions,
        }


# ---------------------------------------------------------------- talking to nodes


class Node:
    """One member's host, spoken to only through ``etcd-agent node STEP --json``."""

    def __init__(self, cfg: Config, member: Member, host: Host, local: bool) -> None:
        self.cfg = cfg
        self.member = member
        self.host = host
        self.local = local
        self.where = "local" if local else member.ssh_host
        agent = cfg.ssh.agent_path
        if local and not os.path.exists(agent):
            # rehearsal on a laptop: the agent running this restore, from its own venv
            prefix = [sys.executable, "-m", "etcd_agent.cli.main"]
        else:
            prefix = [agent]
        self.prefix = prefix + ["-c", cfg.path or DEFAULT_PATH, "--json", "node"]

    def call(self, step: str, *args: str, member: bool = True, timeout: Optional[float] = None) -> Dict[str, Any]:
        argv = self.prefix + [step] + (["--member", self.member.name] if member else []) + list(args)
        res = self.host.run(argv, timeout=timeout or self.cfg.ssh.command_timeout, check=False)
        try:
            data = json.loads(res.stdout) if res.stdout.strip() else None
        except ValueError:
            data = None
        if res.returncode == 0 and isinstance(data, dict):
            return data
        msg = data.get("message") if isinstance(data, dict) else None
        if msg is None:
            tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-2:]
            if res.returncode in (126, 127):
                raise CommandError(f"{self.where}: etcd-agent not runnable as {self.prefix[0]} (exit {res.returncode}): {' / '.join(tail)}", res)
            msg = f"crashed (exit {res.returncode}): {' / '.join(tail)}"
        if res.returncode == 4:
            raise BusyError(f"{self.where}: {msg}")
        if res.returncode == 3:
            raise RefusedError(f"{self.where}: {msg}")
        raise OperationFailed(f"{self.member.name} ({self.where}): node {step}: {msg}")


def _is_local(m: Member, cfg: Config, me: Any) -> bool:
    if cfg.local.name is not None:
        return m.name == cfg.local.name or m.host == cfg.member(cfg.local.name).host
    return m.host in me.addresses or m.host in me.names or m.name in me.names


def open_nodes(cfg: Config) -> List[Node]:
    from ..hosts.local import LocalHost
    from ..locality import machine_identity

    # with [local] name set, never resolve our own name: with DNS down (an outage) getfqdn stalls
    me = machine_identity() if cfg.local.name is None else None
    nodes = []
    for m in cfg.members:
        if _is_local(m, cfg, me):
            nodes.append(Node(cfg, m, LocalHost(m.name), True))
        else:
            from ..hosts.ssh import SshHost

            nodes.append(Node(cfg, m, SshHost(m.name, m.ssh_host, cfg.ssh), False))
    return nodes


def parallel(fn: Callable[[Any], Any], items: Sequence[Any]) -> List[Tuple[Any, Any, Optional[BaseException]]]:
    """(item, result, error) for ``fn`` over ``items``, all at once."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=len(items)) as ex:
        futs = [(it, ex.submit(fn, it)) for it in items]
        out: List[Tuple[Any, Any, Optional[BaseException]]] = []
        for it, f in futs:
            try:
                out.append((it, f.result(), None))
            except BaseException as exc:  # collected, reported per host
                out.append((it, None, exc))
        return out


def _msg(exc: BaseException) -> str:
    return exc.message if isinstance(exc, AgentError) else f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- the archive, here


def extract(path: str, dest: str, manifest: Dict[str, Any]) -> Dict[str, str]:
    """Extract our three files into ``dest`` (0700); every member is checked before a byte is
    written, only known names are written, with O_EXCL|O_NOFOLLOW: nothing lands outside."""
    out: Dict[str, str] = {}
    seen: Dict[str, int] = {}
    tar = archive.open_tar(path, seekable=False)
    try:
        while True:
            ti = tar.next()
            if ti is None:
                break
            problem = member_problem(ti, seen)
            if problem:
                raise RefusedError(f"{path}: refused: {problem}; nothing restored")
            seen[ti.name] = ti.offset
            if ti.name == archive.MANIFEST:
                continue
            target = os.path.join(dest, ti.name)
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
            out[ti.name] = target
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise RefusedError(f"{path}: unreadable archive ({exc}); nothing restored") from None
    finally:
        tar.close()
    if archive.SNAPSHOT not in out:
        raise RefusedError(f"{path}: no {archive.SNAPSHOT} in the archive")
    return out


# ---------------------------------------------------------------- restore


class Restore:
    def __init__(self, cfg: Config, opts: Options) -> None:
        self.cfg = cfg
        self.opts = opts
        self.nodes: List[Node] = []
        self.say = opts.progress

    def _hook(self, member: str, step: str) -> None:
        if self.opts.before_step is not None:
            self.opts.before_step(member, step)

    def run(self) -> Outcome:
        t0 = time.monotonic()
        cfg = self.cfg
        entry = resolve_from(cfg, self.opts.spec)
        ensure_private_dir(cfg.backup.dir)
        staging = tempfile.mkdtemp(prefix=".etcd-agent-restore-", dir=cfg.backup.dir)
        try:
            self.nodes = open_nodes(cfg)
            return self._run(entry, staging, t0)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            for n in self.nodes:
                n.host.close()

    def _run(self, entry: Any, staging: str, t0: float) -> Outcome:
        from ..etcd.tools import snapshot_status
        from ..hosts.local import LocalHost

        cfg, say = self.cfg, self.say
        timings: Dict[str, float] = {}
        say(f"verifying {entry.path}")
        rep = verify(entry.path, status_fn=lambda p: snapshot_status(LocalHost(), cfg, p), tmp_parent=staging)
        if not rep.ok:
            raise RefusedError(f"backup {entry.path} fails verification; nothing touched", details=rep.problems)
        manifest = rep.manifest or {}
        files = extract(entry.path, staging, manifest)
        sha = manifest["files"][archive.SNAPSHOT]["sha256"]
        size = int(manifest["files"][archive.SNAPSHOT]["size"])
        timings["verify"] = time.monotonic() - t0

        t = time.monotonic()
        facts: Dict[str, P.NodeFacts] = {}
        host_problems: Dict[str, List[str]] = {}
        for node, data, err in parallel(lambda n: n.call("precheck"), self.nodes):
            if err is not None:
                host_problems[node.member.name] = [f"unreachable or agent unusable: {_msg(err)}"]
            else:
                facts[node.member.name] = P.NodeFacts.from_json(data)
        timings["precheck"] = time.monotonic() - t
        resume, rproblems = P.resume_decision({m: f.journal for m, f in facts.items()}, sha)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        if resume is not None:
            op, token = str(resume["op"]), str(resume["token"])
            new_cluster = bool(resume.get("new_cluster")) or self.opts.new_cluster
            if self.opts.new_token and self.opts.new_token != token:
                rproblems.append(f"resuming restore {op} with token {token}; --new-token {self.opts.new_token} cannot change it midway")
        else:
            op = f"{stamp}-{sha[:8]}"
            token = self.opts.new_token or P.default_token(cfg.cluster.name, stamp)
            new_cluster = self.opts.new_cluster
        bad_token = P.token_problem(token)
        if bad_token:
            raise UsageError(bad_token)
        host_of = {n.member.name: n.where for n in self.nodes}
        plan = P.build_plan(
            cfg, op=op, backup=entry.path, manifest=manifest, token=token, host_of=host_of, facts=facts,
            new_cluster=new_cluster, resuming=resume is not None,
        )
        plan.problems += rproblems
        if resume is None:
            cid, lineage = current_cluster(cfg)
            plan.problems += P.check_manifest(cfg, manifest, cid, new_cluster, lineage)
        from .. import __version__

        for hp in plan.hosts:
            m = cfg.member(hp.member)
            hp.problems += host_problems.get(hp.member, [])
            if hp.member in facts:
                hp.problems += P.check_host(
                    cfg, m, facts[hp.member], snapshot_size=size, snapshot_version=manifest.get("etcd_version"),
                    agent_version=__version__, resuming=resume is not None,
                )
        outcome = Outcome(plan, timings=timings)
        for hp in plan.hosts:
            say(f"{hp.member} ({hp.host}): pre-check {'ok' if not hp.problems else 'FAILED: ' + '; '.join(hp.problems)}")
        if self.opts.dry_run:
            outcome.duration = time.monotonic() - t0
            return outcome
        if not plan.ok:
            details = plan.problems + [f"{h.member} ({h.host}): {p}" for h in plan.hosts for p in h.problems]
            raise RefusedError("restore refused by pre-checks; nothing touched", details=details)
        if self.opts.confirm is not None and not self.opts.confirm(P.render_plan(plan)):
            raise RefusedError("restore not confirmed; nothing touched")
        self._locks(op)
        try:
            self._execute(plan, files, facts, outcome, manifest)
        finally:
            self._unlock(op)
        outcome.done = True
        outcome.duration = time.monotonic() - t0
        say(f"restore {op} done in {outcome.duration:.1f}s: every member healthy at revision {sorted(set(outcome.revisions.values()))}")
        return outcome

    # ------------------------------------------------------------ locks

    def _groups(self) -> List[Node]:
        """One node per host: the lock and the fencing are per host, not per member."""
        seen, out = set(), []
        for n in self.nodes:
            if n.where not in seen:
                seen.add(n.where)
                out.append(n)
        return out

    def _locks(self, op: str) -> None:
        results = parallel(lambda n: n.call("lock", "--op", op, member=False), self._groups())
        errors = [(n, e) for n, _r, e in results if e is not None]
        if errors:
            for n, _r, e in results:
                if e is None:
                    self._try(lambda: n.call("unlock", "--op", op, member=False))
            busy = [e for _n, e in errors if isinstance(e, BusyError)]
            details = [f"{n.where}: {_msg(e)}" for n, e in errors]
            if busy:
                raise BusyError("another etcd-agent operation is running; restore not started, nothing touched", details=details)
            raise RefusedError("could not take the operation lock everywhere; nothing touched", details=details)
        self.say("operation lock taken on " + ", ".join(n.where for n in self._groups()))

    def _unlock(self, op: str) -> None:
        for n, _r, e in parallel(lambda n: n.call("unlock", "--op", op, member=False), self._groups()):
            if e is not None:
                log.warning("%s: releasing the lock failed: %s", n.where, _msg(e))

    @staticmethod
    def _try(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:
            log.warning("%s", exc)

    # ------------------------------------------------------------ the steps

    def _phase(self, name: str, fn: Callable[[Node], Any], nodes: Optional[List[Node]] = None) -> None:
        t = time.monotonic()
        failed = []
        for n, _res, err in parallel(fn, nodes if nodes is not None else self.nodes):
            if err is not None:
                failed.append(f"{n.member.name} ({n.where}): {_msg(err)}")
        self.timings[name] = time.monotonic() - t
        if failed:
            raise OperationFailed(f"restore failed at {name}", details=failed)

    def _step(self, n: Node, step: str, *args: str, then: Sequence[str] = ()) -> Dict[str, Any]:
        """One node call running ``step`` (and ``then`` in the same process: fewer round trips)."""
        for s in [step, *then]:
            self._hook(n.member.name, s)
        res = n.call(step, "--op", self.op, *args, *[x for t in then for x in ("--then", t)])
        for r in res.get("steps", [res]):
            extra = r.get("skipped") or r.get("moved") or r.get("conf") or ""
            self.say(f"{n.member.name} ({n.where}): {r.get('step', step)} ok" + (f" - {extra}" if extra else ""))
        return res

    def _execute(self, plan: P.Plan, files: Dict[str, str], facts: Dict[str, P.NodeFacts], outcome: Outcome, manifest: Dict[str, Any]) -> None:
        self.op = plan.op
        self.timings = outcome.timings
        owners = P.fence_owners(self.cfg, {n.member.name: n.where for n in self.nodes})
        snap = files[archive.SNAPSHOT]
        sha = manifest["files"][archive.SNAPSHOT]["sha256"]
        size = str(manifest["files"][archive.SNAPSHOT]["size"])

        def begin(n: Node) -> Any:
            args = ["--token", plan.token, "--initial-cluster", plan.initial_cluster, "--sha256", sha,
                    "--size", size, "--backup", plan.backup]
            if plan.bump:
                args += ["--bump", str(P.BUMP_REVISION)]
            if owners[n.member.name]:
                args.append("--fence-owner")
            if plan.new_cluster:
                args.append("--new-cluster")
            return self._step(n, "begin", *args)

        def ship(n: Node) -> None:
            """Files into the work dir before anything stops: shipping is not downtime."""
            journal = (facts[n.member.name].journal if n.member.name in facts else None) or {}
            shipped = journal.get("op") == plan.op and "receive" in (journal.get("steps") or [])
            if not shipped:
                self._hook(n.member.name, "ship")
                wd = facts[n.member.name].work_dir
                t = time.monotonic()
                n.host.put(snap, f"{wd}/{SNAPSHOT}", mode=0o600)
                for arc, name in ((archive.CONF, TAR_CONF), (archive.UNIT, TAR_UNIT)):
                    if arc in files:
                        n.host.put(files[arc], f"{wd}/{name}", mode=0o600)
                self.say(f"{n.member.name} ({n.where}): shipped {size} bytes in {time.monotonic() - t:.2f}s")

        began: List[Node] = []
        try:
            self._phase("begin", begin)
            began = list(self.nodes)
            self._phase("ship", ship)
            # fence and stop in one call per member: an apiserver still up elsewhere only writes to
            # the old data, which is set aside anyway
            self._phase("fence+stop", lambda n: self._step(n, "fence", then=("stop",)))
            self._phase("prepare", lambda n: self._step(n, "aside", then=("receive", "restore", "chown", "repair")))
            self._phase("start", lambda n: self._step(n, "start"))
            t = time.monotonic()
            outcome.revisions = wait_converged(
                self.cfg, self.opts.health_timeout or max(60.0, self.cfg.etcd.start_timeout * 2), self.say
            )
            record_lineage(self.cfg, str((manifest.get("cluster") or {}).get("id") or "") or None)
            outcome.revisions = wait_converged(self.cfg, 30.0, self.say)
            outcome.timings["wait"] = time.monotonic() - t
            self._phase("unfence", lambda n: self._step(n, "unfence"))
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                self.say("interrupted: rolling every member back")
            details = exc.details if isinstance(exc, AgentError) else [_msg(exc)]
            rolled = self._rollback(began or self._begun())
            raise OperationFailed(
                f"restore {self.op} failed ({_msg(exc)}); " + ("every member rolled back" if rolled[0] else "ROLLBACK INCOMPLETE"),
                details=list(details) + rolled[1],
            ) from exc
        self._phase("finish", lambda n: self._step(n, "finish"))

    def _begun(self) -> List[Node]:
        return list(self.nodes)

    def _rollback(self, nodes: List[Node]) -> Tuple[bool, List[str]]:
        """Roll every member back; (all succeeded, report lines)."""
        self.say("rolling back every member")
        lines, ok = [], True
        for n, res, err in parallel(lambda n: n.call("rollback", "--op", self.op), nodes):
            if err is not None:
                if isinstance(err, RefusedError) and "no journal" in err.message:
                    continue  # this member never began
                ok = False
                lines.append(f"rollback of {n.member.name} ({n.where}) failed: {_msg(err)}")
            else:
                lines.append(f"{n.member.name} ({n.where}) rolled back: {'; '.join(res.get('did', [])) or res.get('skipped', '')}")
            if lines:
                self.say(lines[-1])
        return ok, lines


def restore(cfg: Config, opts: Options) -> Outcome:
    return Restore(cfg, opts).run()


# ---------------------------------------------------------------- rollback and cleanup commands


def rollback_open(
    cfg: Config,
    progress: Progress = lambda s: None,
    *,
    dry_run: bool = False,
    confirm: Optional[Callable[[str], bool]] = None,
) -> Dict[str, Any]:
    """``restore rollback``: roll back whatever unfinished restore the hosts have journaled.
    ``dry_run`` only reports the open journals; ``confirm(text)`` False refuses (nothing done)."""
    nodes = open_nodes(cfg)
    try:
        out: Dict[str, Any] = {}
        ops = set()
        for n, data, err in parallel(lambda n: n.call("precheck"), nodes):
            if err is not None:
                raise RefusedError(f"{n.member.name} ({n.where}) unreachable: {_msg(err)}; nothing rolled back")
            j = data.get("journal")
            if j and j.get("state") not in P.FINAL_STATES:
                ops.add((n.member.name, j["op"]))
        if not ops:
            return {"rolled_back": [], "note": "no unfinished restore is journaled"}
        what = ", ".join(f"{m} (op {op})" for m, op in sorted(ops))
        if dry_run:
            return {"would_roll_back": {m: op for m, op in sorted(ops)},
                    "note": f"would roll back the unfinished restore of {what}: restored data moved to "
                            "<data dir>.failed-restore-<time>, the set-aside data dir put back, etcd restarted, "
                            "the apiserver unfenced"}
        if confirm is not None and not confirm(f"roll back the unfinished restore of {what}?"):
            raise RefusedError("rollback not confirmed; nothing changed")
        r = Restore(cfg, Options(spec="", progress=progress))
        r.nodes = nodes
        by_member = dict(ops)
        for op in sorted(set(by_member.values())):
            r.op = op
            groups = r._groups()
            for n, _res, err in parallel(lambda n: n.call("lock", "--op", op, member=False), groups):
                if err is not None:
                    raise err
            try:
                ok, lines = r._rollback([n for n in nodes if by_member.get(n.member.name) == op])
            finally:
                r._unlock(op)
            out[op] = {"ok": ok, "report": lines}
            if not ok:
                raise OperationFailed(f"rollback of restore {op} incomplete", details=lines)
        return {"rolled_back": out}
    finally:
        for n in nodes:
            n.host.close()


def cleanup(cfg: Config, keep: int, dry_run: bool) -> List[Dict[str, Any]]:
    """``restore cleanup``: every member's set-aside data dirs, the newest ``keep`` kept."""
    nodes = open_nodes(cfg)
    try:
        args = ["--keep", str(keep)] + (["--dry-run"] if dry_run else [])
        out = []
        for n, data, err in parallel(lambda n: n.call("cleanup", *args), nodes):
            if err is not None:
                out.append({"member": n.member.name, "error": _msg(err), "decisions": [], "removed": []})
            else:
                out.append(data)
        return out
    finally:
        for n in nodes:
            n.host.close()
