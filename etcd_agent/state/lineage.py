"""The restore lineage this host knows: which member ids the data it runs came from.

A restore makes new member ids (they are derived from the peer URLs and the new cluster token),
so a backup taken before the restore lists ids the running cluster no longer has. Each finished
restore appends the ids of the snapshot it restored (``<state_dir>/lineage.json``, newest last):
a later restore of such a backup is then recognised as this cluster's own, even with etcd down.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Annotated, List, Sequence, Set, Tuple

from etcd_agent.config import Config
from etcd_agent.errors import ProtocolError
from etcd_agent.fs import makedirs, write_atomic
from etcd_agent.safejson import UnsafeJson, loads
from etcd_agent.typedjson import Document, Items, Text

MAX_ENTRIES = 50
MAX_BYTES = 1 << 20
MAX_IDS = 64  # a snapshot's members: etcd clusters are a handful


@dataclass(frozen=True)
class LineageEntry(Document):
    """One finished restore: the member ids (hex) of the snapshot it restored."""

    member_ids: Annotated[Tuple[Annotated[str, Text(64)], ...], Items(1, MAX_IDS)]
    op: Annotated[str, Text(256)] = ""  # the restore's op id
    at: Annotated[str, Text(64)] = ""  # when it finished (UTC, ISO 8601)


def lineage_path(cfg: Config) -> str:
    return os.path.join(cfg.daemon.state_dir, "lineage.json")


def _entries(cfg: Config) -> List[LineageEntry]:
    """The entries that read, oldest first; an entry that does not (damage, a hand edit) is
    skipped, the file that does not is no entry: the lineage is evidence, never required."""
    path = lineage_path(cfg)
    try:
        with open(path, "rb") as fh:
            doc = loads(fh.read(MAX_BYTES), max_bytes=MAX_BYTES)
    except (OSError, UnsafeJson):
        return []
    out: List[LineageEntry] = []
    for i, entry in enumerate(doc if isinstance(doc, list) else []):
        try:
            out.append(LineageEntry.from_json(entry, f"{path} entry {i}"))
        except ProtocolError:
            continue
    return out


def read(cfg: Config) -> List[Set[str]]:
    """Every recorded set of ancestor member ids (hex), oldest first; [] when none or unreadable."""
    return [{x.lower() for x in e.member_ids} for e in _entries(cfg)]


def record(cfg: Config, member_ids: Sequence[str], op: str) -> None:
    """Append the snapshot's member ids of a finished restore (kept to the last MAX_ENTRIES)."""
    if not member_ids:
        return
    entries = _entries(cfg)
    entries.append(LineageEntry(tuple(sorted(x.lower() for x in member_ids)), op,
                                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    doc = [e.to_json() for e in entries[-MAX_ENTRIES:]]
    makedirs(cfg.daemon.state_dir, 0o700)
    write_atomic(lineage_path(cfg), (json.dumps(doc, indent=1) + "\n").encode(), mode=0o600)
