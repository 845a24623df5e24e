"""The newest good full backup on this host, the one a delta chain continues, as the supervisor
looks it up every tick: the catalog is read again only when the backup dir's listing changes
(names and mtimes) or ``RESCAN_EVERY`` s have passed (a verify's record changes no listing), so
an idle tick reads no archive."""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, Tuple

from etcd_agent.chain import chains
from etcd_agent.chain.segments import parse_name
from etcd_agent.config import Config
from etcd_agent.continuous.decision import Full

RESCAN_EVERY = 60.0  # the newest full backup is looked up again at least this often


class NewestFull:
    """``look(cfg)`` -> (the newest full backup, or None; why the newest good one cannot be a
    chain's base, "" if it can); ``again()``: the next look reads the catalog whatever the listing."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._key: object = None
        self._at = clock() - RESCAN_EVERY
        self._found: Tuple[Optional[Full], str] = (None, "")

    def again(self) -> None:
        self._key = None

    def look(self, cfg: Config) -> Tuple[Optional[Full], str]:
        directory = cfg.backup.dir
        try:
            names = sorted(n for n in os.listdir(directory) if not n.startswith(".") and parse_name(n) is None)
            key = tuple((n, os.stat(os.path.join(directory, n)).st_mtime_ns) for n in names)
        except FileNotFoundError:
            self._found = (None, "")
            return self._found
        except OSError:
            key = None
        if key == self._key and self._clock() - self._at < RESCAN_EVERY:
            return self._found
        from etcd_agent.backup import catalog, keys

        entries = catalog.list_backups(directory, utc=cfg.backup.utc, cfg=cfg, key=keys.local_key(cfg).key)
        if any(e.signature != "valid" for e in entries):  # a checkpoint's unsigned manifest: its chain says
            entries = catalog.chain_checkpoints(entries, chains.scan(directory))
        # a checkpoint is taken inside the running chain: never a base to move a chain to
        best, _skipped = catalog.latest([e for e in entries if not e.checkpoint_of])
        self._key, self._at = key, self._clock()
        if best is None:
            self._found = (None, "")
        elif best.revision is None:
            self._found = (None, f"{best.name}: its revision is not known without reading it (compressed, unchecked)")
        else:
            self._found = (Full(best.name, best.path, best.revision, best.time.timestamp(),
                                best.snapshot_sha256 or "", best.size, best.member_ids), "")
        return self._found
