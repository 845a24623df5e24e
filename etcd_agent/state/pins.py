"""Which etcd binary a member runs after a rolling upgrade: the version pin.

Releases live side by side in ``<versions_dir>/<version>/{etcd,etcdctl,etcdutl}``. An upgrade
does not edit the operator's agent.toml; it records per member ``<state_dir>/<member>.binary.json``
(``{"version", "binary", "etcdctl", "etcdutl", "previous"}``). ``pinned_config`` applies it, so
every later render of the unit (ExecStart=) and every start by the process backend or the daemon
uses the upgraded binary, and a reboot never silently downgrades a member. A pin whose binary has
gone missing is ignored with a warning (the configured binary is the fallback the operator set).
``pinned_binary`` is what the rendered unit's ExecStart= runs: read at render time, so a
long-running daemon holding a config from before the upgrade never renders the old binary back.

While one member is stepped, ``<state_dir>/upgrade-in-progress-<member>.json`` (pid and start
time of the stepping process) tells the daemon to keep its hands off: the step stops etcd on
purpose. A marker whose process is gone is stale (the step died): removed, the daemon heals again.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

from etcd_agent.config import Config, merged
from etcd_agent.errors import ProtocolError
from etcd_agent.fs import makedirs, write_atomic
from etcd_agent.safejson import loads
from etcd_agent.typedjson import Document

log = logging.getLogger(__name__)

MAX_PIN = 65536


def pin_path(cfg: Config, member: str) -> str:
    return os.path.join(cfg.daemon.state_dir, f"{member}.binary.json")


def release_dir(cfg: Config, version: str) -> str:
    return os.path.join(cfg.etcd.versions_dir, version)


def release_tools(cfg: Config, version: str) -> Dict[str, Optional[str]]:
    """``binary``/``etcdctl``/``etcdutl`` paths of one installed release (etcdutl only if present)."""
    d = release_dir(cfg, version)
    etcdutl = os.path.join(d, "etcdutl")
    return {
        "binary": os.path.join(d, "etcd"),
        "etcdctl": os.path.join(d, "etcdctl"),
        "etcdutl": etcdutl if os.path.exists(etcdutl) else None,
    }


@dataclass(frozen=True)
class Pin(Document):
    """``<member>.binary.json``: the release a member runs since an upgrade (only ``binary`` required)."""

    binary: str
    version: Optional[str] = None
    etcdctl: Optional[str] = None
    etcdutl: Optional[str] = None
    previous: Optional[str] = None  # the binary it ran before
    since: Optional[str] = None


def read_pin(cfg: Config, member: str) -> Optional[Pin]:
    """The member's pin; None when there is none or it is unusable (the configured binary runs)."""
    path = pin_path(cfg, member)
    try:
        with open(path, "rb") as fh:
            return Pin.from_json(loads(fh.read(MAX_PIN + 1), max_bytes=MAX_PIN), f"version pin {path}")
    except FileNotFoundError:
        return None
    except ProtocolError as exc:
        log.warning("%s: malformed %s: using the configured binary", member, exc.message)
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable version pin %s (%s): using the configured binary", member, path, exc)
        return None


def write_pin(cfg: Config, member: str, version: str, tools: Dict[str, Optional[str]], previous: str) -> None:
    makedirs(cfg.daemon.state_dir, 0o700)
    _write(cfg, member, Pin(tools["binary"] or "", version, tools.get("etcdctl"), tools.get("etcdutl"), previous,
                            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))


def restore_pin(cfg: Config, member: str, old: Optional[Pin]) -> None:
    """Put back the pin as it was before a failed step (None: no pin, the configured binary)."""
    if old is None:
        try:
            os.unlink(pin_path(cfg, member))
        except FileNotFoundError:
            pass
        return
    _write(cfg, member, old)


def _write(cfg: Config, member: str, rec: Pin) -> None:
    write_atomic(pin_path(cfg, member), (json.dumps(rec.to_json(), indent=1) + "\n").encode(), mode=0o600)


def pinned_binary(cfg: Config, member: str) -> str:
    """The etcd binary the member runs: the pinned one when usable, else the configured one."""
    return pinned_config(cfg, member).etcd.binary


def pinned_config(cfg: Config, member: str) -> Config:
    """``cfg`` with the member's pinned binaries, or ``cfg`` itself when there is no usable pin."""
    rec = read_pin(cfg, member)
    if rec is None:
        return cfg
    binary = rec.binary
    if not os.path.isfile(binary):
        log.warning("%s: pinned etcd %s is missing: using the configured %s", member, binary, cfg.etcd.binary)
        return cfg
    repl: Dict[str, Any] = {"binary": binary}
    for tool, path in (("etcdctl", rec.etcdctl), ("etcdutl", rec.etcdutl)):
        if path is not None and os.path.isfile(path):
            repl[tool] = path
    return merged(cfg, etcd=repl)
