"""argv builders for etcdctl / etcdutl, and the few commands the agent runs through them.

Only argv lists leave this module; every value that comes from config has been validated by
``validation.validate`` (paths, names, URLs), and nothing is ever joined into a shell string.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Dict, List, Optional, Type

from etcd_agent.errors import AgentError, BackupCorrupt, CommandError
from etcd_agent.safejson import loads
from etcd_agent.typedjson import Document, Key

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config
    from etcd_agent.hosts.base import Host

# etcdctl v3 API; 3.4 defaults to it already, being explicit keeps 3.3-era environments honest.
ETCDCTL_ENV = {"ETCDCTL_API": "3"}
MAX_STATUS_OUTPUT = 1 << 20  # `snapshot status -w json` prints one short object
U63 = (0.0, float((1 << 63) - 1))


@dataclass(frozen=True)
class SnapshotStatus(Document):
    """The four fields etcdctl 3.4 and etcdutl 3.5 print for ``snapshot status -w json``: what
    the agent compares (revision, entry count, hash) is checked here, once."""

    hash: int
    revision: int
    total_keys: Annotated[int, Key("totalKey")]
    total_size: Annotated[int, Key("totalSize")]

    ERROR: ClassVar[Type[AgentError]] = BackupCorrupt  # the scratch member's reading says ScratchError
    RANGES = {"hash": U63, "revision": U63, "total_keys": U63, "total_size": U63}


def snapshot_tool(cfg: "Config") -> List[str]:
    """The argv prefix for offline snapshot work: etcdutl when configured (3.5+), else etcdctl."""
    return [cfg.etcd.etcdutl] if cfg.etcd.etcdutl else [cfg.etcd.etcdctl]


def snapshot_status(host: "Host", cfg: "Config", path: str, timeout: float = 300.0) -> Dict[str, Any]:
    """``snapshot status -w json`` of a snapshot file: hash, revision, totalKey, totalSize.

    Raises BackupCorrupt when the tool rejects the file (bad checksum, not a bolt db).
    """
    argv = snapshot_tool(cfg) + ["snapshot", "status", path, "-w", "json"]
    try:
        res = host.run(argv, timeout=timeout, env=ETCDCTL_ENV)
    except CommandError as exc:
        detail = ""
        if exc.result is not None:
            tail = (exc.result.stderr or exc.result.stdout).strip().splitlines()[-1:]
            detail = tail[0] if tail else ""
        raise BackupCorrupt(f"snapshot {path} failed `snapshot status`: {detail or exc.message}") from None
    return read_status(path, res.stdout)


def read_status(path: str, stdout: str) -> Dict[str, Any]:
    """``snapshot status -w json``'s output about ``path``, checked as a ``SnapshotStatus`` and
    returned as the tool printed it (a manifest records it verbatim, signed: its keys are etcd's,
    a later etcd's extra key included). BackupCorrupt naming the field when it is not one."""
    try:
        data = loads(stdout, max_bytes=MAX_STATUS_OUTPUT)
    except ValueError:
        raise BackupCorrupt(f"snapshot status of {path} printed no JSON: {stdout[:200]!r}") from None
    SnapshotStatus.from_json(data, f"snapshot status of {path}")
    return dict(data)


def snapshot_restore_argv(
    cfg: "Config",
    *,
    snapshot: str,
    name: str,
    initial_cluster: str,
    token: str,
    peer_url: str,
    data_dir: str,
    bump_revision: Optional[int] = None,
    skip_hash_check: bool = False,
) -> List[str]:
    """``snapshot restore`` with one member's identity; etcdutl also gets the k8s-safe flags.
    ``skip_hash_check`` only when etcd's sha256 trailer of exactly this file was checked already
    (etcdutl would otherwise read the whole copy back once more to hash it)."""
    argv = snapshot_tool(cfg) + [
        "snapshot",
        "restore",
        snapshot,
        f"--name={name}",
        f"--initial-cluster={initial_cluster}",
        f"--initial-cluster-token={token}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--data-dir={data_dir}",
    ]
    if bump_revision is not None and cfg.etcd.etcdutl:
        argv += [f"--bump-revision={bump_revision}", "--mark-compacted"]
    if skip_hash_check:
        argv.append("--skip-hash-check")
    return argv


def version_of(host: "Host", binary: str, timeout: float = 30.0, *, tool: Optional[bool] = None) -> str:
    """The version a binary reports (``etcd --version`` / ``etcdctl version``); ``tool``: it is
    etcdctl or etcdutl (they take ``version``), by default guessed from its name."""
    tool = binary.endswith(("etcdctl", "etcdutl")) if tool is None else tool
    flag = ["version"] if tool else ["--version"]
    res = host.run([binary] + flag, timeout=timeout, env=ETCDCTL_ENV)
    for line in res.stdout.splitlines():
        low = line.lower()
        if "version:" in low and "api" not in low and "git" not in low and "go " not in low:
            return line.split(":", 1)[1].strip()
    raise CommandError(f"cannot read a version from `{binary}`: {res.stdout.strip()[:200]!r}", res)


# what each binary reports, once per process: a host's members share their tools
_VERSIONS: Dict[str, Optional[str]] = {}


def cached_version(host: "Host", binary: Optional[str]) -> Optional[str]:
    """``version_of`` asked once per binary per process; None when unset or it does not answer."""
    if not binary:
        return None
    if binary not in _VERSIONS:
        try:
            _VERSIONS[binary] = version_of(host, binary)
        except CommandError:
            _VERSIONS[binary] = None
    return _VERSIONS[binary]
