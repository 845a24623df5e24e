"""The flags a throwaway etcd gets only where its release lists them (``etcd --help``)."""
from __future__ import annotations

import os

from etcd_agent.scratch.machine import etcd_flags
from etcd_agent.scratch.member import EtcdBinaries, ScratchEtcd, ScratchOptions


def fake_etcd(path: str, help_text: str) -> str:
    """A stand-in binary that prints ``help_text`` for --help and fails anything else (fails closed)."""
    with open(path, "w") as fh:
        fh.write("#!/bin/sh\n[ \"$1\" = --help ] || exit 2\ncat <<'EOF'\n" + help_text + "\nEOF\n")
    os.chmod(path, 0o755)
    return path


def argv_with(tmp_path, help_text: str) -> list:  # type: ignore[no-untyped-def,type-arg]
    binary = fake_etcd(str(tmp_path / f"etcd-{len(help_text)}"), help_text)
    s = ScratchEtcd(ScratchOptions(binaries=EtcdBinaries(etcd=binary), parent_dir=str(tmp_path)))
    try:
        return s._etcd_argv()
    finally:
        s.stop()


def test_the_compaction_batch_flag_only_for_a_release_that_lists_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    listed = "Usage:\n  --name 'default'\n  --experimental-compaction-batch-limit 1000\n    sets the batch\n"
    assert "--experimental-compaction-batch-limit=100000" in argv_with(tmp_path, listed)
    old = "Usage:\n  --name 'default'\n  --quota-backend-bytes 0\n"
    assert not [a for a in argv_with(tmp_path, old) if a.startswith("--experimental-compaction")]


def test_a_binary_that_cannot_be_listed_gets_no_optional_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert etcd_flags(str(tmp_path / "absent")) == frozenset()
    broken = str(tmp_path / "broken")
    with open(broken, "w") as fh:
        fh.write("#!/bin/sh\nexit 1\n")
    os.chmod(broken, 0o755)
    assert etcd_flags(broken) == frozenset()
