"""Pure restore logic: the plan per host, conf rewriting, the cleanup of set-aside data dirs.

No I/O here. ``node precheck`` on each host reports ``NodeFacts``, which ``precheck``'s rules turn
into a list of problems (empty: go); from the same facts, the config and the archive's manifest
this module builds the plan the operator sees (every step, the exact ``snapshot restore`` argv).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from etcd_agent.config import Config, Member, merged
from etcd_agent.etcd.lineage import LINEAGE_KEY
from etcd_agent.etcd.tools import snapshot_restore_argv
from etcd_agent.etcd.versions import BUMP_MIN_ETCDUTL, can_bump
from etcd_agent.restore.host.facts import NodeFacts, work_dir_for
from etcd_agent.topology import initial_cluster, member_pairs

# What the Kubernetes docs use: far above any revision an apiserver watch cache has seen.
BUMP_REVISION = 1_000_000_000


# ---------------------------------------------------------------- conf rewriting


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Step:
    name: str
    text: str
    argv: Optional[Tuple[str, ...]] = None


@dataclass
class HostPlan:
    member: str
    host: str  # "local" or the ssh address
    steps: List[Step] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)


@dataclass
class Plan:
    op: str
    backup: str
    token: str
    initial_cluster: str
    revision: Optional[int]
    bump: bool
    bump_note: str
    new_cluster: bool
    resuming: bool
    kind: str = "agent"  # agent | runbook
    evidence: List[str] = field(default_factory=list)  # what was proven of the backup, and how
    kubernetes: List[str] = field(default_factory=list)  # what the Kubernetes cleanup will delete
    hosts: List[HostPlan] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)  # cluster-wide
    tail_to: Optional[int] = None  # a point-in-time tail loaded into the restored members: to this revision

    @property
    def ok(self) -> bool:
        return not self.problems and not any(h.problems for h in self.hosts)

    def to_json(self) -> Dict[str, Any]:
        return {
            "op": self.op,
            "backup": self.backup,
            "token": self.token,
            "initial_cluster": self.initial_cluster,
            "revision": self.revision,
            "bump_revision": self.bump,
            "bump_note": self.bump_note,
            "new_cluster": self.new_cluster,
            "resuming": self.resuming,
            "tail_to": self.tail_to,
            "kind": self.kind,
            "evidence": self.evidence,
            "kubernetes": self.kubernetes,
            "ok": self.ok,
            "problems": self.problems,
            "hosts": [
                {
                    "member": h.member,
                    "host": h.host,
                    "problems": h.problems,
                    "steps": [{"step": s.name, "text": s.text, "argv": list(s.argv) if s.argv else None} for s in h.steps],
                }
                for h in self.hosts
            ],
        }


@dataclass(frozen=True)
class SourceFacts:
    """What the plan needs of the backup being restored (``restore.source.Source``)."""

    kind: str
    revision: Optional[int]
    size: int
    sha256: Optional[str]
    lines: Tuple[str, ...]  # checked / proven / not proven, one line each
    # a point-in-time restore's tail loaded into the restored members: to which revision ("": none)
    tail_to: Optional[int] = None


def fence_owners(cfg: Config, host_of: Mapping[str, str]) -> Dict[str, bool]:
    """One member per host fences the apiserver (a host may run several members: the demo)."""
    seen: Dict[str, str] = {}
    out: Dict[str, bool] = {}
    for m in cfg.members:
        h = host_of[m.name]
        out[m.name] = h not in seen
        seen.setdefault(h, m.name)
    return out


def bump_decision(cfg: Config, facts: Mapping[str, NodeFacts]) -> Tuple[bool, str]:
    """Whether the restore bumps the revision, and what the plan says about it: apiserver watch
    caches must never see the revision go back.

    What the hosts restore with decides, not this config alone: after a rolling upgrade a host
    runs its pinned release's etcdutl though agent.toml still names the old tools. All or none:
    members restored with and without the bump would disagree on the revision."""
    tool_versions = [f.etcdutl_version for f in facts.values()]
    bump = bool(tool_versions) and all(can_bump(v) for v in tool_versions)
    need = ".".join(str(x) for x in BUMP_MIN_ETCDUTL)
    if bump:
        return True, (f"etcdutl {need}+: revision bumped by {BUMP_REVISION} and marked compacted "
                      "(apiserver watch caches stay valid)")
    old = sorted({str(v) for v in tool_versions if v and not can_bump(v)})
    without = sorted(m for m, f in facts.items() if f.etcdutl_version is None)
    if old:
        why = f"etcdutl {', '.join(old)} has no --bump-revision/--mark-compacted (added in {need})"
    elif cfg.etcd.etcdutl:
        why = f"etcdutl not runnable on {', '.join(without) or 'any host'}"
    elif facts and len(without) < len(cfg.members):
        why = f"{', '.join(without)} restore with etcdctl (etcd 3.4), which has no --bump-revision/--mark-compacted"
    else:
        why = "restoring with etcdctl (etcd 3.4) has no --bump-revision/--mark-compacted"
    if cfg.kubernetes.fence == "none":
        return False, (f"revision NOT bumped: {why}; restart every kube-apiserver after the restore so their watch "
                       "caches start over (no fencing is configured, so the restore cannot do it)")
    return False, (f"revision NOT bumped: {why}; the apiservers are restarted by the unfence step, so their "
                   "watch caches start over")


def _fence_text(cfg: Config, owner: bool) -> str:
    k = cfg.kubernetes
    if k.fence == "none":
        return "no apiserver fencing"
    if not owner:
        return "apiserver fenced by this host's first member"
    if k.fence == "unit":
        return f"stop {k.apiserver_unit} (started again at the end if it was running)"
    return f"move {k.manifest} into {k.manifest_aside_dir} (moved back at the end)"


def _unfence_text(cfg: Config, m: Member) -> str:
    k = cfg.kubernetes
    ready = (f", then wait until {k.readyz_url.replace('{host}', m.host)} answers (the next host only after)"
             if k.readyz_url else "")
    return ("start the apiserver again" if k.fence == "unit" else f"move {k.manifest} back") + ready


def _repair_text(cfg: Config, m: Member, f: Optional[NodeFacts]) -> str:
    text = f"{cfg.conf_file(m.name)}: "
    if f is not None and not f.conf_present:
        text += "missing: rendered from the agent's config for this member (an archive's etcd.conf is never applied)"
    else:
        text += "identity and cluster keys (ETCD_NAME, *_URLS, INITIAL_CLUSTER*) set to the restored cluster's"
    if cfg.etcd.service_manager == "systemd":
        unit = "missing: rendered from the agent's template" if f is not None and f.unit_present is False else "kept"
        text += f"; {cfg.etcd.unit_file} {unit}"
    return text


def _host_plan(cfg: Config, m: Member, f: Optional[NodeFacts], *, where: str, owner: bool, ic: str, token: str,
               bump: bool, source: "SourceFacts") -> HostPlan:
    data_dir = cfg.data_dir(m.name)
    wd = f.work_dir if f else work_dir_for(data_dir, m.name)
    snap = f"{wd}/etcd_snapshot.db"
    tmp = f"{data_dir.rstrip('/')}.restoring"
    host_cfg = cfg  # the argv as that host will run it: with its own (version-pinned) tools
    if f is not None and (f.etcdctl_path or f.etcdutl_path):
        host_cfg = merged(cfg, etcd={"etcdctl": f.etcdctl_path or cfg.etcd.etcdctl, "etcdutl": f.etcdutl_path})
    argv = snapshot_restore_argv(host_cfg, snapshot=snap, name=m.name, initial_cluster=ic, token=token, peer_url=m.peer_url,
                                 data_dir=tmp, bump_revision=BUMP_REVISION if bump else None, skip_hash_check=True)
    spec = f"{cfg.etcd.user}:{cfg.etcd.group}"
    if not source.sha256:
        claim = "the sha256 the sender computes"
    elif source.tail_to is not None:
        claim = f"the sha256 {source.sha256[:16]}... its delta chain vouches for"
    elif source.kind == "runbook":  # no manifest: the hash is the reader's, of the tarball's own bytes
        claim = f"the sha256 {source.sha256[:16]}... read from the tarball"
    else:
        claim = f"the manifest's sha256 {source.sha256[:16]}..."
    tls = [x for x in (cfg.tls.peer_cert, cfg.tls.peer_key, cfg.tls.peer_ca, cfg.tls.client_cert, cfg.tls.client_key,
                       cfg.tls.client_ca) if x]
    steps = [
        Step("lock", f"take the operation lock {cfg.backup.dir}/.etcd-agent.lock (held until the end)"),
        Step("begin", f"journal in {wd}/journal.json (0700 dir)"),
        Step("receive", (f"copy the snapshot ({source.size} bytes) from the file on this master to {snap} (0600) "
                         "while the others are shipped to and etcd still serves; hashed as it is copied"
                         if where == "local" else
                         f"ship the snapshot ({source.size} bytes) to {snap} (0600) while etcd still serves; "
                         "hashed as it is read and as it lands")
             + f", checked against {claim} and etcd's own trailer"),
        Step("restore", f"snapshot restore into {tmp} while etcd still serves (its data dir untouched); etcd's "
                        "trailer was checked as the snapshot landed, so it is not read back to be hashed again",
             tuple(argv)),
        Step("fence", _fence_text(cfg, owner)),
        Step("stop", f"stop etcd ({cfg.etcd.service_manager} backend"
                     f"{', ' + cfg.etcd.unit if cfg.etcd.service_manager == 'systemd' else ''}); followers first, "
                     "each waited for until it has closed its db, then the leader; every exit is waited for "
                     "before its data dir is touched"),
        Step("aside", f"move {data_dir} to {data_dir.rstrip('/')}.pre-restore-<UTC time> (kept, never deleted)"),
        Step("install", f"rename {tmp} to {data_dir}"),
        Step("chown", f"chown -R {spec} {data_dir}" if cfg.etcd.service_manager == "systemd" else
             f"chown -R {spec} {data_dir} when the agent runs as root and {cfg.etcd.user} exists (etcd runs as it)",
             ("chown", "-R", spec, data_dir) if cfg.etcd.service_manager == "systemd" else None),
        Step("repair", _repair_text(cfg, m, f)),
        Step("start", "start etcd (all members at once)" + (f"; TLS files {', '.join(tls)}" if tls else "")),
        Step("wait", f"wait until every member is healthy at the same revision (>= {source.revision}); "
                     f"record the snapshot's member ids as this cluster's lineage ({LINEAGE_KEY})"),
    ]
    if source.tail_to is not None:
        steps.insert(len(steps) - 1, Step(
            "load", f"write the delta chain after revision {source.revision} up to revision {source.tail_to} into the "
                    "restored cluster (once, through its leader; the apiservers still fenced): leases, deletes, puts, "
                    "the lease rule, then a compaction at the final revision"))
    if owner and cfg.kubernetes.fence != "none":
        steps.append(Step("unfence", _unfence_text(cfg, m)))
    steps.append(Step("finish", f"journal marked done (kept in {wd} until the next restore); the shipped snapshot "
                                "deleted; release the lock"))
    return HostPlan(m.name, where, steps)


def build_plan(
    cfg: Config,
    *,
    op: str,
    backup: str,
    source: "SourceFacts",
    token: str,
    host_of: Mapping[str, str],
    facts: Mapping[str, NodeFacts],
    new_cluster: bool,
    resuming: bool,
) -> Plan:
    """The whole restore, per host, with every argument; problems filled in by the caller."""
    from etcd_agent.cluster.kubernetes import master_addresses, rule_text

    ic = initial_cluster(member_pairs(cfg.members))
    bump, note = bump_decision(cfg, facts)
    masters, _unknown = master_addresses(cfg, resolve=False)
    plan = Plan(op, backup, token, ic, source.revision, bump, note, new_cluster, resuming, kind=source.kind,
                evidence=list(source.lines),
                kubernetes=[f"after etcd is healthy, before the apiservers start: {rule_text(cfg, masters)}"],
                tail_to=source.tail_to)
    owners = fence_owners(cfg, host_of)
    for m in cfg.members:
        plan.hosts.append(_host_plan(cfg, m, facts.get(m.name), where=host_of[m.name], owner=owners[m.name], ic=ic,
                                     token=token, bump=bump, source=source))
    return plan


def render_plan(plan: Plan) -> str:
    """The plan as the operator reads it (``--dry-run`` and before the confirmation)."""
    lines = [
        f"restore {plan.op}{' (resuming)' if plan.resuming else ''} from {plan.backup}"
        f"{' into a NEW cluster' if plan.new_cluster else ''}",
        f"  {'a runbook tarball (made by hand, no manifest)' if plan.kind == 'runbook' else 'an etcd-agent backup'}; "
        f"snapshot revision {plan.revision}; token {plan.token}",
        f"  initial cluster {plan.initial_cluster}",
        f"  {plan.bump_note}",
    ]
    lines += [f"  {e}" for e in plan.evidence]
    lines += [f"  kubernetes: {k}" for k in plan.kubernetes]
    for p in plan.problems:
        lines.append(f"  REFUSED: {p}")
    for h in plan.hosts:
        lines.append(f"member {h.member} on {h.host}:")
        for p in h.problems:
            lines.append(f"  REFUSED: {p}")
        for i, s in enumerate(h.steps, 1):
            lines.append(f"  {i:2}. {s.name:<8} {s.text}")
            if s.argv:
                lines.append("      $ " + " ".join(s.argv))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- cleanup


