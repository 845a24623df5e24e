"""The etcd releases the tests run on, as `packaging/install-deps.sh test` lays them out.

One list (packaging/etcd-test-releases) names each version, where it comes from and its role;
the install step reads it to fetch, this module to find. A release that is not there is a broken
install - ``release()`` fails the test saying how to fix it, it never skips.
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIST = os.path.join(REPO, "packaging", "etcd-test-releases")
VERSIONS_DIR = os.environ.get("ETCD_AGENT_TEST_VERSIONS_DIR", "/opt/etcd")


def _roles(path: str = LIST) -> Dict[str, str]:
    """role -> version, from the list."""
    out: Dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            fields = line.split("#", 1)[0].split()
            if len(fields) >= 3:
                out[fields[2]] = fields[0]
    return out


ROLES = _roles()
LEGACY: str = ROLES["legacy"]    # 3.4.23: bootstrap, backup, restore, upgrade source
DEFAULT: str = ROLES["default"]  # 3.5.16: every tier's etcd
NEWER: str = ROLES["newer"]      # 3.5.30: upgrade and restore target
ALL = (LEGACY, DEFAULT, NEWER)


@dataclass(frozen=True)
class Release:
    """One installed release: its binaries (etcdutl from 3.5 on)."""

    version: str
    dir: str
    etcd: str
    etcdctl: str
    etcdutl: Optional[str]

    @property
    def is_legacy(self) -> bool:
        return self.etcdutl is None

    def toml(self) -> str:
        """The ``[etcd]`` keys that select this release (etcdutl only when it has one, so a 3.5
        restore uses etcdutl and a 3.4 one etcdctl)."""
        lines = [f'binary = "{self.etcd}"', f'etcdctl = "{self.etcdctl}"']
        if self.etcdutl:
            lines.append(f'etcdutl = "{self.etcdutl}"')
        return "\n".join(lines) + "\n"


def version_argv(binary: str) -> List[str]:
    """How a tool says its version: ``etcd --version``, ``etcdctl version``, ``etcdutl version``."""
    return [binary, "--version"] if os.path.basename(binary) == "etcd" else [binary, "version"]


def parse_reported(out: str) -> str:
    """The version in such output ("etcd Version: 3.5.16", "etcdutl version: 3.5.16"), or ""."""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("etcd version", "etcdctl version", "etcdutl version"):
            return value.strip()
    return ""


def reported_version(binary: str) -> str:
    """What a binary here says it is; "" when it does not run."""
    try:
        out = subprocess.run(version_argv(binary), capture_output=True, text=True, timeout=30,
                             env={**os.environ, "ETCDCTL_API": "3"}).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return parse_reported(out)


_checked: Dict[str, Release] = {}


def release(version: str, versions_dir: str = VERSIONS_DIR) -> Release:
    """The installed release ``version``; fails (not skips) when it is missing or wrong."""
    key = f"{versions_dir}/{version}"
    if key in _checked:
        return _checked[key]
    d = os.path.join(versions_dir, version)
    tools = ("etcd", "etcdctl") + (() if version.startswith("3.4.") else ("etcdutl",))
    bad = []
    for t in tools:
        p = os.path.join(d, t)
        got = reported_version(p) if os.access(p, os.X_OK) else "missing"
        if got != version:
            bad.append(f"{t}: {got or 'does not run'}")
    if bad:
        pytest.fail(f"etcd {version} is not installed in {d} ({'; '.join(bad)}): "
                    "run `packaging/install-deps.sh test`", pytrace=False)
    etcdutl = os.path.join(d, "etcdutl") if "etcdutl" in tools else None
    rel = Release(version, d, os.path.join(d, "etcd"), os.path.join(d, "etcdctl"), etcdutl)
    _checked[key] = rel
    return rel
