"""What each host reports before a restore (``NodeFacts``) and the rules that judge it: pure.

``node precheck`` on every host answers with ``NodeFacts`` (its tools and their versions, the free
space beside the data dir, its journal, whether it can fence the apiserver); ``check_host`` turns
them, the config and the backup into one sentence per problem (none: go), ``resume_decision``
says whether this run resumes an unfinished restore. ``plan`` builds the plan from the same facts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from etcd_agent.config import NAME_RE, Config, Member
from etcd_agent.etcd.snapvalues import cluster_id_from, member_id_from
from etcd_agent.etcd.versions import parse_version
from etcd_agent.restore.host.facts import NODE_PROTOCOL, NodeFacts
from etcd_agent.restore.host.journal import DONE, ROLLED_BACK, JournalSummary

# ---------------------------------------------------------------- facts from `node precheck`


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
    p = standing_problems(cfg, member, facts, agent_version)
    p += version_problems(snapshot_version, facts)
    if not resuming:
        p += _room_problems(facts, snapshot_size)
    j = facts.journal
    if j is not None and j.open and not resuming:
        p.append(f"an unfinished restore {j.op} (from {j.backup}) is journaled in {facts.work_dir}")
    return p


def standing_problems(cfg: Config, member: Member, facts: NodeFacts, agent_version: str) -> List[str]:
    """What refuses a restore on this host whatever it restores and whether it resumes: a
    point-in-time restore stops its replay on these, found while it still runs."""
    p = _agreement_problems(cfg, member, facts, agent_version)
    p += _tool_problems(cfg, facts)
    if not facts.fence_ok:
        p.append(f"apiserver fencing ({cfg.kubernetes.fence}) not possible: {facts.fence_detail}")
    p += [f"TLS file {f} is missing" for f in facts.tls_missing]
    return p + list(facts.foreign)


def _agreement_problems(cfg: Config, member: Member, facts: NodeFacts, agent_version: str) -> List[str]:
    """The host's agent and config agree with this one's, and the host is the member's."""
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
    return p


def _tool_problems(cfg: Config, facts: NodeFacts) -> List[str]:
    """The binaries the restore runs on the host run there."""
    p: List[str] = []
    tool = facts.etcdutl_version or facts.etcdctl_version
    if tool is None:
        p.append("neither etcdutl nor etcdctl runs on this host")
    elif (facts.etcdutl_path or cfg.etcd.etcdutl) and facts.etcdutl_version is None:
        # the restore argv would name etcdutl: refuse now rather than fail and roll back later
        p.append(f"etcdutl {facts.etcdutl_path or cfg.etcd.etcdutl} is configured but does not run on this host")
    if facts.etcd_version is None:
        p.append("etcd does not run on this host (etcd --version failed)")
    return p


def _room_problems(facts: NodeFacts, snapshot_size: int) -> List[str]:
    """Room for the restore beside the data dir, and a data dir it can set aside."""
    p: List[str] = []
    need = required_free(snapshot_size)
    if facts.free_bytes < need:
        p.append(f"{facts.free_bytes} bytes free beside {facts.data_dir}, the restore needs {need}")
    if facts.data_dir_state == "other":
        p.append(f"{facts.data_dir} exists but is not a directory")
    return p


def set_aside_problems(data_dir: str, resolved_data_dir: str,
                       kept: List[Tuple[str, str, str]]) -> List[str]:
    """What this host keeps (label, path as given, path with its links followed) that really lies
    inside the data dir the restore sets aside: it would go aside with it, and `restore cleanup`
    would delete it. Compared resolved, so a link from elsewhere cannot hide it."""
    return [f"{label} {path} lies inside {data_dir} once links are resolved ({resolved}), and this restore "
            f"sets that data dir aside; move it out of the data dir first"
            for label, path, resolved in kept
            if resolved == resolved_data_dir or resolved.startswith(resolved_data_dir.rstrip("/") + "/")]


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
    back = sorted(m for m, j in journals.items() if j is not None and j.op == first.op and j.state == ROLLED_BACK)
    if back:  # a rollback was cut off: going forward now would leave those members behind
        return None, [f"restore {first.op} was being rolled back (rolled back on {', '.join(back)}, not on "
                      f"{', '.join(sorted(open_))}): finish that with `etcd-agent restore rollback --yes` first"]
    same = first.backup == backup and (sha256 is None or first.sha256 in (None, sha256))
    if not same:
        done = finished_members(journals, first.op)
        undo = (f"; it cannot be undone: {', '.join(done)} finished it" if done
                else ", or `etcd-agent restore rollback --yes` to undo it")
        return None, [f"an unfinished restore {first.op} from {first.backup} is journaled; re-run "
                      f"`etcd-agent restore --from {first.backup} --yes` to resume it{undo}"]
    return first, []


