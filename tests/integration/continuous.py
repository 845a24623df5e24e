"""Shared by the continuous-backup tests: a loopback cluster on etcd 3.5.16 with one daemon per
member (real `etcd-agent run` processes), the CLI, and waits on the delta chain."""
from __future__ import annotations

import os
import subprocess
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from etcd_agent.chain import chains
from etcd_agent.continuous.status import read_breaks
from etcd_agent.etcd import proto
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.waiting import poll
from tests.harness.loopback import LoopbackCluster
from tests.integration.test_daemon import Daemons, wait_healthy
from tests.integration.test_restore import AGENT, EXTRA

FAST = {"close_seconds": "1.0", "idle_seconds": "3.0"}


def delta_extra(d: str, *, delta: Optional[Dict[str, str]] = None, daemon: str = "", backup: str = "",
                tables: str = "") -> str:
    """[backup] keys (the harness puts ``extra`` right after [backup] dir), [backup.delta] (fast
    segment closes unless ``delta`` says otherwise), [ssh], [daemon], then other ``tables``."""
    keys = dict(FAST, **(delta or {}))
    return (
        f'metrics_file = "{d}/textfile/etcd_agent_backup.prom"\n' + backup
        + "[backup.delta]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
        + EXTRA
        + f'[daemon]\ninterval = 1.0\nlock_ttl = 10\nstate_dir = "{d}/state"\n' + daemon + tables
    )


def make_bed(directory: str, n: int = 3, *, delta: Optional[Dict[str, str]] = None, daemon: str = "",
             backup: str = "", tables: str = "") -> Daemons:
    os.makedirs(os.path.join(directory, "textfile"), exist_ok=True)
    extra = delta_extra(directory, delta=delta, daemon=daemon, backup=backup, tables=tables)
    c = LoopbackCluster(directory, n, bootstrap="static", extra=extra)  # the default release, 3.5.16
    return Daemons(c)


@contextmanager
def beds(directory: str, n: int = 3) -> Iterator[Callable[..., Daemons]]:
    """``make(**kw)``: a new bed under ``directory`` (c0, c1 ...; ``kw`` as for ``make_bed``, of
    ``n`` members unless it says); every bed made, its daemons and its cluster, stopped on the way out."""
    made: List[Daemons] = []

    def make(**kw: Any) -> Daemons:
        kw.setdefault("n", n)
        d = make_bed(os.path.join(directory, f"c{len(made)}"), **kw)
        made.append(d)
        return d

    try:
        yield make
    finally:
        for d in made:
            d.stop()
            d.c.stop()


def start_all(d: Daemons, timeout: float = 90) -> None:
    for lm in d.c.members:
        d.start(lm.member.name)
    wait_healthy(d.c.cfg, len(d.c.members), timeout)


def agent(c: LoopbackCluster, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return subprocess.run([AGENT, "-c", c.config_path, *args], capture_output=True, text=True, timeout=timeout)


def rpc(c: LoopbackCluster, member: int = 0) -> EtcdRpc:
    return EtcdRpc(c.cfg.members[member].client_url, timeout=5.0)


def put(r: EtcdRpc, key: str, value: bytes, lease: int = 0) -> int:
    return r.txn([proto.op_put(key.encode(), value, lease)]).revision


def delete(r: EtcdRpc, key: str) -> int:
    return r.txn([proto.op_delete(key.encode())]).revision


def dump(r: EtcdRpc, prefix: str = "") -> Dict[str, Tuple[bytes, int]]:
    """key -> (value, lease) of every key (under ``prefix``)."""
    if prefix:
        res = r.range(prefix.encode(), _end(prefix.encode()))
    else:
        res = r.range(b"\0", b"\0")
    return {e.key.decode(): (e.value, e.lease) for e in res.kvs}


def _end(p: bytes) -> bytes:
    return p[:-1] + bytes([p[-1] + 1])


def durable_revision(c: LoopbackCluster) -> int:
    """The newest revision in a closed segment of the newest chain in the backup dir."""
    found = chains.scan(c.cfg.backup.dir).chains
    return max((x.end_revision for x in found if x.usable), default=0)


def wait_durable(c: LoopbackCluster, revision: int, timeout: float = 60) -> float:
    t = time.monotonic()
    poll(lambda: durable_revision(c) >= revision, timeout=timeout, what=f"a closed segment holding revision {revision}",
         interval=0.2)
    return time.monotonic() - t


def wait_watching(c: LoopbackCluster, timeout: float = 90) -> int:
    """Until some daemon's watch writes a chain (its lock is held with a base): that base."""
    return int(poll(lambda: chains.active_base(c.cfg.backup.dir), timeout=timeout, what="a delta watch", interval=0.2))


def breaks(c: LoopbackCluster) -> int:
    return read_breaks(c.cfg.backup.dir)[0]


def logs(d: Daemons) -> str:
    return "\n".join(d.log(lm.member.name) for lm in d.c.members)


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    return poll(pred, timeout=timeout, what=what, interval=interval)


def textfile(c: LoopbackCluster) -> Dict[str, float]:
    from etcd_agent.daemon.metrics import samples

    path = os.path.join(os.path.dirname(c.cfg.backup.metrics_file or ""), "etcd_agent_delta.prom")
    with open(path) as fh:
        return {name: v for name, labels, v in samples(fh.read()) if not labels}


def segment_files(c: LoopbackCluster) -> List[str]:
    from etcd_agent.chain.segments import list_segments

    return list_segments(c.cfg.backup.dir)


def closed_through(directory: str) -> int:
    """The newest revision the closed delta segments of ``directory`` hold (0: none closed yet)."""
    from etcd_agent.chain.segments import list_segments, parse_name

    return max(((parse_name(os.path.basename(p)) or (0, 0))[1] for p in list_segments(directory)), default=0)


def full_backups(c: LoopbackCluster) -> List[str]:
    return sorted(n for n in os.listdir(c.cfg.backup.dir) if n.startswith("etcd-") and n.endswith(".tar")
                  and not n.startswith("etcd-delta-"))


def lease_ttl(r: EtcdRpc, key: str) -> Optional[int]:
    kv = dump(r).get(key)
    if kv is None or not kv[1]:
        return None
    return r.lease_ttl(kv[1]).ttl
