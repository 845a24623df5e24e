"""The retention policy (pure): every decision and its reason."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import List

import pytest

from etcd_agent.backup.retention import BackupRef, plan, plan_checkpoints

T0 = datetime(2019, 8, 7, 13, 30, tzinfo=timezone.utc)


def refs(hours_ago: List[float], unverified: tuple = ()) -> List[BackupRef]:
    return [
        BackupRef(f"b{i}", T0 - timedelta(hours=h), verified=i not in unverified) for i, h in enumerate(hours_ago)
    ]


def kept(decisions) -> List[str]:  # type: ignore[no-untyped-def]
    return [d.name for d in decisions if d.keep]


def test_keep_last_n_only() -> None:
    ds = plan(refs([0, 1, 2, 3]), keep_last=2, keep_hourly=0, keep_daily=0)
    assert [d.name for d in ds] == ["b0", "b1", "b2", "b3"]  # newest first
    assert kept(ds) == ["b0", "b1"]
    assert ds[0].reasons[0] == "one of the last 2 (#1)"
    assert ds[0].reasons[1] == "newest verified backup (never deleted)"
    assert ds[3].reason == "not among the last 2"


def test_hourly_keeps_newest_per_hour() -> None:
    # b0 13:30, b1 13:00 (same hour), b2 12:30, b3 11:30, b4 10:30
    ds = {d.name: d for d in plan(refs([0, 0.5, 1, 2, 3]), keep_last=1, keep_hourly=3, keep_daily=0)}
    assert ds["b0"].keep and "newest of hour 2019-08-07 13:00 (hourly 1/3)" in ds["b0"].reasons
    assert not ds["b1"].keep
    assert ds["b1"].reasons == ("not among the last 1", "hour 2019-08-07 13:00 already kept by b0")
    assert ds["b2"].keep and ds["b2"].reasons == ("newest of hour 2019-08-07 12:00 (hourly 2/3)",)
    assert ds["b3"].keep and ds["b3"].reasons == ("newest of hour 2019-08-07 11:00 (hourly 3/3)",)
    assert not ds["b4"].keep
    assert "hour 2019-08-07 10:00 is older than the 3 hourly buckets kept" in ds["b4"].reasons


def test_daily_buckets_count_days_with_backups() -> None:
    # a gap of a week does not use up daily slots
    ds = {d.name: d for d in plan(refs([0, 24 * 8, 24 * 9, 24 * 10]), keep_last=1, keep_hourly=0, keep_daily=3)}
    assert kept(list(ds.values())) == ["b0", "b1", "b2"]
    assert ds["b1"].reasons == ("newest of day 2019-07-30 (daily 2/3)",)
    assert "day 2019-07-28 is older than the 3 daily buckets kept" in ds["b3"].reasons


def test_newest_verified_is_never_deleted() -> None:
    # the two newest are unverified; keep_last=1 alone would drop b2, the newest verified one
    ds = {d.name: d for d in plan(refs([0, 1, 2, 3], unverified=(0, 1)), keep_last=1, keep_hourly=0, keep_daily=0)}
    assert ds["b0"].keep and "newest verified backup (never deleted)" not in ds["b0"].reasons
    assert not ds["b1"].keep
    assert ds["b2"].keep and ds["b2"].reasons == ("newest verified backup (never deleted)",)
    assert not ds["b3"].keep


def test_every_backup_gets_a_decision_with_a_reason() -> None:
    ds = plan(refs([i * 0.7 for i in range(40)], unverified=(3, 5)), keep_last=3, keep_hourly=5, keep_daily=2)
    assert len(ds) == 40 and all(d.reasons for d in ds)
    assert ds[0].keep


def test_empty_and_invalid() -> None:
    assert plan([], keep_last=1, keep_hourly=1, keep_daily=1) == []
    with pytest.raises(ValueError):
        plan(refs([0]), keep_last=0, keep_hourly=0, keep_daily=0)


def test_the_backup_just_written_is_never_deleted() -> None:
    # b0 is unverified (e.g. its check could not be recorded) and outside every rule: still kept
    ds = {d.name: d for d in plan(refs([0, 1, 2]), keep_last=1, keep_hourly=0, keep_daily=0, protect=("b2",))}
    assert ds["b2"].keep and "the backup just written (never deleted)" in ds["b2"].reasons
    assert not ds["b1"].keep


def test_the_daemons_chain_backups_never_take_an_operators_slot() -> None:
    """After a restore the daemon took a full backup every 2 s and each one's prune pushed the
    operator's history out (keep_last 7). The daemon's backups now count among themselves."""
    operators = [BackupRef(f"hourly{i}", T0 - timedelta(hours=i + 1), verified=True) for i in range(20)]
    storm = [BackupRef(f"chain{i}", T0 + timedelta(seconds=2 * i), verified=True, origin="daemon")
             for i in range(40)]
    ds = {d.name: d for d in plan(operators + storm, keep_last=7, keep_hourly=24, keep_daily=7)}
    assert all(ds[f"hourly{i}"].keep for i in range(20)), [ds[f"hourly{i}"].reason for i in range(20)]
    assert "one of the last 7 (#1)" in ds["hourly0"].reasons
    kept_chain = [n for n in ds if n.startswith("chain") and ds[n].keep]
    assert sorted(kept_chain) == sorted(f"chain{i}" for i in range(33, 40)), kept_chain
    assert ds["chain39"].reasons[0] == "the daemon's chain backups: one of the last 7 (#1)"
    assert ds["chain0"].reason.startswith("the daemon's chain backups: not among the last 7")


def test_holds_keep_a_backup_whatever_the_rules_say() -> None:
    rs = refs([0, 1, 2, 3, 4])
    ds = {d.name: d for d in plan(rs, keep_last=1, keep_hourly=0, keep_daily=0,
                                  holds=[("b4", "the backup restore r1 came from"),
                                         ("b4", "the backup restore r1 came from")])}
    assert ds["b4"].keep and ds["b4"].reasons == ("the backup restore r1 came from",)
    assert not ds["b3"].keep


def test_checkpoints_keep_the_newest_of_each_kept_chain_and_take_no_slot() -> None:
    """A checkpoint (a full backup the daemon took inside a chain) is kept while its chain is,
    the newest ``keep`` of each; one of a chain that goes restores nothing and goes with it."""
    cps = [BackupRef(f"a{i}", T0 + timedelta(minutes=i), verified=True, origin="daemon", chain="a" * 32)
           for i in range(5)]
    cps += [BackupRef(f"b{i}", T0 + timedelta(minutes=i), verified=True, origin="daemon", chain="b" * 32)
            for i in range(3)]
    ds = {d.name: d for d in plan_checkpoints(cps, live_chains={"a" * 32}, keep=2, protect=("b0",),
                                              holds=[("a0", "the backup restore r1 came from")])}
    assert [n for n in ds if ds[n].keep] == ["a4", "a3", "b0", "a0"], {n: d.reason for n, d in ds.items()}
    assert ds["a4"].reason == f"checkpoint #1 of 2 kept of delta chain {'a' * 8}"
    assert ds["a2"].reason == f"an older checkpoint of delta chain {'a' * 8} (its newest 2 are kept)"
    assert ds["b1"].reason == f"a checkpoint of delta chain {'b' * 8}, which is pruned or gone"
    assert ds["b0"].reason == "the backup just written (never deleted)"
    assert ds["a0"].reason == "the backup restore r1 came from"
