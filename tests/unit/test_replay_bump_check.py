"""A replay needs etcdutl's --bump-revision: which etcdutl may run it is read from the binary itself,
before anything starts, and every other answer is refused in one sentence."""
from __future__ import annotations

import os

import pytest

from etcd_agent.chain.errors import ReplayError
from etcd_agent.pitr.replayrun import _check_bump
from etcd_agent.scratch.member import EtcdBinaries, ScratchOptions


def etcdutl(tmp_path, name: str, body: str) -> ScratchOptions:  # type: ignore[no-untyped-def]
    """A stand-in etcdutl that answers ``version`` with ``body`` (a shell fragment) and fails anything else."""
    path = str(tmp_path / name)
    with open(path, "w") as fh:
        fh.write(f"#!/bin/sh\n[ \"$1\" = version ] || exit 2\n{body}\n")
    os.chmod(path, 0o755)
    return ScratchOptions(binaries=EtcdBinaries(etcdutl=path))


def test_an_etcdutl_that_bumps_revisions_may_run_the_replay(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _check_bump(etcdutl(tmp_path, "new", "echo 'etcdutl version: 3.5.16'; echo 'API version: 3.5'"))


@pytest.mark.parametrize("name, body, said", [
    ("old", "echo 'etcdutl version: 3.5.9'; echo 'API version: 3.5'", "is 3.5.9"),
    ("mute", "echo 'nothing to say'", "of an unknown version"),
    ("failing", "echo 'etcdutl version: 3.5.16'; exit 3", "cannot run"),
])
def test_any_other_etcdutl_is_refused_naming_what_it_is(tmp_path, name: str, body: str, said: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ReplayError, match=said):
        _check_bump(etcdutl(tmp_path, name, body))


def test_a_missing_etcdutl_is_refused_naming_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    absent = str(tmp_path / "absent")
    with pytest.raises(ReplayError, match=f"cannot run {absent} version"):
        _check_bump(ScratchOptions(binaries=EtcdBinaries(etcdutl=absent)))
