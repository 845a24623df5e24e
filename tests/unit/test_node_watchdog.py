"""node serve's watchdog: once the session is over, the running step gets STOP_GRACE seconds;
a step still running then is ended (``stuck``), an idle session is not. The clock is fake."""
from __future__ import annotations

from typing import List, Tuple

from etcd_agent.node.server import STOP_GRACE, _State, _watch
from tests.harness.fakes import FakeClock


def _run(step_after_grace: "str | None", over_after: float) -> Tuple[List[Tuple[str, str]], FakeClock]:
    clock = FakeClock()
    start = clock.now
    state = _State()
    state.step = "restore"
    called: List[Tuple[str, str]] = []

    def over() -> str:
        return "the caller closed the session (or died)" if clock.now - start >= over_after else ""

    def stuck(step: str, why: str) -> None:
        called.append((step, why))

    def sleep(seconds: float) -> None:
        FakeClock.sleep(clock, seconds)
        if clock.now - start >= over_after + STOP_GRACE:
            state.step = step_after_grace  # what the main thread is doing by then

    clock.sleep = sleep  # type: ignore[method-assign]
    _watch(over, state, stuck, STOP_GRACE, clock=clock)
    return called, clock


def test_a_step_still_running_past_the_grace_is_ended_naming_it_and_why() -> None:
    called, clock = _run("restore", over_after=5.0)
    assert called == [("restore", "the caller closed the session (or died)")]
    assert clock.now - 1000.0 >= 5.0 + STOP_GRACE


def test_a_step_that_ended_within_the_grace_is_left_alone() -> None:
    called, _clock = _run(None, over_after=5.0)
    assert called == []
