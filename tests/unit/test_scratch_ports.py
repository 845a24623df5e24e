"""The ports a throwaway etcd takes: never one a Kubernetes master's own components listen on."""
from __future__ import annotations

import socket
from typing import List

from etcd_agent.scratch.machine import KUBERNETES_PORTS, PORT_RANGE, pick_ports


class Scripted:
    """Stands in for random.Random's randrange (all pick_ports calls): draws the given even ports
    in order, then refuses to draw more (fails closed)."""

    def __init__(self, draws: List[int]) -> None:
        self.draws = list(draws)

    def randrange(self, start: int, stop: int, step: int = 1) -> int:
        assert start <= self.draws[0] < stop and self.draws[0] % step == 0
        return self.draws.pop(0)


def test_kubernetes_ports_are_never_picked_even_when_free() -> None:
    free = [p for p in range(10300, 10400, 2) if all(_bindable(q) for q in (p, p + 1))][0]
    assert pick_ports(Scripted([10248, 10250, 10254, 10256, 10258, free])) == (free, free + 1)  # type: ignore[arg-type]


def test_the_range_and_the_reserved_ports() -> None:
    assert {10248, 10249, 10250, 10255, 10256, 10257, 10259} <= KUBERNETES_PORTS
    assert all(PORT_RANGE[0] <= p < PORT_RANGE[1] for p in KUBERNETES_PORTS)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
