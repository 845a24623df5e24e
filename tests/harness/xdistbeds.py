"""A heavy tier (namespace or nspawn beds) on pytest-xdist workers: the hooks its conftest.py calls.

Each worker is a pytest session of its own, with its own session and module fixtures. Two rules
keep two workers' beds apart:

- A file is one unit of work (as ``--dist loadfile``), and files whose beds share a prefix or
  subnet are one unit together (`BedScheduling`): a bed's ``up()`` removes any bed of its prefix.
  (Not ``--dist loadgroup``: pytest 9 keeps a node's id where xdist 3.8 no longer sets its group.)
- The controller holds the machine-wide bed lock for the run (tests/harness/bedlock.py) and tells
  its workers, whose sessions then take nothing: taking it there, the second worker would wait
  for the first one's whole session.

The longest units are dealt first (the Makefile's ``--no-loadscope-reorder`` keeps the collection
order): a long file taken last keeps one worker busy while the other has nothing left.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Sequence, Tuple

import pytest
from xdist.scheduler import LoadScopeScheduling

from tests.harness import bedlock


class BedScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with a unit per file, or per group of files (``unit_of``: a test
    file's name -> its unit's name)."""

    def __init__(self, config: pytest.Config, log: Any, unit_of: Callable[[str], str]) -> None:
        super().__init__(config, log)
        self._unit_of = unit_of

    def _split_scope(self, nodeid: str) -> str:
        return self._unit_of(os.path.basename(nodeid.split("::", 1)[0]))


class Tier:
    """The xdist hooks of one tier (registered as a plugin by `register`)."""

    def __init__(self, conftest: str, unit_of: Callable[[str], str], long: Sequence[str]) -> None:
        self.conftest, self.unit_of, self.long = conftest, unit_of, long

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """On the controller, as it starts a worker."""
        bedlock.tell_worker(node)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> BedScheduling:
        """Whatever ``--dist`` says, this tier's tests go out a unit at a time."""
        return BedScheduling(config, log, self.unit_of)

    def pytest_collection_modifyitems(self, config: pytest.Config, items: List[pytest.Item]) -> None:
        if hasattr(config, "workerinput"):  # what a worker collects is the order units are dealt in
            deal(items, self.conftest, self.unit_of, self.long)


def register(config: pytest.Config, conftest: str, unit_of: Callable[[str], str], long: Sequence[str]) -> None:
    """From the tier's ``pytest_configure``: ``unit_of`` maps a test file's name to its unit's
    name; ``long``: the units dealt first, in that order. One heavy tier per xdist run (the
    Makefile runs each tier on its own)."""
    if bedlock.is_xdist_controller(config):
        bedlock.hold_for_workers(config)
    config.pluginmanager.register(Tier(conftest, unit_of, long), f"xdistbeds:{conftest}")


def deal(items: List[pytest.Item], conftest: str, unit_of: Callable[[str], str], long: Sequence[str]) -> None:
    """From the tier's ``pytest_collection_modifyitems``. The tier's tests (those under
    ``conftest``'s dir): the ``long`` units first, in that order, then the others in collection
    order; a unit's tests keep their order, other tiers' tests their places."""
    here = os.path.dirname(os.path.abspath(conftest)) + os.sep
    slots = [i for i, it in enumerate(items) if str(it.path).startswith(here)]
    mine = [items[i] for i in slots]
    units = {id(it): unit_of(os.path.basename(str(it.path))) for it in mine}
    first: Dict[str, int] = {}
    for n, it in enumerate(mine):
        first.setdefault(units[id(it)], n)

    def rank(it: pytest.Item) -> Tuple[int, int]:
        u = units[id(it)]
        return (list(long).index(u), 0) if u in long else (len(long), first[u])

    for i, it in zip(slots, sorted(mine, key=rank)):  # stable: a unit's tests in collection order
        items[i] = it
