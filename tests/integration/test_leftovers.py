"""What a killed point-in-time replay leaves on the host: its throwaway etcd still running in
``<backup dir>/.pitr``. The next replay's lock stops those etcds (found by working directory,
real processes) and removes their dirs - and nothing else: an etcd elsewhere, a symlink into
it and a kept replay stay."""
from __future__ import annotations

import os

import pytest

from etcd_agent.pitr import workdirs
from tests.harness.loopback import orphan_etcd
from tests.harness.releases import DEFAULT, release

pytestmark = pytest.mark.integration


def test_the_next_replay_stops_the_etcd_a_killed_one_left_and_nothing_else(cluster_factory, tmp_path):
    c = cluster_factory(1)
    binary = release(DEFAULT).etcd
    d = workdirs.pitr_dir(c.cfg)
    os.makedirs(d, mode=0o700)
    scratch = orphan_etcd(os.path.join(d, "etcd-scratch-dead"), binary)
    replay = orphan_etcd(os.path.join(d, "etcd-replay-dead", "below"), binary)
    elsewhere = str(tmp_path / "elsewhere")
    bystander = orphan_etcd(elsewhere, binary)
    os.symlink(elsewhere, os.path.join(d, "etcd-scratch-link"))
    kept = os.path.join(d, "etcd-2026-12-01-10-00-00.to-rev-42.db")
    with open(kept, "wb") as fh:
        fh.write(b"a kept replay")
    try:
        held = workdirs.lock(c.cfg)  # taken, and the sweep done, when it returns
        try:
            assert scratch.wait(30) is not None and replay.wait(30) is not None
            assert bystander.poll() is None, "an etcd outside the replay dirs was stopped"
            assert sorted(os.listdir(d)) == sorted([".lock", "etcd-scratch-link", os.path.basename(kept)])
            assert os.path.isdir(os.path.join(elsewhere, "data")), "the sweep followed a symlink"
        finally:
            held.release()
    finally:
        for p in (scratch, replay, bystander):
            if p.poll() is None:
                p.kill()
                p.wait(10)
