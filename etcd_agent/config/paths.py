"""Where configured paths may point: absolute and normalised, in the agent's place, its own dirs apart.

Every path of the config is listed once (``configured_paths``) with what the agent does with it;
``validate_paths`` gives one sentence per problem, for ``validation.validate``. Pure: nothing
here looks at the file system; links are resolved by the function the caller passes.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from etcd_agent.config.model import PATH_RE, BackupSection, Config, DaemonSection, EtcdSection, KubernetesSection

# Directories that are the system's, not the agent's: no configured directory may be one of them
# (the agent creates its dirs, moves a data dir aside, deletes what it holds); below them is fine
# (/var/lib/etcd). "/etc" is here for the agent's config-side dirs (manifests-aside) only: its
# data may not be anywhere below /etc (DATA_TREES).
SYSTEM_DIRS = frozenset({
    "/", "/etc", "/home", "/root", "/run", "/tmp", "/var", "/var/tmp", "/var/lib", "/var/cache",
    "/var/log", "/var/spool", "/var/mail", "/var/opt", "/var/local", "/var/backups", "/var/run",
    "/var/lock", "/opt", "/srv", "/mnt", "/media",
})
# Trees that belong to the OS and the kernel at every depth: nothing the agent writes goes there.
# Top-level components, as globs ("lib*": /lib, /lib32, /lib64, /libx32 ...).
SYSTEM_TREES = ("usr", "bin", "sbin", "lib*", "boot", "efi", "dev", "proc", "sys")
# The agent's data (etcd's data, backups, state, pid files and logs) is not configuration.
DATA_TREES = SYSTEM_TREES + ("etc",)

# Every configured path by what the agent does with it: "data" dirs it owns (creates, empties,
# moves aside), "dir"s it creates, "write" files it writes or moves, "read" paths it only reads.
PathKind = str
DATA, DIR, WRITE, READ = "data", "dir", "write", "read"
EXAMPLES = {
    "etcd.data_dir": EtcdSection.data_dir, "etcd.run_dir": EtcdSection.run_dir,
    "backup.dir": BackupSection.dir, "daemon.state_dir": DaemonSection.state_dir,
    "kubernetes.manifest_aside_dir": KubernetesSection.manifest_aside_dir,
    "etcd.conf_file": EtcdSection.conf_file, "etcd.unit_file": EtcdSection.unit_file,
    "kubernetes.manifest": KubernetesSection.manifest,
    "backup.metrics_file": "/var/lib/node_exporter/textfile_collector/etcd_agent_backup.prom",
    "drill.dir": "/var/lib/etcd-agent-drill",
    "drill.metrics_file": "/var/lib/node_exporter/textfile_collector/etcd_agent_drill.prom",
    "backup.delta.metrics_file": "/var/lib/node_exporter/textfile_collector/etcd_agent_delta.prom",
    "backup.manifest_key": "/etc/etcd-agent/manifest.key",
}


def path_problem(key: str, value: str) -> Optional[str]:
    """Why ``value`` is not an absolute, normalised path of plain characters, or None.

    Refused, never normalised: what the operator wrote is what the agent uses, so ``/etc/.``
    or ``/var/lib/etcd/../../../etc`` cannot pass for something else.
    """
    if not PATH_RE.match(value):
        return f"{key} {value!r} must be an absolute path of plain characters"
    parts = value.split("/")[1:]
    if value != "/" and ("" in parts or "." in parts or ".." in parts):
        return (f"{key} {value!r} is not normalised (no '.' or '..' components, no '//', no trailing '/'): "
                f"write the path exactly as the agent should use it")
    return None


def _system_tree(value: str, trees: Iterable[str]) -> Optional[str]:
    """The system tree (as /top) that ``value`` is or is inside of, or None."""
    top = value.split("/")[1] if value != "/" else ""
    return next((f"/{top}" for t in trees if top and fnmatch.fnmatchcase(top, t)), None)


def placement_problem(key: str, value: str, kind: PathKind) -> Optional[str]:
    """Why a (normalised) path is in the system's place rather than the agent's, or None."""
    if kind == READ:
        return None
    example = f" (e.g. {EXAMPLES[key]})" if key in EXAMPLES else ""
    tree = _system_tree(value, DATA_TREES if kind == DATA else SYSTEM_TREES)
    if kind != WRITE and (value in SYSTEM_DIRS or value == tree):
        return f"{key} {value!r} is a system directory; give the agent a directory of its own{example}"
    if tree is not None:
        return f"{key} {value!r} is inside {tree}, which belongs to the system; give the agent a place of its own{example}"
    parent = value.rsplit("/", 1)[0] or "/"
    if kind == WRITE and parent in SYSTEM_DIRS:
        return (f"{key} {value!r} is directly in {parent}, a system directory; the agent writes this file, "
                f"so give it a directory of its own{example}")
    return None


def _inside(a: str, b: str) -> bool:
    """``a`` is ``b`` or below it (normalised absolute paths)."""
    return a == b or a.startswith(b.rstrip("/") + "/")


def configured_paths(cfg: Config) -> List[Tuple[str, Optional[str], PathKind]]:
    """Every path of the config: (key, value or None, kind)."""
    e, b, r, s, k = cfg.etcd, cfg.backup, cfg.backup.remote, cfg.ssh, cfg.kubernetes
    t = cfg.tls
    return [
        ("etcd.binary", e.binary, READ), ("etcd.etcdctl", e.etcdctl, READ), ("etcd.etcdutl", e.etcdutl, READ),
        ("etcd.data_dir", e.data_dir, DATA), ("etcd.conf_file", e.conf_file, WRITE),
        ("etcd.unit_file", e.unit_file, WRITE), ("etcd.run_dir", e.run_dir, DATA),
        ("etcd.versions_dir", e.versions_dir, READ),
        *((f"tls.{n}", getattr(t, n), READ) for n in ("client_ca", "client_cert", "client_key", "peer_ca",
                                                        "peer_cert", "peer_key")),
        ("backup.dir", b.dir, DATA), ("backup.metrics_file", b.metrics_file, WRITE),
        ("backup.delta.metrics_file", b.delta.metrics_file, WRITE), ("backup.manifest_key", b.manifest_key, WRITE),
        ("backup.remote.credentials_file", r.credentials_file, READ), ("backup.remote.ca_bundle", r.ca_bundle, READ),
        ("ssh.identity_file", s.identity_file, READ), ("ssh.known_hosts", s.known_hosts, READ),
        ("ssh.agent_path", s.agent_path, READ),
        ("kubernetes.manifest", k.manifest, WRITE), ("kubernetes.manifest_aside_dir", k.manifest_aside_dir, DIR),
        ("kubernetes.readyz_ca", k.readyz_ca, READ),
        ("daemon.state_dir", cfg.daemon.state_dir, DATA),
        ("drill.dir", cfg.drill.dir, DATA), ("drill.metrics_file", cfg.drill.metrics_file, WRITE),
    ]


def validate_paths(cfg: Config, resolve: Callable[[str], str] = lambda p: p) -> List[str]:
    """Every path absolute, normalised and in the agent's place; the agent's own dirs apart, also
    once ``resolve`` (the caller's ``os.path.realpath``) has followed their links."""
    errs: List[str] = []
    names = [m.name for m in cfg.members]
    good: Dict[str, List[str]] = {}
    for key, value, kind in configured_paths(cfg):
        if value is None:
            continue
        # {name} is the member's name in these two: check what each member gets
        expanded = sorted({value.replace("{name}", n) for n in names} or {value}) \
            if key in ("etcd.data_dir", "etcd.conf_file") else [value]
        problem = path_problem(key, value) or next(
            (p for v in expanded for p in [path_problem(key, v) or placement_problem(key, v, kind)] if p), None)
        if problem:
            errs.append(problem)
        else:
            good[key] = expanded
    # a reset or restore takes the data dir with it; prune empties the backup dir; a drill
    # removes what it leaves in its dir
    owned = ("etcd.data_dir", "backup.dir", "daemon.state_dir", "drill.dir")
    for i, k1 in enumerate(owned):
        for k2 in owned[i + 1:]:
            problem = _overlap(k1, good.get(k1, []), k2, good.get(k2, []), resolve)
            if problem:
                errs.append(problem)
    return errs


def _overlap(k1: str, v1: List[str], k2: str, v2: List[str], resolve: Callable[[str], str]) -> Optional[str]:
    """Why two of the agent's own dirs are not apart, as written or once links are followed (a
    backup dir that is a link into the data dir goes aside with it at a restore), or None."""
    pairs = [(a, b) for a in v1 for b in v2]
    clash = next(((a, b) for a, b in pairs if _inside(a, b) or _inside(b, a)), None)
    if clash:
        return f"{k1} {clash[0]!r} and {k2} {clash[1]!r} overlap (one holds the other); give each a directory of its own"
    for a, b in pairs:
        ra, rb = resolve(a), resolve(b)
        if _inside(ra, rb) or _inside(rb, ra):
            where = "; ".join(f"{k} is {r!r}" for k, v, r in ((k1, a, ra), (k2, b, rb)) if r != v)
            return (f"{k1} {a!r} and {k2} {b!r} overlap once links are resolved ({where}); "
                    f"give each a directory of its own")
    return None
