"""Continuous backup's pure parts: the supervisor's decision, the chain prune plan, the status
(RPO, lag) and its metrics, the break record, [backup.delta] validation, the restore flags."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.pitr.replay import Target

import pytest

from etcd_agent.chain.chains import ChainSummary, FullRef, Scan, plan_prune
from etcd_agent.config import parse_text
from etcd_agent.continuous.decision import Facts, Full, decide
from etcd_agent.continuous.status import (
    BreakRecord,
    DeltaCollector,
    DeltaStatus,
    read_breaks,
    record_break,
    textfile_path,
)
from etcd_agent.errors import UsageError

BASE = """
[cluster]
name = "c"
[[member]]
name = "a"
host = "10.0.0.1"
"""

FULL = Full("etcd-2026-12-01-10-00-00.tar", "/b/etcd-2026-12-01-10-00-00.tar", 100, 1_800_000_000.0)


def facts(**kw: Any) -> Facts:
    d: Dict[str, Any] = {"enabled": True, "restore_in_progress": False, "newest": FULL, "newest_unusable": "",
                             "watching_base": 100, "broken": "", "over_bounds": "", "retry_wait": False}
    d.update(kw)
    return Facts(**d)


@pytest.mark.parametrize("kw, action, words", [
    ({}, "none", "watching"),
    ({"watching_base": None}, "start", "watching from etcd-2026-12-01-10-00-00.tar"),
    ({"enabled": False}, "stop", "disabled"),
    ({"enabled": False, "watching_base": None}, "none", "disabled"),
    ({"restore_in_progress": True}, "stop", "hands off"),
    ({"restore_in_progress": True, "broken": "the chain broke"}, "stop", "hands off"),  # no backup during a restore
    ({"newest": None, "watching_base": None}, "backup", "no full backup"),
    ({"broken": "the chain broke", "watching_base": None}, "backup", "the chain broke: a full backup now"),
    ({"broken": "f is older than etcd's history", "watching_base": None}, "backup", "older than etcd's history"),
    ({"broken": "the chain broke", "watching_base": None, "retry_wait": True}, "wait", "failed"),
    ({"newest": Full("n", "/b/n", 150, 0.0)}, "rebase", "newer"),
    ({"over_bounds": "max_chain_events (9 > 8)"}, "backup", "passed max_chain_events"),
    ({"newest": None, "newest_unusable": "compressed", "watching_base": None}, "backup", "no full backup"),
    ({"checkpoint_due": "the chain grew by 9 bytes"}, "checkpoint", "the chain grew by 9 bytes: a checkpoint"),
    # a bound passed ends the chain: a checkpoint inside it would be wasted
    ({"checkpoint_due": "grew", "over_bounds": "max_chain_events (9 > 8)"}, "backup", "passed max_chain_events"),
    ({"checkpoint_due": "grew", "newest": Full("n", "/b/n", 150, 0.0)}, "rebase", "newer"),
    ({"checkpoint_due": "grew", "restore_in_progress": True}, "stop", "hands off"),
])
def test_decide(kw: Dict[str, Any], action: str, words: str) -> None:
    got, why = decide(facts(**kw))
    assert got == action and words in why, (got, why)


def chain(base: int, paths: int = 2, events: int = 10) -> ChainSummary:
    return ChainSummary(base, tuple(f"/b/etcd-delta-{base + 1:016d}-{base + i:016d}-x.seg" for i in range(paths)),
                        paths, base + events, 1, 2, events, events, 100)


def test_chain_prune_plan_keeps_a_chain_with_its_full_backup() -> None:
    scan = Scan((chain(10), chain(20), chain(30), chain(40), chain(50)),
                (("/b/etcd-delta-0000000000000001-0000000000000005-20261201T100000.000Z.seg", "bad digest"),
                 ("/b/etcd-delta-0000000000000045-0000000000000049-20261201T100000.000Z.seg", "bad digest")))
    fulls = [FullRef("f20", 20, True), FullRef("f10", 10, False, reason="not among the last 1"),
             FullRef("q30", 30, True, good=False)]
    by = {d.base_revision: d for d in plan_prune(scan, fulls, active=50)}
    assert by[20].keep and "continues f20" in by[20].reason
    assert not by[10].keep and "its full backup f10 is pruned (not among the last 1)" in by[10].reason
    assert by[30].keep, "the chain of a quarantined backup stays with it"
    assert not by[40].keep and "orphaned" in by[40].reason
    assert by[50].keep and "being written" in by[50].reason
    unreadable = [d for d in plan_prune(scan, fulls, active=50) if d.base_revision == -1]
    gone = next(d for d in unreadable if not d.keep)
    kept = next(d for d in unreadable if d.keep)
    assert gone.paths == (scan.unreadable[0][0],) and "before the oldest kept full backup" in gone.reason
    assert kept.paths == (scan.unreadable[1][0],)


def test_chain_prune_plan_with_two_backups_at_one_revision() -> None:
    # an idle cluster: two full backups at the same revision share the chain; one kept keeps it
    d = plan_prune(Scan((chain(7),)), [FullRef("old", 7, False), FullRef("new", 7, True)])
    assert d[0].keep and "continues new" in d[0].reason


def status(**kw: Any) -> DeltaStatus:
    d: Dict[str, Any] = {"enabled": True, "state": "watching", "full_backup_time": 1000.0, "captured_revision": 50,
                             "durable_revision": 50, "durable_time": 1090.0, "covered_time": 1098.0, "newest_event_time": 1089.0,
                             "member_revision": 50, "at": 1100.0}
    d.update(kw)
    return DeltaStatus(**d)


def test_rpo_and_lag() -> None:
    # nothing pending in the open segment: the confirmed coverage counts
    assert status().rpo_seconds() == pytest.approx(2.0)
    # events only in the open segment: the newest closed segment's end counts
    assert status(captured_revision=55, member_revision=56).rpo_seconds() == pytest.approx(10.0)
    assert status(captured_revision=55, member_revision=56).lag_revisions() == 6
    # no chain: since the newest full backup; and nothing known at all
    assert status(captured_revision=None, durable_revision=None).rpo_seconds() == pytest.approx(100.0)
    assert status(captured_revision=None, durable_revision=None, full_backup_time=None).rpo_seconds() is None
    assert status(member_revision=None).lag_revisions() is None
    again = DeltaStatus.from_json(status().to_json(), "status")
    assert again == status()


def test_metrics_families() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from etcd_agent.daemon.metrics import samples

    reg = CollectorRegistry()
    reg.register(DeltaCollector(lambda: status(breaks_total=3, full_backups={"chain_broken": 2})))
    got = {(n, tuple(sorted(lb.items()))): v for n, lb, v in samples(generate_latest(reg).decode())}
    assert got[("etcd_agent_delta_rpo_seconds", ())] == pytest.approx(2.0)
    assert got[("etcd_agent_delta_chain_breaks_total", ())] == 3
    assert got[("etcd_agent_delta_full_backups_total", (("reason", "chain_broken"),))] == 2
    assert got[("etcd_agent_delta_full_backups_total", (("reason", "chain_bounds"),))] == 0
    assert got[("etcd_agent_delta_lag_revisions", ())] == 0
    assert got[("etcd_agent_delta_newest_event_timestamp_seconds", ())] == 1089.0
    # unknown values are absent, not zero
    reg2 = CollectorRegistry()
    reg2.register(DeltaCollector(lambda: status(member_revision=None, newest_event_time=None)))
    names = {n for n, _lb, _v in samples(generate_latest(reg2).decode())}
    assert "etcd_agent_delta_lag_revisions" not in names and "etcd_agent_delta_rpo_seconds" in names


def test_break_record_round_trip(tmp_path: Any) -> None:
    d = str(tmp_path)
    assert read_breaks(d) == (0, [])
    rec = BreakRecord(100, "ab" * 16, 134, "etcd has compacted its history", 1.5e9, 164)
    assert record_break(d, rec) == 1 and record_break(d, rec) == 2
    total, got = read_breaks(d)
    assert total == 2 and got == [rec, rec]
    assert os.stat(os.path.join(d, ".etcd-agent-delta-breaks.json")).st_mode & 0o777 == 0o600
    with open(os.path.join(d, ".etcd-agent-delta-breaks.json"), "w") as fh:
        fh.write("{not json")
    assert read_breaks(d) == (0, [])  # a damaged record never stops the daemon


def cfg_with(delta: str = "", backup: str = "") -> Any:
    cfg, errors = parse_text(BASE + "[backup]\n" + backup + "[backup.delta]\n" + delta)
    return cfg, errors


def test_delta_config_defaults_and_validation() -> None:
    cfg, errors = cfg_with()
    assert errors == [] and cfg.backup.delta.enabled and cfg.backup.delta.close_seconds == 5.0
    assert textfile_path(cfg) is None
    cfg, _ = cfg_with(backup='metrics_file = "/var/lib/node_exporter/textfile_collector/b.prom"\n')
    assert textfile_path(cfg) == "/var/lib/node_exporter/textfile_collector/etcd_agent_delta.prom"
    _, errors = cfg_with("close_seconds = 0\nclose_bytes = 10\nmax_chain_events = 0\nidle_seconds = 2.0\n"
                         "colour = 1\n")
    text = "\n".join(errors)
    assert "unknown key 'colour'" in text
    _, errors = cfg_with("close_seconds = 0\nclose_bytes = 10\nmax_chain_events = 0\n")
    text = "\n".join(errors)
    assert "backup.delta.close_seconds must be > 0" in text
    assert "backup.delta.close_bytes must be between" in text and "backup.delta.max_chain_events must be >= 1" in text
    _, errors = cfg_with("close_seconds = 90.0\n")
    assert any("must not exceed idle_seconds" in e for e in errors)
    assert cfg_with()[0].backup.delta.batch_seconds == 1.0  # the daemon's watch is read in batches
    assert cfg_with("batch_seconds = 0.0\n")[1] == []  # a streaming watch
    _, errors = cfg_with("batch_seconds = 2.0\nclose_seconds = 1.0\n")
    assert errors == ["backup.delta.batch_seconds (2) must not exceed close_seconds (1)"]
    _, errors = cfg_with("batch_seconds = -1.0\n")
    assert errors == ["backup.delta.batch_seconds must be between 0 (a streaming watch) and 10"]
    _, errors = cfg_with('metrics_file = "relative.prom"\n')
    assert any("backup.delta.metrics_file" in e for e in errors)
    d = cfg_with()[0].backup.delta
    assert (d.checkpoint_ratio, d.checkpoint_min_seconds, d.checkpoint_keep) == (0.5, 60.0, 2)
    assert cfg_with("checkpoint_ratio = 0.0\n")[1] == []  # no checkpoints
    _, errors = cfg_with("checkpoint_ratio = -1.0\ncheckpoint_min_seconds = 0.0\ncheckpoint_keep = 0\n")
    assert errors == ["backup.delta.checkpoint_ratio must be between 0 (no checkpoints) and 100",
                      "backup.delta.checkpoint_min_seconds must be > 0 seconds",
                      "backup.delta.checkpoint_keep must be between 1 and 10"], errors


def target(*argv: str) -> Optional["Target"]:
    from etcd_agent.cli.main import build_parser
    from etcd_agent.cli.restore import _target

    return _target(build_parser().parse_args(["restore", "--from", "latest", *argv]))


def test_restore_target_flags() -> None:
    assert target() is None
    from datetime import datetime, timezone

    from etcd_agent.pitr.replay import Target

    assert target("--to", "newest") == Target.newest()  # parsed once, here, and carried typed
    assert target("--to-revision", "42") == Target.to_revision(42)
    assert target("--to-time", "2026-12-01T10:03:00Z") == Target.to_time(datetime(2026, 12, 1, 10, 3, tzinfo=timezone.utc))
    for bad in (("--to-time", "2026-12-01T10:03:00"), ("--to-time", "yesterday"), ("--to-time", "42"),
                ("--to-revision", "0")):
        with pytest.raises(UsageError):
            target(*bad)
    with pytest.raises(UsageError, match="not allowed with"):  # one target at a time
        target("--to", "newest", "--to-revision", "3")


def test_a_break_that_repeats_backs_off_instead_of_looping() -> None:
    from etcd_agent.continuous.decision import BREAK_BACKOFF, break_backoff

    assert break_backoff(1) == 0.0 and break_backoff(2) == BREAK_BACKOFF[0]
    assert break_backoff(3) == 2 * BREAK_BACKOFF[0] and break_backoff(50) == BREAK_BACKOFF[1]
    got, why = decide(facts(broken="the chain broke", watching_base=None, breaks_in_row=3, backoff_left=42.0))
    assert got == "wait" and "3 times in a row" in why and "42s" in why and "backing off" in why
    got, _ = decide(facts(broken="the chain broke", watching_base=None, breaks_in_row=3, backoff_left=0.0))
    assert got == "backup"
    # ten minutes of a chain that breaks at once after every full backup (the loop after a
    # restore, were it ever to come back): a handful of full backups, not one every 2 s
    t, last, in_row, taken = 0.0, -1e9, 0, 0
    while t < 600:
        in_row += 1
        wait = max(0.0, last + break_backoff(in_row) - t)
        t += wait
        if t >= 600:
            break
        taken, last = taken + 1, t
        t += 2.0  # the backup, the new chain, its break
    assert taken <= 5, taken


def test_a_checkpoint_is_due_when_the_chain_grew_by_its_ratio_of_the_full_backup_and_not_too_soon() -> None:
    from etcd_agent.continuous.checkpoints import due

    d = cfg_with()[0].backup.delta  # ratio 0.5, at most one every 60 s
    mb = 1 << 20
    assert due(d, 4 * mb - 1, 8 * mb, 120.0, "f") == ""  # grew by less than half the full backup
    assert due(d, 4 * mb, 8 * mb, 59.0, "f") == ""  # the last one was too recent
    assert due(d, 4 * mb, 8 * mb, 60.0, "f") == f"the chain grew by {4 * mb} bytes since its last checkpoint (0.5 x f)"
    assert due(cfg_with("checkpoint_ratio = 0.0\n")[0].backup.delta, 10**9, 1, 10**6, "f") == ""  # off
    # a tiny (or unknown: 0) full backup: at least 1 MiB of chain between two checkpoints
    assert due(d, mb - 1, 0, 60.0, "f") == "" and due(d, mb, 1000, 60.0, "f")
