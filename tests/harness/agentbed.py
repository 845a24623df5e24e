"""Helpers shared by the systemd-tier tests that run the agent in nspawn hosts: the operator's
config for a set of containers, waiting for health from the root namespace, unit state."""
from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Callable, Dict, Optional, Sequence

import pytest

from etcd_agent.cluster.status import cluster_status
from etcd_agent.config import Config, parse_text
from tests.harness.nspawn import Container
from tests.harness.releases import DEFAULT
from tests.harness.rootfs import TREE_VERSIONS_DIR

if TYPE_CHECKING:  # pragma: no cover
    from tests.harness.nspawn import NspawnBed

DAEMON_FAST = "[daemon]\ninterval = 1.0\nlock_ttl = 10\n"


def members_toml(hosts: Sequence[Container]) -> str:
    """One [[member]] per container, named after it, at its namespace IP."""
    return "".join(f'[[member]]\nname = "{c.name}"\nhost = "{c.ip}"\n\n' for c in hosts)


def release_toml(version: str) -> str:
    """``[etcd]`` keys running one release from the containers' /opt/etcd (the releases layer);
    from 3.5 on with etcdutl, so restores use it (and bump the revision)."""
    d = f"{TREE_VERSIONS_DIR}/{version}"
    keys = f'binary = "{d}/etcd"\netcdctl = "{d}/etcdctl"\n'
    return keys if version.startswith("3.4.") else keys + f'etcdutl = "{d}/etcdutl"\n'


def agent_toml(name: str, hosts: Sequence[Container], *, bootstrap: str = "static", extra: str = "",
               version: Optional[str] = DEFAULT) -> str:
    """One config for every host (no [local] name: each agent finds itself by name / IP), etcd
    ``version`` from /opt/etcd under systemd (None: the product's defaults, Debian's /usr/bin/etcd
    3.4.23 in the tree), a fast daemon; ``extra`` appends sections ([ssh], [kubernetes] ...)."""
    return (
        f'[cluster]\nname = "{name}"\ntoken = "{name}-cluster-1"\nbootstrap = "{bootstrap}"\n\n'
        + members_toml(hosts)
        + '[etcd]\nservice_manager = "systemd"\n'
        + (release_toml(version) if version else "")
        + "\n"
        + DAEMON_FAST
        + extra
    )


def parsed(text: str) -> Config:
    cfg, errors = parse_text(text)
    assert cfg is not None and not errors, errors
    return cfg


def wait_healthy(cfg: Config, n: int, timeout: float) -> float:
    """Seconds until the cluster has exactly n members, all reachable and healthy (seen from the
    root namespace)."""
    t0 = time.monotonic()
    rows: list = []
    while time.monotonic() - t0 < timeout:
        rows = cluster_status(cfg, timeout=1.0)
        if len(rows) == n and all(r.healthy for r in rows):
            return time.monotonic() - t0
        time.sleep(0.3)
    raise AssertionError(f"not {n} healthy after {timeout:.0f} s: {[(r.name, r.healthy, r.errors) for r in rows]}")


def journal(c: Container, unit: str, lines: int = 40) -> str:
    return c.exec(["journalctl", "--no-pager", "-o", "cat", "-n", str(lines), "-u", unit]).stdout


