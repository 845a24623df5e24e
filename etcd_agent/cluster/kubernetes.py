"""What Kubernetes keeps in etcd that a restore makes stale, and the apiservers' way back.

After a restore the cluster holds the apiservers' state as of the backup:

- ``<prefix>/masterleases/<ip>``: one entry per apiserver that was running then. An entry of an
  address that is no master now sends clients (through the ``kubernetes`` service's endpoints)
  to an apiserver that is gone, until its lease would have run out. Those are deleted; the
  entries of the configured masters stay (each live apiserver rewrites its own anyway).
- ``<prefix>/leases/kube-system/kube-controller-manager`` and ``.../kube-scheduler``: the leader
  leases of the backup's moment. New leaders are chosen once they time out; with
  ``drop_leader_leases`` they are deleted, so the choice is made at once.

``plan_cleanup`` is pure; ``cleanup`` reads the keys and deletes what the plan says (nothing with
``dry_run``). ``wait_ready`` waits for one apiserver's ``/readyz``: the restore starts the
apiservers again one at a time, each once the one before it is ready.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from etcd_agent.config import Config, Member
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.waiting import SYSTEM_CLOCK, Clock, NotYet, poll

log = logging.getLogger(__name__)

LEADER_LEASES = ("kube-controller-manager", "kube-scheduler")


@dataclass(frozen=True)
class Removal:
    key: str
    why: str


@dataclass
class CleanupPlan:
    delete: List[Removal] = field(default_factory=list)
    keep: List[Removal] = field(default_factory=list)  # looked at, kept, and why
    notes: List[str] = field(default_factory=list)

    def lines(self, dry_run: bool) -> List[str]:
        verb = "would delete" if dry_run else "delete"
        return ([f"{verb} {r.key}: {r.why}" for r in self.delete] + [f"keep {r.key}: {r.why}" for r in self.keep]
                + self.notes)

    def to_json(self) -> Dict[str, object]:
        return {"delete": [{"key": r.key, "why": r.why} for r in self.delete],
                "keep": [{"key": r.key, "why": r.why} for r in self.keep], "notes": self.notes}


def rule_text(cfg: Config, masters: Sequence[str]) -> str:
    """The cleanup as the restore plan states it before the data is there."""
    p = cfg.kubernetes.etcd_prefix.rstrip("/")
    text = (f"delete {p}/masterleases/<ip> of every address that is not a master now "
            f"({', '.join(masters) or 'masters unknown: none deleted'})")
    if cfg.kubernetes.drop_leader_leases:
        text += "; delete the leader leases " + ", ".join(f"{p}/leases/kube-system/{n}" for n in LEADER_LEASES)
    return text


def master_addresses(cfg: Config, resolve: bool = True) -> Tuple[List[str], List[str]]:
    """(the masters' IP addresses, what could not be resolved). A member's host that is a name is
    resolved (best effort: during an outage DNS may be down, and then nothing is deleted)."""
    out: List[str] = []
    unknown: List[str] = []
    for m in cfg.members:
        try:
            out.append(str(ipaddress.ip_address(m.host)))
            continue
        except ValueError:
            pass
        if not resolve:
            unknown.append(m.host)
            continue
        try:
            infos = socket.getaddrinfo(m.host, None, proto=socket.IPPROTO_TCP)
            out += sorted({str(i[4][0]) for i in infos})
        except OSError:
            unknown.append(m.host)
    return sorted(set(out)), unknown


def plan_cleanup(cfg: Config, keys: Sequence[str], masters: Sequence[str], unknown: Sequence[str]) -> CleanupPlan:
    """Pure: which of ``keys`` (everything under the prefix's masterleases/ and kube-system leases)
    go, and why; no masterlease is deleted while a master's address is unknown."""
    p = cfg.kubernetes.etcd_prefix.rstrip("/")
    plan = CleanupPlan()
    ml = f"{p}/masterleases/"
    for key in sorted(k for k in keys if k.startswith(ml)):
        ip = key[len(ml):]
        if unknown:
            plan.keep.append(Removal(key, f"the addresses of {', '.join(unknown)} are unknown: not guessing"))
        elif ip in masters:
            plan.keep.append(Removal(key, "a master now"))
        else:
            plan.delete.append(Removal(key, f"{ip} is not a master now ({', '.join(masters)})"))
    leases = {f"{p}/leases/kube-system/{n}": n for n in LEADER_LEASES}
    for key in sorted(k for k in keys if k in leases):
        if cfg.kubernetes.drop_leader_leases:
            plan.delete.append(Removal(key, f"{leases[key]}'s leader lease from the backup's moment: "
                                            "a new leader is chosen at once"))
        else:
            plan.keep.append(Removal(key, "leader lease (drop_leader_leases = false): it times out by itself"))
    if unknown:
        plan.notes.append(f"master address(es) of {', '.join(unknown)} could not be resolved; set the members' "
                          "host to IP addresses to let the cleanup decide")
    return plan


def cleanup(cfg: Config, client: EtcdClient, *, dry_run: bool, resolve: bool = True) -> CleanupPlan:
    """Read the keys, plan, delete (unless ``dry_run``); every deletion logged with its reason."""
    p = cfg.kubernetes.etcd_prefix.rstrip("/")
    keys = client.keys(f"{p}/masterleases/") + client.keys(f"{p}/leases/kube-system/")
    masters, unknown = master_addresses(cfg, resolve)
    plan = plan_cleanup(cfg, keys, masters, unknown)
    if not dry_run:
        for r in plan.delete:
            client.delete(r.key)
            log.info("deleted %s: %s", r.key, r.why)
    return plan


def readyz_url(cfg: Config, member: Member) -> Optional[str]:
    url = cfg.kubernetes.readyz_url
    if url is None:
        return None
    host = f"[{member.host}]" if ":" in member.host else member.host
    return url.replace("{host}", host)


def wait_ready(cfg: Config, member: Member, *, clock: Clock = SYSTEM_CLOCK) -> Optional[float]:
    """Wait until ``member``'s apiserver answers 200 on /readyz; seconds waited (None: no URL set).
    OperationFailed at ``readyz_timeout``."""
    url = readyz_url(cfg, member)
    if url is None:
        return None
    ctx = ssl.create_default_context(cafile=cfg.kubernetes.readyz_ca) if url.startswith("https") else None
    t0 = clock.monotonic()

    def ready() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5.0, context=ctx) as resp:  # noqa: S310 - the config's URL
                if resp.status == 200:
                    return True
                raise NotYet(f"HTTP {resp.status}")
        except urllib.error.HTTPError as exc:
            raise NotYet(f"HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise NotYet(str(getattr(exc, "reason", exc))) from None

    poll(ready, timeout=cfg.kubernetes.readyz_timeout, what=f"{member.name}'s apiserver ready ({url})", interval=1.0,
         clock=clock)
    return clock.monotonic() - t0


