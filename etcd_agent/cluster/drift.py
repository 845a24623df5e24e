"""Drift and zombie detection, and the repairs that are safe to make without an operator.

``analyze`` is pure: etcd's member list, the config and the on-disk etcd.conf texts in, findings
out. Safe to fix: a member added but never started (a zombie from a half-done join: it counts as
a voter and eats into the failure budget) is removed when quorum allows, under the membership
lock, after a grace period that lets a join in progress publish itself; an etcd.conf that
disagrees with the config or the member list is re-rendered (etcd reads it only at start, so the
running member is untouched). Everything else is explained, not touched: a started member the
config does not know may be an operator's deliberate addition.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Set

from etcd_agent.config import Config, with_local
from etcd_agent.errors import EtcdError, RefusedError
from etcd_agent.etcd.client import EtcdClient, MemberInfo
from etcd_agent.topology import conf_vars, join_bootstrap, parse_conf, static_bootstrap
from etcd_agent.waiting import SYSTEM_CLOCK, Clock

log = logging.getLogger(__name__)

ZOMBIE = "zombie"
UNKNOWN = "not-in-config"
DUP_NAME = "duplicate-name"
DUP_PEER = "duplicate-peer-url"
NAME_MISMATCH = "name-mismatch"
CONF_DRIFT = "conf-drift"

# the identity variables a member's conf must carry exactly as the config says
_IDENTITY = ("ETCD_NAME", "ETCD_DATA_DIR", "ETCD_LISTEN_PEER_URLS", "ETCD_INITIAL_ADVERTISE_PEER_URLS",
             "ETCD_ADVERTISE_CLIENT_URLS", "ETCD_INITIAL_CLUSTER_TOKEN")


@dataclass(frozen=True)
class Finding:
    kind: str
    member: str
    detail: str
    member_id: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["member_id"] = None if self.member_id is None else f"{self.member_id:x}"
        return d


def analyze(cfg: Config, members: List[MemberInfo], confs: Dict[str, str],
            tokens: Optional[Dict[str, str]] = None) -> List[Finding]:
    """Pure: every disagreement between etcd's member list, the config and the conf files.
    ``tokens``: the cluster token each member's cluster was really made with (a restore sets a
    new one, recorded on the host); the config's where not given."""
    out: List[Finding] = []
    by_peer = {m.peer_url: m for m in cfg.members}
    for m in members:
        cfgm = next((by_peer[u] for u in m.peer_urls if u in by_peer), None)
        label = cfgm.name if cfgm else (m.name or m.hex_id)
        if not m.name:  # added by `member add`, never ran (a static bootstrap's unstarted members have names)
            out.append(Finding(ZOMBIE, label, f"member {m.hex_id} ({','.join(m.peer_urls)}) was added but never "
                                              "started", m.id))
        elif cfgm is None:
            out.append(Finding(UNKNOWN, label, f"member {m.name} ({m.hex_id}, {','.join(m.peer_urls)}) is in the "
                                               "cluster but not in the config", m.id))
        elif m.name != cfgm.name:
            out.append(Finding(NAME_MISMATCH, label, f"member {m.hex_id} at {cfgm.peer_url} calls itself {m.name!r}, "
                                                     f"the config {cfgm.name!r}", m.id))
    names = Counter(m.name for m in members if m.name)
    for name, n in names.items():
        if n > 1:
            out.append(Finding(DUP_NAME, name, f"{n} members are named {name!r}"))
    peers = Counter(u for m in members for u in m.peer_urls)
    for url, n in peers.items():
        if n > 1:
            out.append(Finding(DUP_PEER, url, f"{n} members have peer URL {url}"))
    listed = {u for m in members for u in m.peer_urls}
    for name, text in confs.items():
        out += _conf_findings(cfg, name, parse_conf(text), listed, (tokens or {}).get(name, cfg.cluster.token))
    return out


def _conf_findings(cfg: Config, name: str, conf: Dict[str, str], listed: Set[str], token: str) -> List[Finding]:
    m = cfg.member(name)
    want = conf_vars(cfg, m, dataclasses.replace(static_bootstrap(cfg, m), token=token))
    out = []
    for key in _IDENTITY:
        if conf.get(key) != want[key]:
            out.append(Finding(CONF_DRIFT, name, f"{cfg.conf_file(name)}: {key}={conf.get(key, '(missing)')}, "
                                                 f"the config says {want[key]}"))
    pairs = [p.split("=", 1) for p in conf.get("ETCD_INITIAL_CLUSTER", "").split(",") if "=" in p]
    stray = [f"{n}={u}" for n, u in pairs if u not in listed]
    if stray and listed:
        out.append(Finding(CONF_DRIFT, name, f"{cfg.conf_file(name)}: ETCD_INITIAL_CLUSTER names "
                                             f"{', '.join(stray)}, not in etcd's member list"))
    return out


def local_confs(cfg: Config) -> Dict[str, str]:
    """Conf files readable on this host: every member's on a one-host cluster, else the local one's."""
    from etcd_agent.errors import ConfigError
    from etcd_agent.locality import local_member, machine_identity

    if len({m.host for m in cfg.members}) == 1:
        names = [m.name for m in cfg.members]
    else:
        try:
            names = [local_member(cfg, machine_identity()).name]
        except ConfigError:
            names = []
    out = {}
    for n in names:
        try:
            with open(cfg.conf_file(n), encoding="utf-8") as fh:
                out[n] = fh.read()
        except OSError:
            pass  # not rendered yet: nothing to disagree with
    return out


