"""Waiting, defined once: every wait has a deadline and a clock; only transient errors are retried.

``poll(check, timeout=..., what=...)`` calls ``check()`` until it returns something true (that
value is returned) and fails with ``OperationFailed`` naming the last reason at the deadline. A
``check`` says why it is not done yet by returning a false value or raising ``NotYet(reason)``;
any other exception ends the wait at once (it is not transient). Built on tenacity, with the stop
and the sleep taken from an injectable ``Clock``: the unit tier passes a fake one and never
sleeps for real.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Protocol, Tuple, Type, TypeVar

from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
)

from etcd_agent.errors import EtcdUnavailable, EtcdUnhealthyCluster, Interrupted, OperationFailed

log = logging.getLogger(__name__)
T = TypeVar("T")


class Clock(Protocol):
    """Time as a wait sees it."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK: Clock = SystemClock()


class NotYet(Exception):
    """Raised by a ``poll`` check: not done yet, and why (the last reason is in the timeout error)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _not_done(value: Any) -> bool:
    return not value


def poll(
    check: Callable[[], T],
    *,
    timeout: float,
    what: str,
    interval: float = 0.2,
    clock: Clock = SYSTEM_CLOCK,
    cancel: Optional[Callable[[], bool]] = None,
    transient: Tuple[Type[BaseException], ...] = (),
) -> T:
    """``check()`` until true (returned), or OperationFailed("<what> after <timeout>s: <reason>").

    ``cancel()`` true raises Interrupted before the next attempt; exceptions in ``transient`` are
    retried like ``NotYet`` (their message becomes the reason)."""
    deadline = clock.monotonic() + timeout
    last = {"why": ""}

    def attempt() -> T:
        if cancel is not None and cancel():
            raise Interrupted(f"interrupted while waiting for {what}")
        try:
            value = check()
        except NotYet as exc:
            last["why"] = exc.reason
            raise
        except transient as exc:
            last["why"] = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            raise
        if not value:
            last["why"] = last["why"] or "not yet"
        return value

    def wait(state: RetryCallState) -> float:
        return max(0.0, min(interval, deadline - clock.monotonic()))

    def stop(state: RetryCallState) -> bool:
        return clock.monotonic() >= deadline

    retrying = Retrying(
        retry=retry_if_exception_type((NotYet,) + transient) | retry_if_result(_not_done),
        stop=stop,
        wait=wait,
        sleep=clock.sleep,
        reraise=False,
    )
    try:
        return retrying(attempt)
    except RetryError:
        why = last["why"] or "not yet"
        raise OperationFailed(f"{what}: not reached after {timeout:g}s ({why})") from None


def retry_transient(
    fn: Callable[[], T],
    *,
    timeout: float,
    what: str,
    errors: Tuple[Type[BaseException], ...],
    clock: Clock = SYSTEM_CLOCK,
    initial: float = 0.5,
    maximum: float = 4.0,
) -> T:
    """Call ``fn`` until it returns, retrying only ``errors`` with exponential backoff until
    ``timeout``; then the last of those errors is raised as it was (anything else at once)."""
    deadline = clock.monotonic() + timeout

    def wait(state: RetryCallState) -> float:
        step = min(maximum, initial * (2.0 ** (state.attempt_number - 1)))
        return float(max(0.0, min(step, deadline - clock.monotonic())))

    def before_sleep(state: RetryCallState) -> None:  # logs the transient error being waited out
        exc = state.outcome.exception() if state.outcome is not None else None
        log.info("%s: %s; retrying", what, getattr(exc, "message", None) or exc)

    retrying = Retrying(
        retry=retry_if_exception_type(errors),
        stop=lambda state: clock.monotonic() >= deadline,
        wait=wait,
        sleep=clock.sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(fn)


# etcd refuses a membership change with "unhealthy cluster" until every member has been connected
# for 5 s (--strict-reconfig-check); a member that just restarted is briefly unreachable. Both pass.
MEMBERSHIP_TRANSIENT: Tuple[Type[BaseException], ...] = (EtcdUnhealthyCluster, EtcdUnavailable)
MEMBERSHIP_TIMEOUT = 90.0


class Backoff:
    """Waits that double after each failure, up to ``maximum``, and start over after a success:
    for work retried until it succeeds (the copy queue), where ``poll``'s deadline does not fit.
    ``wait(stop)`` sleeps the current step on ``clock`` unless ``stop()`` is already true."""

    def __init__(self, initial: float = 1.0, maximum: float = 60.0, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.initial, self.maximum, self.clock = initial, maximum, clock
        self.failures = 0

    @property
    def step(self) -> float:
        """Seconds the next wait lasts (0 before any failure)."""
        if self.failures == 0:
            return 0.0
        return float(min(self.maximum, self.initial * 2.0 ** (self.failures - 1)))

    def failed(self) -> float:
        """One more failure in a row; returns the wait it calls for."""
        self.failures += 1
        return self.step

    def succeeded(self) -> None:
        self.failures = 0