# ---------------------------------------------------------------- forward or back: what the hosts show


def finished_members(journals: Mapping[str, Optional[JournalSummary]], op: str) -> List[str]:
    """The members whose journal says restore ``op`` is done: they serve the restored cluster and
    cannot be rolled back, so the others may only be taken forward."""
    return sorted(m for m, j in journals.items() if j is not None and j.op == op and j.state == DONE)


def restored_ids(initial_cluster: str, token: str) -> Tuple[Dict[str, int], int]:
    """(member name -> member id, cluster id) of the cluster a restore makes: etcd derives them
    from the peer URLs and the token (``snapshot restore`` passes no time)."""
    urls: Dict[str, List[str]] = {}
    for pair in initial_cluster.split(","):
        name, _, url = pair.partition("=")
        urls.setdefault(name, []).append(url)
    ids = {name: member_id_from(u, token) for name, u in urls.items()}
    return ids, cluster_id_from(list(ids.values()))


def serving_restored(live: Mapping[str, Tuple[str, str]], initial_cluster: str, token: str) -> List[str]:
    """The members whose running etcd answers (``live``: member -> (its id, cluster id), hex) as
    that member of the restored cluster: its restored data dir is the one in use."""
    ids, cluster = restored_ids(initial_cluster, token)
    return sorted(m for m, (mid, cid) in live.items() if m in ids and _hex(cid) == cluster and _hex(mid) == ids[m])


def _hex(text: str) -> Optional[int]:
    try:
        return int(text, 16)
    except ValueError:
        return None


@dataclass(frozen=True)
class Resume:
    """What a re-run finds of the restore it resumes: who finished it, whose etcd serves the
    restored cluster. Either means forward only: rolling the others back would leave two clusters."""

    finished: Tuple[str, ...] = ()
    serving: Tuple[str, ...] = ()

    @property
    def forward(self) -> bool:
        return bool(self.finished or self.serving)

    def describe(self) -> str:
        parts = ([f"finished on {', '.join(self.finished)}"] if self.finished else []) + (
            [f"the restored cluster served by {', '.join(self.serving)}"] if self.serving else [])
        return "; ".join(parts) or "no member serves the restored cluster yet"


def resume_state(journals: Mapping[str, Optional[JournalSummary]], live: Mapping[str, Tuple[str, str]], op: str,
                 initial_cluster: str, token: str) -> Resume:
    """``Resume`` from each member's journal and what its running etcd answers (``live``)."""
    return Resume(tuple(finished_members(journals, op)), tuple(serving_restored(live, initial_cluster, token)))


def split_by_restore(journals: Mapping[str, Optional[JournalSummary]]) -> List[str]:
    """One line per restore that some members finished and others rolled back (an agent before
    this rule could do that): those members are in two clusters, and nothing is left to resume or
    roll back - only a new restore puts them on one again."""
    out = []
    for op in sorted({j.op for j in journals.values() if j is not None}):
        states = {m: j.state for m, j in journals.items() if j is not None and j.op == op}
        done = sorted(m for m, st in states.items() if st == DONE)
        back = sorted(m for m, st in states.items() if st == ROLLED_BACK)
        if done and back:
            out.append(f"restore {op} finished on {', '.join(done)} but was rolled back on {', '.join(back)}: "
                       "they are in two clusters; restore a backup again to put every member on one")
    return out


def rollback_refusal(journals: Mapping[str, Optional[JournalSummary]]) -> List[str]:
    """Why ``restore rollback`` must not roll back the open journals: a member finished the same
    restore (it serves the restored cluster, and a finished restore is not rolled back), so rolling
    back only the others would leave two clusters. [] when it may roll back."""
    out = []
    for op in sorted({j.op for j in journals.values() if j is not None and j.open}):
        done = finished_members(journals, op)
        if not done:
            continue
        rest = sorted(m for m, j in journals.items() if j is not None and j.op == op and j.open)
        backup = next(j.backup for j in journals.values() if j is not None and j.op == op)
        out.append(f"restore {op} is finished on {', '.join(done)}, which serve the restored cluster: rolling back "
                   f"{', '.join(rest)} alone would leave two clusters; finish it instead with "
                   f"`etcd-agent restore --from {backup} --yes`")
    return out


def default_token(cluster_name: str, stamp: str) -> str:
    """A new cluster token per restore: members of the old cluster can never talk to the new one."""
    return f"{cluster_name}-restore-{stamp}"[:63]


def token_problem(token: str) -> Optional[str]:
    if not NAME_RE.match(token):
        return f"--new-token {token!r} is not a safe token (letters, digits, _ . -; max 63)"
    return None