def local_tokens(cfg: Config, confs: Dict[str, str]) -> Dict[str, str]:
    """The cluster token of each local member's cluster (a restore's, recorded on this host)."""
    from etcd_agent.state.bootstrap import effective_token

    return {name: effective_token(cfg, name) for name in confs}


def find_drift(cfg: Config, client: Optional[EtcdClient] = None) -> List[Finding]:
    own = client is None
    c = client or EtcdClient.from_config(cfg, timeout=3.0)
    try:
        confs = local_confs(cfg)
        return analyze(cfg, c.members(), confs, local_tokens(cfg, confs))
    finally:
        if own:
            c.close()


@dataclass(frozen=True)
class Fix:
    kind: str
    target: str
    description: str
    safe: bool
    member_id: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["member_id"] = None if self.member_id is None else f"{self.member_id:x}"
        return d


def plan_repair(cfg: Config, findings: List[Finding]) -> List[Fix]:
    """Pure: the fix for each finding, marked safe (the agent does it) or not (explained)."""
    fixes: List[Fix] = []
    seen_conf = set()
    for f in findings:
        if f.kind == ZOMBIE:
            fixes.append(Fix(f.kind, f.member, f"remove never-started member {f.member_id:x} ({f.member}) if quorum "
                                               "allows; a configured member re-joins by itself", True, f.member_id))
        elif f.kind == CONF_DRIFT and f.member not in seen_conf:
            seen_conf.add(f.member)
            fixes.append(Fix(f.kind, f.member, f"re-render {cfg.conf_file(f.member)} from the config and the member "
                                               "list (read at the next start; the running etcd is untouched)", True))
        elif f.kind == UNKNOWN:
            fixes.append(Fix(f.kind, f.member, f"{f.detail}: add it to the config, or remove it with "
                                               f"`etcd-agent member remove {f.member}`", False, f.member_id))
        elif f.kind in (DUP_NAME, DUP_PEER, NAME_MISMATCH):
            fixes.append(Fix(f.kind, f.member, f"{f.detail}: decide which member is right, then `etcd-agent "
                                               "leave`/`join` the other on its host", False, f.member_id))
    return fixes


def execute_repair(cfg: Config, fixes: List[Fix], grace: float = 5.0, clock: Clock = SYSTEM_CLOCK) -> List[str]:
    """Apply the safe fixes; each line says what was done."""
    from etcd_agent.member.local import MEMBERSHIP_LOCK, LocalMember
    from etcd_agent.member.quorum import can_remove

    done: List[str] = []
    with EtcdClient.from_config(cfg, timeout=5.0) as c:
        zombies = [f for f in fixes if f.safe and f.kind == ZOMBIE]
        if zombies:
            with c.locked(MEMBERSHIP_LOCK, ttl=max(cfg.daemon.lock_ttl, int(grace) + 30), timeout=30):
                # a join in progress publishes its name within seconds of its start: look twice
                clock.sleep(grace)
                for z in zombies:
                    members = c.members()
                    target = next((m for m in members if m.id == z.member_id), None)
                    if target is None or target.name:
                        done.append(f"member {z.member_id:x} started or left meanwhile: left alone")
                        continue
                    voting = [m for m in members if not m.is_learner]
                    healthy = sum(1 for m in voting if m.client_urls and any(c.healthy(u, 2.0)[0] for u in m.client_urls))
                    ok, why = can_remove(len(voting), healthy, target_is_voter=not target.is_learner, target_healthy=False)
                    if not ok:
                        raise RefusedError(f"not removing zombie {target.hex_id}: {why}")
                    c.remove_member(target.id)
                    done.append(f"removed never-started member {target.hex_id} ({why})")
        members = c.members()
        for fx in fixes:
            if not (fx.safe and fx.kind == CONF_DRIFT):
                continue
            m = cfg.member(fx.target)
            pairs = sorted((x.name, x.peer_urls[0]) for x in members if x.name and x.peer_urls)
            if cfg.cluster.bootstrap == "static" and pairs == sorted((y.name, y.peer_url) for y in cfg.members):
                boot = static_bootstrap(cfg, m)
            else:
                boot = join_bootstrap(cfg, m, [(x.name, x.peer_urls[0]) for x in members if x.name and x.peer_urls])
            lm = LocalMember(with_local(cfg, m.name), m)
            from etcd_agent.topology import render_conf

            lm.backend.write_conf(render_conf(lm.cfg, m, boot))
            done.append(f"re-rendered {cfg.conf_file(m.name)}")
    return done


def flag_rows(cfg: Config, rows: List[Any], members: List[MemberInfo]) -> None:
    """Add drift findings to ``status`` rows (by member name) that ``status`` does not flag itself."""
    try:
        confs = local_confs(cfg)
        findings = analyze(cfg, members, confs, local_tokens(cfg, confs))
    except (EtcdError, OSError, ValueError) as exc:
        log.debug("drift check skipped: %s", exc)
        return
    by_name = {r.name: r for r in rows}
    for f in findings:
        if f.kind in (ZOMBIE, UNKNOWN):
            continue  # status flags those itself
        row = by_name.get(f.member)
        if row is None and rows:
            row = rows[0]
        if row is not None:
            row.errors.append(f"{f.kind}: {f.detail}")
