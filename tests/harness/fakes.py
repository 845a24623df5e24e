"""Test doubles for pure logic only. Each fails closed: anything it was not told about is an error."""
from __future__ import annotations

from typing import List


class FakeClock:
    """A clock whose sleeps advance time at once: waits under test take no real time."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: List[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise AssertionError(f"negative sleep {seconds}")
        self.sleeps.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds
