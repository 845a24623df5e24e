"""A point-in-time restore's replay and the hosts' sessions and pre-checks at the same time
(issue 35 item 10), against scripted hosts: the real orchestrator, node protocol and flocks.

The source opener here stands in for ``open_pitr_source``: its own checks first (a refused chain
is refused before any session opens), then ``meanwhile.start`` and the "replay", which waits for
what the test probes (the hosts pre-checked, or told to stop) before it ends. Every wait has a
guard so that a run without the overlap fails on its assertion instead of hanging."""
from __future__ import annotations

import threading
import time
from typing import Any, List, Optional

import pytest

from etcd_agent.config import Config
from etcd_agent.errors import EXIT_BUSY, EXIT_REFUSED, AgentError, OperationFailed, RefusedError
from etcd_agent.restore.orchestrator.source import Source
from etcd_agent.state.locks import Holder, OperationLock, SessionOwner, holder_of, lock_path_for
from tests.component.test_restore_orchestration import Bed

pytestmark = pytest.mark.component

GUARD = 20.0  # seconds a stand-in replay waits for what it probes before it gives up and ends


class Replay:
    """The stand-in opener. ``until``: ends its replay once that event is set (or the guard runs
    out); ``fail``: the replay's error instead of a source; ``refuse``: the chain refused before
    anything starts. Records what it saw."""

    def __init__(self, bed: Bed, until: threading.Event, fail: Optional[AgentError] = None,
                 refuse: Optional[AgentError] = None) -> None:
        self.bed = bed
        self.until = until
        self.fail = fail
        self.refuse = refuse
        self.started = False
        self.seen_before_end = False  # ``until`` was set while the replay still ran
        self.stopped = False  # the restore told the replay to stop

    def __call__(self, cfg: Config, spec: str, staging: str, hash_now: bool, *meanwhile: Any) -> Source:
        if self.refuse is not None:
            raise self.refuse
        if meanwhile:  # the chain's checks passed: the hosts may be opened now
            meanwhile[0].start(self.bed.source.path)
            self.started = True
        stop = meanwhile[0].stop if meanwhile else threading.Event()
        deadline = time.monotonic() + GUARD
        while not (self.until.is_set() or stop.is_set()) and time.monotonic() < deadline:
            stop.wait(0.01)  # as the real replay looks at its stop flag between its steps
        self.seen_before_end = self.until.is_set()
        self.stopped = stop.is_set()
        if self.stopped:
            raise RefusedError("the replay was abandoned: the hosts refused the restore")
        if self.fail is not None:
            raise self.fail
        return self.bed.source


@pytest.fixture
def bed(tmp_path: object) -> Bed:
    return Bed(str(tmp_path))


def restore(bed: Bed, replay: Replay, **kw: Any) -> Any:
    from etcd_agent.restore.orchestrator.options import Options
    from etcd_agent.restore.orchestrator.orchestrate import Restore
    from tests.harness.scripted import scripted_nodes

    opts = Options(spec="latest", progress=lambda s: None, **kw)
    return Restore(bed.cfg, opts, nodes=scripted_nodes(bed.script, bed.hosts), cluster=bed.cluster,
                   open_source=replay).run()


def prechecked(bed: Bed) -> threading.Event:
    """Set as the last member's pre-check begins on its host."""
    ev = threading.Event()
    for m in bed.cfg.members:
        bed.script.hooks[("precheck", m.name)] = ev.set
    return ev


def locks_free(bed: Bed) -> List[str]:
    """The hosts whose operation lock someone still holds."""
    return [w for w, h in bed.hosts.items() if holder_of(h.cfg.backup.dir) is not None]