def wait_unit(c: Container, unit: str, state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while c.systemctl("is-active", unit).stdout.strip() != state:
        if time.monotonic() > deadline:
            pytest.fail(f"{c.name}: {unit} not {state} after {timeout:.0f} s:\n{journal(c, unit)}")
        time.sleep(0.2)


def main_pid(c: Container, unit: str) -> int:
    return int(c.systemctl("show", "-p", "MainPID", "--value", unit).stdout.strip() or 0)


def run_backup_unit(c: Container, backup_dir: str) -> str:
    """Start etcd-agent-backup.service once, wait for it, and return the tarball that run wrote
    (the path it printed, from the journal after the start only). The daemon's continuous
    backup takes full backups of its own (the base of each delta chain), so what else appears in
    ``backup_dir`` meanwhile must be the daemon's, by its signed manifest."""
    before = set(c.exec(["ls", backup_dir], check=True).stdout.split())
    # where the journal ends now: what the unit prints after it is this run's (a oneshot's
    # InvocationID is gone once it has finished)
    last = c.exec(["journalctl", "--no-pager", "-q", "-n", "1", "--show-cursor"]).stdout.splitlines()
    cursor = last[-1].removeprefix("-- cursor: ") if last and last[-1].startswith("-- cursor: ") else ""
    res = c.systemctl("start", "etcd-agent-backup.service", timeout=300)
    assert res.returncode == 0, res.stderr + journal(c, "etcd-agent-backup")
    assert c.systemctl("show", "-p", "Result", "--value",
                       "etcd-agent-backup.service").stdout.strip() == "success"
    deadline = time.monotonic() + 10.0  # journald may store the unit's last lines a moment later
    while True:
        out = c.exec(["journalctl", "--no-pager", "-o", "cat", "-u", "etcd-agent-backup",
                      *([f"--after-cursor={cursor}"] if cursor else [])], check=True).stdout
        printed = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(backup_dir.rstrip("/") + "/etcd-")]
        if printed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(printed) == 1, out
    path = printed[0]
    assert c.exec(["test", "-f", path]).returncode == 0, f"{path} printed but not there"
    listing = json.loads(c.exec(["etcd-agent", "--json", "backup", "list"], check=True).stdout)
    origin = {b["name"]: b["origin"] for b in listing["backups"]}
    assert origin.get(os.path.basename(path)) == "operator", listing
    others = [n for n in origin if n not in before and n != os.path.basename(path)]
    assert all(origin[n] == "daemon" for n in others), (others, listing)
    return path


def untouched_state(c: Container, data_dir: str, units: Sequence[str] = ("etcd", "kube-apiserver.service")) -> tuple:
    """What a refused operation must leave as it was: the units' main pids, the data dir's inode
    and mtime (a move or an added/removed entry changes them) and the db file's inode. Not the
    db's mtime: a running etcd commits on its own (leader changes, lease checkpoints) - seen in
    CI as a one-second drift with nothing else touched."""
    return (
        tuple(main_pid(c, u) for u in units),
        c.exec(["stat", "-c", "%i %Y", data_dir]).stdout.strip(),
        c.exec(["stat", "-c", "%i", f"{data_dir}/member/snap/db"]).stdout.strip(),
    )


def install_agents(
    bed: "NspawnBed",
    repo: str,
    agent_unit: str,
    config_text: str,
    *,
    extra_units: "Optional[Dict[str, str]]" = None,
    prepare: "Optional[Callable[[Container], None]]" = None,
) -> None:
    """Every container of ``bed``, in parallel: the current source, ``prepare(c)`` if given, the
    shipped etcd-agent.service plus ``extra_units`` (name -> text, enabled and started first),
    /etc/etcd-agent/agent.toml, the bed's SSH client key and known_hosts (restore and upgrade
    reach the other hosts over SSH), then `systemctl enable --now etcd-agent`."""
    from concurrent.futures import ThreadPoolExecutor

    with open(bed.client_key) as f:
        key = f.read()
    with open(bed.known_hosts) as f:
        known = f.read()
    with open(agent_unit) as f:
        unit = f.read()
    extra = dict(extra_units or {})

    def install(c: Container) -> None:
        c.install_agent(repo)
        if prepare is not None:
            prepare(c)
        c.write_file("/etc/systemd/system/etcd-agent.service", unit)
        for name, text in extra.items():
            c.write_file(f"/etc/systemd/system/{name}", text)
        c.write_file("/etc/etcd-agent/agent.toml", config_text)
        c.write_file("/etc/etcd-agent/id_ed25519", key, mode=0o600)
        c.write_file("/etc/etcd-agent/known_hosts", known)
        c.systemctl("daemon-reload", check=True)
        for name in extra:
            c.systemctl("enable", "--now", name, check=True)
        c.systemctl("enable", "--now", "etcd-agent.service", check=True)

    with ThreadPoolExecutor(max_workers=len(bed.containers)) as pool:
        list(pool.map(install, bed.containers))
