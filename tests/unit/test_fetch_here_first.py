"""Two masters' folders in the bucket hold backups of the same second under the same name; the one
whose name a different backup already holds in this backup dir is chosen last (``fetch.here_first``),
since the fetch never overwrites a different file and would refuse the restore. Real archives of
tests/data's snapshots: two of cluster "a" at revision 3 with different bytes."""
from __future__ import annotations

import hashlib
import os
from datetime import datetime, timezone
from typing import Any

from etcd_agent.backup import archive
from etcd_agent.bucket.fetch import here_first
from etcd_agent.bucket.remote import RemoteObject
from etcd_agent.config import parse_text

from .test_pitr_hostile_chains import DATA, FULL, FULL_MS, SNAP, SNAP_SHA, build

SNAP34 = open(os.path.join(DATA, "snap-a-34.db"), "rb").read()
SNAP34_SHA = hashlib.sha256(SNAP34).hexdigest()
WHEN = datetime.fromtimestamp(FULL_MS // 1000, timezone.utc)


def copy(folder: str, chain: str, name: str = FULL) -> RemoteObject:
    return RemoteObject(name=name, key=f"p/{folder}/chains/{chain}/{name}", size=1, time=WHEN, last_modified=WHEN,
                        sha256="0" * 64, chain=chain, folder=folder)


def config(tmp_path: Any) -> Any:
    d = tmp_path / "backups"
    d.mkdir(mode=0o700)
    cfg, errors = parse_text(f'[cluster]\nname = "a"\n[backup]\ndir = "{d}"\n[daemon]\nstate_dir = "{tmp_path}/s"\n'
                             '[[member]]\nname = "m1"\nhost = "127.0.0.1"\npeer_url = "http://127.0.0.1:17380"\n'
                             'client_url = "http://127.0.0.1:17379"\n')
    assert cfg is not None, errors
    return cfg


def here(cfg: Any, snap: bytes) -> None:
    archive.write_archive(cfg.backup.dir, FULL, chunks=iter([snap]), files={"etcd.conf": b"ETCD_NAME=m1\n"},
                          build_manifest=build, mtime=FULL_MS // 1000)


def test_the_copy_whose_name_another_backup_holds_here_comes_last(tmp_path: Any) -> None:
    cfg = config(tmp_path)
    here(cfg, SNAP34)  # ew2's backup of that second, fetched by an earlier restore
    mine, theirs = copy("ew1", SNAP_SHA), copy("ew2", SNAP34_SHA)
    assert [o.folder for o in here_first(cfg, [mine, theirs])] == ["ew2", "ew1"]


def test_the_very_backup_here_or_a_free_name_keeps_the_order(tmp_path: Any) -> None:
    cfg = config(tmp_path)
    mine, theirs = copy("ew1", SNAP_SHA), copy("ew2", SNAP34_SHA)
    assert [o.folder for o in here_first(cfg, [mine, theirs])] == ["ew1", "ew2"]  # nothing here
    here(cfg, SNAP)  # the very backup ew1's folder holds
    assert [o.folder for o in here_first(cfg, [mine, theirs])] == ["ew1", "ew2"]


def test_a_name_only_one_copy_has_is_never_moved(tmp_path: Any) -> None:
    cfg = config(tmp_path)
    here(cfg, SNAP34)  # a different backup under the newest copy's name: the fetch refuses it, said
    newest, older = copy("ew1", SNAP_SHA), copy("ew1", SNAP_SHA, "etcd-2019-08-07-12-00-00.tar")
    assert here_first(cfg, [newest, older]) == [newest, older]
