"""What a second operator is told a running restore is: the command as its operator typed it."""
from __future__ import annotations

import argparse

from etcd_agent.cli.restore import MAX_TYPED, as_typed


def args(**kw: object) -> argparse.Namespace:
    base: dict = {"spec": None, "bucket_spec": None, "to_newest": False, "to_revision": None, "to_time": None}  # type: ignore[type-arg]
    base.update(kw)
    return argparse.Namespace(**base)


def test_a_restore_from_the_bucket_to_a_revision_is_named_as_typed() -> None:
    assert as_typed(args(bucket_spec="latest", to_revision=545)) == "restore --from-bucket latest --to-revision 545"


def test_a_local_restore_names_the_file_not_its_dir_nor_the_replayed_db() -> None:
    assert as_typed(args(spec="/var/lib/etcd_backup/etcd-2026-12-07-12-42-31.tar", to_newest=True)) == \
        "restore --from etcd-2026-12-07-12-42-31.tar --to newest"
    assert as_typed(args(spec="2019-08-07")) == "restore --from 2019-08-07"
    assert as_typed(args(spec="latest", to_time=" 2026-12-01T10:03:00Z ")) == \
        "restore --from latest --to-time 2026-12-01T10:03:00Z"


def test_what_is_typed_is_bounded_and_printable() -> None:
    shown = as_typed(args(bucket_spec="x\n\x1b[2J" + "y" * 500))
    assert shown.startswith("restore --from-bucket x??[2J") and shown.isprintable()
    assert len(shown) == len("restore --from-bucket ") + MAX_TYPED
