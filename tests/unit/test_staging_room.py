"""How much of a fetch's plan is still to come (``bucket.staging.still_to_fetch``): what its
whole-plan space check weighs before anything is fetched."""
from __future__ import annotations

import os
from pathlib import Path

from etcd_agent.bucket import fetch, layout
from etcd_agent.bucket.staging import still_to_fetch


def wanted(file: str, size: int) -> fetch.Wanted:
    return fetch.Wanted(name=f"chains/{'ab' * 32}/{file}", file=file, kind=layout.FULL, size=size)


def test_a_file_already_here_counts_nothing_and_a_part_only_its_rest(tmp_path: Path) -> None:
    here, part, fresh = wanted("a.tar", 1000), wanted("b.tar", 2000), wanted("c.tar", 3000)
    (tmp_path / "a.tar").write_bytes(b"x" * 10)  # compared, not fetched: whatever its size
    os.makedirs(tmp_path / fetch.STAGING)
    (tmp_path / fetch.STAGING / "b.tar.part").write_bytes(b"y" * 1500)  # a killed run's part
    assert still_to_fetch([here, part, fresh], str(tmp_path)) == 500 + 3000


def test_a_part_longer_than_listed_counts_nothing_not_less_than_nothing(tmp_path: Path) -> None:
    os.makedirs(tmp_path / fetch.STAGING)
    (tmp_path / fetch.STAGING / "b.tar.part").write_bytes(b"y" * 5000)
    assert still_to_fetch([wanted("b.tar", 2000), wanted("c.tar", 7)], str(tmp_path)) == 7
