"""The newest full backup a chain continues, as the supervisor looks it up each tick
(``continuous.newestfull``), on a backup dir of real archives (tests/data snapshot) with a clock
of the test's: the catalog read again when the listing changes, else only every RESCAN_EVERY s
or when asked."""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Tuple

from etcd_agent.config import Config, parse_text
from etcd_agent.continuous.newestfull import RESCAN_EVERY, NewestFull
from tests.unit.test_catalog import T0, backup_at


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def setup(tmp_path: Path) -> Tuple[Config, NewestFull, Clock]:
    d = tmp_path / "backups"
    # the layout of the tests/data snapshot the archives hold (another would quarantine them as foreign)
    members = "".join(f'[[member]]\nname = "m{i}"\nhost = "127.0.0.1"\nclient_url = "http://127.0.0.1:{p + 1000}"\n'
                      f'peer_url = "http://127.0.0.1:{p}"\n' for i, p in ((1, 17380), (2, 17382), (3, 17384)))
    cfg, errors = parse_text(f'[cluster]\nname = "a"\ntoken = "tok-a"\n{members}[backup]\ndir = "{d}"\n')
    assert cfg is not None, errors
    clock = Clock()
    return cfg, NewestFull(clock), clock


def test_no_backup_dir_or_no_backup_is_none(tmp_path: Path) -> None:
    cfg, finder, _ = setup(tmp_path)
    assert finder.look(cfg) == (None, "")
    os.makedirs(cfg.backup.dir)
    assert finder.look(cfg) == (None, "")


def test_the_newest_good_backup_and_a_new_one_seen_at_once(tmp_path: Path) -> None:
    cfg, finder, _ = setup(tmp_path)
    os.makedirs(cfg.backup.dir)
    backup_at(cfg.backup.dir, T0)
    newer = backup_at(cfg.backup.dir, T0 + timedelta(hours=1))
    full, unusable = finder.look(cfg)
    assert full is not None and unusable == "" and full.path == newer and full.revision == 3 and len(full.member_ids) == 3
    # a full backup written since (the listing changed): found at the next look, the clock unmoved
    newest = backup_at(cfg.backup.dir, T0 + timedelta(hours=2))
    full, _ = finder.look(cfg)
    assert full is not None and full.path == newest


def spoil_in_place(path: str) -> None:
    """The file's bytes changed under the same name and mtime: no change in the dir's listing."""
    st = os.stat(path)
    with open(path, "wb") as fh:
        fh.write(b"\0" * 512 + b"garbage")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_unchanged_listing_is_read_again_only_after_rescan_every_or_when_asked(tmp_path: Path) -> None:
    cfg, finder, clock = setup(tmp_path)
    os.makedirs(cfg.backup.dir)
    older = backup_at(cfg.backup.dir, T0)
    newer = backup_at(cfg.backup.dir, T0 + timedelta(hours=1))
    assert finder.look(cfg)[0].path == newer  # type: ignore[union-attr]
    spoil_in_place(newer)
    clock.now += RESCAN_EVERY - 1
    assert finder.look(cfg)[0].path == newer, "an idle tick reads no archive"  # type: ignore[union-attr]
    clock.now += 1
    assert finder.look(cfg)[0].path == older, "read again each RESCAN_EVERY s"  # type: ignore[union-attr]
    # asked to look again (a full backup was just taken): read at once, the listing and clock unchanged
    spoil_in_place(older)
    assert finder.look(cfg)[0].path == older  # type: ignore[union-attr]
    finder.again()
    assert finder.look(cfg) == (None, "")
