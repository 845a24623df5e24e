"""Pure restore logic: the plan per host, the pre-check rules, journal resume, conf rewriting.

No I/O here. ``node precheck`` on each host reports ``NodeFacts``; the rules below turn facts,
the config and the archive's manifest into a list of problems (empty: go) and into the plan the
operator sees (every step, the exact ``snapshot restore`` argv).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..cluster.lineage import LINEAGE_KEY
from ..config import NAME_RE, Config, Member, merged
from ..etcd.tools import snapshot_restore_argv
from ..node.protocol import PROTOCOL
from ..topology import Bootstrap, conf_vars, initial_cluster, member_pairs
from .journal import JournalSummary

# Bumped when the JSON of `etcd-agent node ...` changes incompatibly; both ends must agree.
NODE_PROTOCOL = PROTOCOL
# What the Kubernetes docs use: far above any revision an apiserver watch cache has seen.
BUMP_REVISION = 1_000_000_000
# ETCD_* keys that carry a member's identity or the cluster it believes in: rewritten on repair.
REWRITE_KEYS = (
    "ETCD_NAME",
    "ETCD_DATA_DIR",
    "ETCD_LISTEN_PEER_URLS",
    "ETCD_LISTEN_CLIENT_URLS",
    "ETCD_INITIAL_ADVERTISE_PEER_URLS",
    "ETCD_ADVERTISE_CLIENT_URLS",
    "ETCD_INITIAL_CLUSTER",
    "ETCD_INITIAL_CLUSTER_STATE",
    "ETCD_INITIAL_CLUSTER_TOKEN",
)
ASIDE_TAGS = ("pre-restore", "failed-restore")
ASIDE_RE = re.compile(r"^(?P<base>.+)\.(?P<tag>pre-restore|failed-restore)-(?P<stamp>\d{8}T\d{6}Z)(?:\.(?P<n>\d+))?$")


# ---------------------------------------------------------------- facts from `node precheck`


@dataclass(frozen=True)
class NodeFacts:
    """What one host reported about itself for one member (``node precheck``)."""

    member: str
    protocol: int
    agent_version: str
    etcd_version: Optional[str]
    etcdctl_version: Optional[str]
    etcdutl_version: Optional[str]
    free_bytes: int
    data_dir: str
    data_dir_state: str  # absent | empty | member | other
    work_dir: str
    conf_file: str
    conf_present: bool
    unit_present: Optional[bool]  # None: the process backend has no unit
    backend: str
    running: bool
    fence_ok: bool
    fence_detail: str
    identity_match: bool
    tls_missing: Tuple[str, ...] = ()
    journal: Optional[JournalSummary] = None
    peer_url: str = ""
    client_url: str = ""
    # evidence of which cluster this host runs: its bootstrap record and its restore lineage
    bootstrap_member_id: Optional[str] = None
    bootstrap_cluster_id: Optional[str] = None
    lineage: Tuple[Tuple[str, ...], ...] = ()
    db_member_ids: Tuple[str, ...] = ()  # the members in the data dir's own db (read with etcd down)
    db_note: str = ""  # why the data dir's db could not be read, if it could not
    # the tools the host restores with: its agent.toml's, or its version pin's after a rolling
    # upgrade (None from agents that do not say: the plan assumes this config's)
    etcdctl_path: Optional[str] = None
    etcdutl_path: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["journal"] = self.journal.to_json() if self.journal else None
        d["tls_missing"] = list(self.tls_missing)
        d["lineage"] = [list(x) for x in self.lineage]
        d["db_member_ids"] = list(self.db_member_ids)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "NodeFacts":
        def opt(key: str) -> Optional[str]:
            v = d.get(key)
            return v if isinstance(v, str) else None

        journal = d.get("journal")
        lin = d.get("lineage") or []
        return cls(
            member=str(d["member"]),
            protocol=int(d["protocol"]),
            agent_version=str(d.get("agent_version", "?")),
            etcd_version=opt("etcd_version"),
            etcdctl_version=opt("etcdctl_version"),
            etcdutl_version=opt("etcdutl_version"),
            free_bytes=int(d.get("free_bytes", 0)),
            data_dir=str(d["data_dir"]),
            data_dir_state=str(d.get("data_dir_state", "absent")),
            work_dir=str(d["work_dir"]),
            conf_file=str(d.get("conf_file", "")),
            conf_present=bool(d.get("conf_present")),
            unit_present=d.get("unit_present") if isinstance(d.get("unit_present"), bool) else None,
            backend=str(d.get("backend", "?")),
            running=bool(d.get("running")),
            fence_ok=bool(d.get("fence_ok")),
            fence_detail=str(d.get("fence_detail", "")),
            identity_match=bool(d.get("identity_match")),
            tls_missing=tuple(str(x) for x in (d.get("tls_missing") or ())),
            journal=JournalSummary.from_json(journal) if isinstance(journal, dict) else None,
            peer_url=str(d.get("peer_url", "")),
            client_url=str(d.get("client_url", "")),
            bootstrap_member_id=opt("bootstrap_member_id"),
            bootstrap_cluster_id=opt("bootstrap_cluster_id"),
            lineage=tuple(tuple(str(y) for y in x) for x in lin if isinstance(x, list)),
            db_member_ids=tuple(str(x) for x in (d.get("db_member_ids") or ()) if isinstance(x, str)),
            db_note=str(d.get("db_note") or ""),
            etcdctl_path=opt("etcdctl_path"),
            etcdutl_path=opt("etcdutl_path"),
        )


def parse_version(text: Optional[str]) -> Optional[Tuple[int, int, int]]:
    """``"3.4.23"`` -> (3, 4, 23); None when unreadable."""
    if not text:
        return None
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


# etcdutl gained --bump-revision/--mark-compacted in 3.5.10 (etcd PR 16165); 3.5.0-3.5.9 reject
# them as unknown flags, so a plain "3.5+" check would fail every restore on those releases.
BUMP_MIN_ETCDUTL = (3, 5, 10)


def can_bump(facts_or_version: Optional[str]) -> bool:
    """``--bump-revision``/``--mark-compacted`` need etcdutl 3.5.10+ (etcdctl 3.4 has neither)."""
    v = parse_version(facts_or_version)
    return v is not None and v >= BUMP_MIN_ETCDUTL


def work_dir_for(data_dir: str, member: str) -> str:
    """Where one member's restore keeps its journal and shipped files: beside the data dir, so the
    restored db lands on the same filesystem (the final step is a rename)."""
    base = data_dir.rstrip("/")
    parent = base.rsplit("/", 1)[0] or "/"
    return f"{parent.rstrip('/')}/.etcd-agent-restore-{member}"


# ---------------------------------------------------------------- pre-check rules


def required_free(snapshot_size: int) -> int:
    """Bytes needed beside the data dir: the shipped snapshot plus the restored db (about the
    snapshot's size again), plus 10% and 64 MiB for the WAL. The old data dir is renamed, not
    copied, so it costs nothing."""
    return int(snapshot_size * 2 * 1.1) + 64 * 1024 * 1024




def version_problems(snapshot_version: Optional[str], facts: NodeFacts) -> List[str]:
    """A backup of a newer minor release than the host's etcd (or its snapshot tool) is refused:
    that restore is a downgrade, which etcd does not support (3.4 may even start on 3.5 data, and
    then run on a store written by a release it does not know). Patch releases may differ."""
    want = parse_version(snapshot_version)
    if want is None:
        return []
    tool_name = "etcdutl" if facts.etcdutl_version else "etcdctl"
    tool = facts.etcdutl_version or facts.etcdctl_version
    older = []
    for label, have in (("etcd", facts.etcd_version), (tool_name, tool)):
        hv = parse_version(have)
        if hv is not None and hv[:2] < want[:2]:
            older.append(f"{label} {have}")
    if not older:
        return []
    line = f"{want[0]}.{want[1]}"
    return [f"the backup is from etcd {snapshot_version}, this host has {' and '.join(older)}: restoring it "
            f"would downgrade the cluster to an older minor release, which etcd does not support; install "
            f"etcd {line} here and upgrade the cluster to it first (etcd-agent upgrade --to {line}.x), "
            f"or restore a backup taken on the release this host runs"]


def check_host(
    cfg: Config,
    member: Member,
    facts: NodeFacts,
    *,
    snapshot_size: int,
    snapshot_version: Optional[str],
    agent_version: str,
    resuming: bool,
) -> List[str]:
    """Everything that must hold on one host before anything is touched there."""
    p: List[str] = []
    if facts.protocol != NODE_PROTOCOL:
        p.append(f"agent {facts.agent_version} speaks node protocol {facts.protocol}, this one {NODE_PROTOCOL} ({agent_version}): upgrade the agents")
    if facts.data_dir != cfg.data_dir(member.name):
        p.append(f"the host's config puts the data dir at {facts.data_dir}, this config at {cfg.data_dir(member.name)}: configs differ")
    if facts.peer_url and facts.peer_url != member.peer_url:
        p.append(f"the host's config gives {member.name} peer URL {facts.peer_url}, this config {member.peer_url}: configs differ")
    if facts.client_url and facts.client_url != member.client_url:
        p.append(f"the host's config gives {member.name} client URL {facts.client_url}, this config {member.client_url}: configs differ")
    if not facts.identity_match:
        p.append(f"host {member.host} of member {member.name} is not this machine's address or name (wrong ssh_host?)")
    tool = facts.etcdutl_version or facts.etcdctl_version
    if tool is None:
        p.append("neither etcdutl nor etcdctl runs on this host")
    elif (facts.etcdutl_path or cfg.etcd.etcdutl) and facts.etcdutl_version is None:
        # the restore argv would name etcdutl: refuse now rather than fail and roll back later
        p.append(f"etcdutl {facts.etcdutl_path or cfg.etcd.etcdutl} is configured but does not run on this host")
    if facts.etcd_version is None:
        p.append("etcd does not run on this host (etcd --version failed)")
    p += version_problems(snapshot_version, facts)
    need = required_free(snapshot_size)
    if facts.free_bytes < need and not resuming:
        p.append(f"{facts.free_bytes} bytes free beside {facts.data_dir}, the restore needs {need}")
    if facts.data_dir_state == "other" and not resuming:
        p.append(f"{facts.data_dir} exists but is not a directory")
    if not facts.fence_ok:
        p.append(f"apiserver fencing ({cfg.kubernetes.fence}) not possible: {facts.fence_detail}")
    for f in facts.tls_missing:
        p.append(f"TLS file {f} is missing")
    j = facts.journal
    if j is not None and j.open and not resuming:
        p.append(f"an unfinished restore {j.op} (from {j.backup}) is journaled in {facts.work_dir}")
    return p


def resume_decision(journals: Mapping[str, Optional[JournalSummary]], backup: str,
                    sha256: Optional[str]) -> Tuple[Optional[JournalSummary], List[str]]:
    """Given each member's journal (None: none), whether this run resumes an earlier one.

    Returns (the journal to resume - op, token, ... - or None for a fresh restore, problems). An
    unfinished restore of *another* backup, or two different unfinished ones, must be settled
    first: resuming it with different data would mix clusters.
    """
    open_ = {m: j for m, j in journals.items() if j is not None and j.open}
    if not open_:
        return None, []
    ops = {j.op for j in open_.values()}
    if len(ops) > 1:
        return None, [f"members are journaled in different unfinished restores ({', '.join(sorted(ops))}): "
                      "roll them back with `etcd-agent restore rollback --yes` first"]
    first = next(iter(open_.values()))
    same = first.backup == backup and (sha256 is None or first.sha256 in (None, sha256))
    if not same:
        return None, [f"an unfinished restore {first.op} from {first.backup} is journaled; re-run "
                      f"`etcd-agent restore --from {first.backup} --yes` to resume it, or "
                      "`etcd-agent restore rollback --yes` to undo it"]
    return first, []


def default_token(cluster_name: str, stamp: str) -> str:
    """A new cluster token per restore: members of the old cluster can never talk to the new one."""
    return f"{cluster_name}-restore-{stamp}"[:63]


def token_problem(token: str) -> Optional[str]:
    if not NAME_RE.match(token):
        return f"--new-token {token!r} is not a safe token (letters, digits, _ . -; max 63)"
    return None


# ---------------------------------------------------------------- conf rewriting


def rewrite_conf(text: str, values: Mapping[str, str]) -> str:
    """``text`` (an EnvironmentFile) with the given keys set to ``values``; other lines (tuning,
    comments) kept as they are; keys not present are appended."""
    out: List[str] = []
    done = set()
    for raw in text.splitlines():
        line = raw.strip()
        key = line.split("=", 1)[0].strip() if "=" in line and not line.startswith(("#", ";")) else ""
        if key.startswith("export "):
            key = key[len("export "):].strip()
        if key in values:
            if key not in done:
                out.append(f"{key}={values[key]}")
                done.add(key)
            continue  # a duplicate assignment would override ours: drop it
        out.append(raw)
    missing = [k for k in values if k not in done]
    if missing:
        out.append("# set by etcd-agent restore")
        out += [f"{k}={values[k]}" for k in missing]
    return "\n".join(out) + "\n"


def restore_conf_values(cfg: Config, member: Member, boot: Bootstrap) -> Dict[str, str]:
    """The ETCD_* identity values of ``member`` in the restored cluster (plus TLS files)."""
    v = conf_vars(cfg, member, boot)
    return {k: val for k, val in v.items() if k in REWRITE_KEYS or k.endswith("_FILE") or k.endswith("_AUTH")}


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
                                 data_dir=tmp, bump_revision=BUMP_REVISION if bump else None)
    spec = f"{cfg.etcd.user}:{cfg.etcd.group}"
    if not source.sha256:
        claim = "the sha256 the sender computes"
    elif source.kind == "runbook":  # no manifest: the hash is the reader's, of the tarball's own bytes
        claim = f"the sha256 {source.sha256[:16]}... read from the tarball"
    else:
        claim = f"the manifest's sha256 {source.sha256[:16]}..."
    tls = [x for x in (cfg.tls.peer_cert, cfg.tls.peer_key, cfg.tls.peer_ca, cfg.tls.client_cert, cfg.tls.client_key,
                       cfg.tls.client_ca) if x]
    steps = [
        Step("lock", f"take the operation lock {cfg.backup.dir}/.etcd-agent.lock (held until the end)"),
        Step("begin", f"journal in {wd}/journal.json (0700 dir)"),
        Step("receive", f"ship the snapshot ({source.size} bytes) to {snap} (0600) while etcd still serves; "
                        f"hashed as it is read and as it lands, checked against {claim} and etcd's own trailer"),
        Step("fence", _fence_text(cfg, owner)),
        Step("stop", f"stop etcd ({cfg.etcd.service_manager} backend"
                     f"{', ' + cfg.etcd.unit if cfg.etcd.service_manager == 'systemd' else ''}); followers first, "
                     "the leader last"),
        Step("aside", f"move {data_dir} to {data_dir.rstrip('/')}.pre-restore-<UTC time> (kept, never deleted)"),
        Step("restore", f"snapshot restore into {tmp}, then rename to {data_dir}", tuple(argv)),
        Step("chown", f"chown -R {spec} {data_dir}" if cfg.etcd.service_manager == "systemd" else
             f"chown -R {spec} {data_dir} when the agent runs as root and {cfg.etcd.user} exists (etcd runs as it)",
             ("chown", "-R", spec, data_dir) if cfg.etcd.service_manager == "systemd" else None),
        Step("repair", _repair_text(cfg, m, f)),
        Step("start", "start etcd (all members at once)" + (f"; TLS files {', '.join(tls)}" if tls else "")),
        Step("wait", f"wait until every member is healthy at the same revision (>= {source.revision}); "
                     f"record the snapshot's member ids as this cluster's lineage ({LINEAGE_KEY})"),
    ]
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
    from ..cluster.kubernetes import master_addresses, rule_text

    ic = initial_cluster(member_pairs(cfg.members))
    bump, note = bump_decision(cfg, facts)
    masters, _unknown = master_addresses(cfg, resolve=False)
    plan = Plan(op, backup, token, ic, source.revision, bump, note, new_cluster, resuming, kind=source.kind,
                evidence=list(source.lines),
                kubernetes=[f"after etcd is healthy, before the apiservers start: {rule_text(cfg, masters)}"])
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


@dataclass(frozen=True)
class AsideDecision:
    path: str
    keep: bool
    reason: str


def cleanup_plan(data_dir: str, entries: Sequence[str], keep: int) -> List[AsideDecision]:
    """Which set-aside dirs of ``data_dir`` (names in its parent) to keep: the newest ``keep``."""
    base = data_dir.rstrip("/")
    parent, name = base.rsplit("/", 1) if "/" in base else (".", base)
    found = []
    for e in entries:
        m = ASIDE_RE.match(e)
        if m and m.group("base") == name:
            found.append((m.group("stamp"), int(m.group("n") or 1), e, m.group("tag")))
    found.sort(reverse=True)
    out = []
    for i, (stamp, _n, e, tag) in enumerate(found):
        path = f"{parent}/{e}"
        if i < keep:
            out.append(AsideDecision(path, True, f"{tag} from {stamp}: among the newest {keep}"))
        else:
            out.append(AsideDecision(path, False, f"{tag} from {stamp}: older than the newest {keep}"))
    return out