def test_the_hosts_are_prechecked_while_the_replay_runs(bed: Bed) -> None:
    replay = Replay(bed, prechecked(bed))
    out = restore(bed, replay)
    assert replay.seen_before_end, "the hosts were pre-checked only after the replay had ended"
    assert out.done and not bed.script.violations
    for m in ("h1", "h2", "h3"):
        assert bed.script.steps_of(m)[:2] == ["precheck", "begin"]
    # the restore's JSON says how the two overlapped
    assert "overlap: hosts waited for the read" in out.timings and "overlap: read waited for the hosts" in out.timings
    assert not locks_free(bed)


def test_a_refused_chain_opens_no_session(bed: Bed) -> None:
    replay = Replay(bed, prechecked(bed), refuse=RefusedError("the delta chain stops at revision 9; nothing touched"))
    with pytest.raises(RefusedError) as ei:
        restore(bed, replay)
    assert ei.value.message == "the delta chain stops at revision 9; nothing touched"
    assert bed.script.calls == [] and not replay.started  # no host was even asked for its lock


def test_a_busy_host_stops_the_replay_and_is_the_refusal(bed: Bed) -> None:
    replay = Replay(bed, threading.Event())
    other = OperationLock(lock_path_for(bed.hosts["10.0.0.2"].cfg.backup.dir), "restore --from x",
                          holder=Holder(owner=SessionOwner("restore --from x", "master9", 77, "t")))
    with other:
        with pytest.raises(AgentError) as ei:
            restore(bed, replay)
    assert replay.stopped, "the replay ran to its end although a host was busy"
    assert ei.value.exit_code == EXIT_BUSY and "master9 (pid 77)" in ei.value.message, ei.value.message
    assert [s for _h, s, _m in bed.script.calls] == []  # not even a pre-check ran
    assert locks_free(bed) == []


def test_a_host_refusing_whatever_the_snapshot_stops_the_replay(bed: Bed) -> None:
    bed.script.facts["h2"] = {"etcd_version": None}  # etcd does not run there: refused whatever is replayed
    replay = Replay(bed, threading.Event())
    with pytest.raises(RefusedError) as ei:
        restore(bed, replay)
    assert replay.stopped, "the replay ran to its end although a host's pre-check refused"
    assert ei.value.exit_code == EXIT_REFUSED and "nothing touched" in ei.value.message
    assert any(d.startswith("h2 (10.0.0.2): etcd does not run") for d in ei.value.details), ei.value.details
    assert "begin" not in [s for _h, s, _m in bed.script.calls]
    assert locks_free(bed) == []


def test_a_refusal_that_needs_the_replayed_db_waits_for_it(bed: Bed) -> None:
    bed.script.facts["h2"] = {"free_bytes": 10}  # room is judged on the replayed db's size
    replay = Replay(bed, prechecked(bed))
    with pytest.raises(RefusedError) as ei:
        restore(bed, replay)
    assert replay.seen_before_end and not replay.stopped
    assert any(d.startswith("h2") and "bytes free" in d for d in ei.value.details), ei.value.details
    assert locks_free(bed) == []


def test_a_dry_run_is_not_stopped_by_a_host_and_reports_every_one(bed: Bed) -> None:
    bed.script.facts["h2"] = {"etcd_version": None}
    replay = Replay(bed, prechecked(bed))
    out = restore(bed, replay, dry_run=True)
    assert replay.seen_before_end and not replay.stopped
    assert not out.done and not out.plan.ok
    assert [p for h in out.plan.hosts if h.member == "h2" for p in h.problems], out.plan.to_json()
    assert locks_free(bed) == []


def test_a_failed_replay_releases_every_host_and_is_the_error(bed: Bed) -> None:
    replay = Replay(bed, prechecked(bed), fail=OperationFailed("the replay failed: the throwaway etcd did not start"))
    with pytest.raises(OperationFailed) as ei:
        restore(bed, replay)
    assert ei.value.message == "the replay failed: the throwaway etcd did not start"
    assert replay.started and replay.seen_before_end
    assert {s for _h, s, _m in bed.script.calls} == {"precheck"}  # asked, never touched
    assert locks_free(bed) == []
