"""The pure parts of `backup fetch`: which bucket names are fetched, which backup a word selects,
in which order a chain's objects come."""
from __future__ import annotations

import os
import stat
from datetime import datetime
from pathlib import Path

import pytest

from etcd_agent.bucket import layout
from etcd_agent.bucket.fetch import STAGING, Wanted, local_file, order, select, staging_locked
from etcd_agent.bucket.remote import RemoteObject
from etcd_agent.errors import BackupCorrupt, BusyError, RefusedError, UsageError

KEY = "cd" * 32


def _obj(name: str, chain: str = KEY) -> RemoteObject:
    return RemoteObject(name=name, key="p/" + name, size=10, time=datetime.strptime(name[5:24], "%Y-%m-%d-%H-%M-%S"),
                        last_modified=None, sha256="0" * 64, chain=chain)


@pytest.mark.parametrize("name,want", [
    (f"chains/{KEY}/etcd-2026-03-01-10-00-00.tar", ("etcd-2026-03-01-10-00-00.tar", layout.FULL)),
    (f"chains/{KEY}/checkpoints/etcd-2026-03-01-10-05-00.tar", ("etcd-2026-03-01-10-05-00.tar", layout.CHECKPOINT)),
    (f"chains/{KEY}/etcd-delta-5-9-20260301T100000Z.seg", ("etcd-delta-5-9-20260301T100000Z.seg", layout.SEGMENT)),
    ("delta-0000000000000005/etcd-delta-5-9-20260301T100000Z.seg", ("etcd-delta-5-9-20260301T100000Z.seg",
                                                                     layout.SEGMENT)),
    ("etcd-2026-03-01-10-00-00.tar", ("etcd-2026-03-01-10-00-00.tar", layout.FULL)),
])
def test_names_of_ours_map_to_a_plain_file_name(name: str, want: object) -> None:
    assert local_file(name) == want


@pytest.mark.parametrize("name", [
    f"chains/{KEY}/../x", f"chains/{KEY}/../../etc/passwd", "/etc/passwd", f"chains/{KEY}/notes.txt",
    f"chains/{KEY}/checkpoints/etcd-delta-5-9-20260301T100000Z.seg", f"chains/{KEY}/.etcd-2026-03-01-10-00-00.tar",
    f"chains/{KEY}/x/etcd-2026-03-01-10-00-00.tar", "chains/NOTAKEY/etcd-2026-03-01-10-00-00.tar", "", "..",
])
def test_anything_else_is_refused(name: str) -> None:
    with pytest.raises(BackupCorrupt, match="is not a backup, a checkpoint or a segment of ours"):
        local_file(name)


def test_select_by_the_restore_words() -> None:
    newest, older, oldest = (_obj("etcd-2026-03-02-09-00-00.tar"), _obj("etcd-2026-03-01-13-00-00.tar"),
                             _obj("etcd-2026-03-01-10-00-00.tar"))
    objs = [newest, older, oldest]
    assert select(objs, "latest") is newest
    assert select(objs, "2026-03-01") is older
    assert select(objs, "2026-03-01-10") is oldest
    assert select(objs, "etcd-2026-03-01-10-00-00.tar") is oldest
    legacy = _obj("etcd-2026-03-01-10-00-00.tar", chain="")
    assert select([newest, older, legacy, oldest], "etcd-2026-03-01-10-00-00.tar") is oldest  # chains/ first
    with pytest.raises(UsageError, match="no backup from 2026-04 in the bucket"):
        select(objs, "2026-04")
    with pytest.raises(UsageError, match="not a backup in the bucket"):
        select(objs, "../etcd-2026-03-01-10-00-00.tar")
    with pytest.raises(UsageError, match="holds no full backup"):
        select([], "latest")


def test_the_full_backup_first_then_checkpoints_then_segments_by_revision() -> None:
    seg = [Wanted(f"n{i}", f"etcd-delta-{a}-{b}-20260301T100000Z.seg", layout.SEGMENT, 1)
           for i, (a, b) in enumerate([(100, 150), (9, 99), (151, 160)])]
    cp = Wanted("c", "etcd-2026-03-01-10-05-00.tar", layout.CHECKPOINT, 1)
    full = Wanted("f", "etcd-2026-03-01-10-00-00.tar", layout.FULL, 1)
    assert [w.name for w in order([*seg, cp, full])] == ["f", "c", "n1", "n0", "n2"]


def test_two_fetches_into_one_backup_dir_do_not_interleave(tmp_path: Path) -> None:
    """A second fetch into the same dir is busy (exit 4) rather than writing the same parts."""
    directory = str(tmp_path / "backups")
    with staging_locked(directory) as staging:
        assert staging == os.path.join(directory, STAGING)
        assert stat.S_IMODE(os.stat(staging).st_mode) == 0o700
        with pytest.raises(BusyError, match="another `backup fetch` is writing into"):
            with staging_locked(directory):
                pass  # pragma: no cover
    with staging_locked(directory):  # released with the first
        pass


def test_a_backup_dated_in_the_future_is_never_latest_and_named_is_refused_before_a_fetch() -> None:
    """A clock that jumped ahead once named a backup in the future: the local catalog does not
    trust it, and neither does the bucket's choice (fetching it first would only end in the same
    refusal, after the download)."""
    now = datetime(2026, 3, 3, 12, 0, 0)
    ahead, newest, older = (_obj("etcd-2099-01-01-00-00-00.tar"), _obj("etcd-2026-03-02-09-00-00.tar"),
                            _obj("etcd-2026-03-01-13-00-00.tar"))
    objs = [ahead, newest, older]
    assert select(objs, "latest", now=now) is newest
    assert select(objs, "2026-03", now=now) is newest
    with pytest.raises(RefusedError, match="dated in the future by its name"):
        select(objs, "etcd-2099-01-01-00-00-00.tar", now=now)
    with pytest.raises(UsageError, match="dated in the future"):
        select([ahead], "latest", now=now)
