"""The daemon's newest full backup holds the cluster's current membership: a cluster bootstrapped
incrementally (the seed alone, then `member add` + start with state=existing) gets a full backup
of the grown layout once the member has joined, so `restore --from latest` is not refused as
another layout for as long as the first backup's chain runs. Real etcd 3.5.16 on loopback, a real
`etcd-agent run` daemon on the seed."""
from __future__ import annotations

import os
import time
from typing import FrozenSet, List

import pytest

from etcd_agent.backup.reader import peek_archive
from etcd_agent.continuous.status import read_breaks
from etcd_agent.errors import OperationFailed
from etcd_agent.etcd.client import EtcdClient
from tests.harness.loopback import LoopbackCluster
from tests.integration.continuous import agent, delta_extra, full_backups, wait_for, wait_watching
from tests.integration.test_daemon import Daemons

pytestmark = pytest.mark.integration


def snapshot_ids(path: str) -> FrozenSet[int]:
    """The member ids a backup's snapshot lists, read from its own db."""
    ident = peek_archive(path).identity
    assert ident is not None, f"{path}: its snapshot was not read (a plain tar is expected here)"
    return frozenset(m.id for m in ident.members)


def test_a_member_that_joins_after_the_first_full_backup_gets_a_full_backup_with_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    directory = str(tmp_path / "c")
    os.makedirs(os.path.join(directory, "textfile"), exist_ok=True)
    c = LoopbackCluster(directory, 2, bootstrap="incremental", extra=delta_extra(directory))
    d = Daemons(c)
    try:
        d.start("m1")  # the seed: it bootstraps a cluster of one and backs it up at once
        base = wait_watching(c)
        [first] = full_backups(c)
        with EtcdClient.from_config(c.cfg, endpoints=[c.cfg.members[0].client_url]) as cl:
            assert len(cl.members()) == 1
        assert len(snapshot_ids(os.path.join(c.cfg.backup.dir, first))) == 1
        refused = agent(c, "restore", "--from", "latest", "--dry-run")
        assert refused.returncode == 3 and "another cluster layout" in refused.stdout + refused.stderr, (
            refused.stdout + refused.stderr)

        # m2 joins by hand, as `member add` then a start with state=existing: not a KV event
        with EtcdClient.from_config(c.cfg, endpoints=[c.cfg.members[0].client_url]) as cl:
            c.members[1].join(cl)
        c.members[1].wait_healthy(30)
        with EtcdClient.from_config(c.cfg, endpoints=[c.cfg.members[0].client_url]) as cl:
            both = frozenset(m.id for m in cl.members())
        assert len(both) == 2

        def grown() -> List[str]:
            return [n for n in full_backups(c) if n != first
                    and snapshot_ids(os.path.join(c.cfg.backup.dir, n)) == both]

        try:
            [second] = wait_for(grown, 60, "a full backup whose snapshot lists both members")
            # the chain of the first one ends there, and says why (a restore names it)
            ended = wait_for(lambda: [b for b in read_breaks(c.cfg.backup.dir)[1] if b.base_revision == base], 30,
                             "the end of the first chain recorded")
        except OperationFailed as exc:
            raise AssertionError(f"{exc.message}; backups {full_backups(c)}; daemon:\n{d.log('m1')[-6000:]}") from None
        assert ended[-1].reason == "membership changed: member m2 added", ended
        print(f"\nFIGURE membership: {first} (1 member) then {second} (2 members)")
        said = [ln for ln in d.log("m1").splitlines() if "membership" in ln]
        assert any("membership changed: member m2 added" in ln for ln in said), d.log("m1")[-4000:]
        print("\n".join(said))

        ok = agent(c, "restore", "--from", "latest", "--dry-run")
        out = ok.stdout + ok.stderr
        assert "another cluster layout" not in out and ok.returncode == 0, out

        # and no loop: the membership the new backup holds is the cluster's; a few cycles later
        # there is still exactly one backup of it
        time.sleep(5)
        assert [n for n in full_backups(c) if n != first] == [second], full_backups(c)
    finally:
        d.stop()
        c.stop()



def test_a_learner_added_but_not_started_is_waited_for_then_backed_up_as_a_member(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`member add --learner` without a start is a half-done change (etcd lists it without a
    name): no full backup of it while it stays so (the chain goes on); once it has started, a
    full backup lists it (a learner is a member of the layout)."""
    from etcd_agent.member.local import add_member_idempotent

    directory = str(tmp_path / "c")
    os.makedirs(os.path.join(directory, "textfile"), exist_ok=True)
    c = LoopbackCluster(directory, 2, bootstrap="incremental", extra=delta_extra(directory))
    d = Daemons(c)
    seed = [c.cfg.members[0].client_url]
    try:
        d.start("m1")
        wait_watching(c)
        [first] = full_backups(c)
        with EtcdClient.from_config(c.cfg, endpoints=seed) as cl:
            added = add_member_idempotent(cl, c.cfg.members[1], learner=True)
        wait_for(lambda: "half-done" in d.log("m1"), 30, "the supervisor seeing the half-done change")
        time.sleep(5)  # cycles of 1 s: none of them takes a backup of the half-done layout
        assert full_backups(c) == [first], full_backups(c)

        with EtcdClient.from_config(c.cfg, endpoints=seed) as cl:
            c.members[1].join(cl, learner=True)  # already listed: rendered state=existing and started

        def named() -> bool:  # a learner serves no reads: started is when it has published its name
            with EtcdClient.from_config(c.cfg, endpoints=seed) as cl:
                return any(m.id == added.id and m.name for m in cl.members())

        wait_for(named, 30, "the learner started")
        ids = frozenset({added.id} | snapshot_ids(os.path.join(c.cfg.backup.dir, first)))
        try:
            wait_for(lambda: [n for n in full_backups(c) if n != first
                              and snapshot_ids(os.path.join(c.cfg.backup.dir, n)) == ids], 60,
                     "a full backup whose snapshot lists the learner")
        except OperationFailed as exc:
            raise AssertionError(f"{exc.message}; backups {full_backups(c)}; daemon:\n{d.log('m1')[-6000:]}") from None
        print("\n" + "\n".join(ln for ln in d.log("m1").splitlines() if "membership" in ln))
    finally:
        d.stop()
        c.stop()
