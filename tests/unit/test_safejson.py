"""Bounded JSON: numbers no writer of ours produces are refused, and typed documents range-check."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest

from etcd_agent.errors import ProtocolError
from etcd_agent.safejson import UnsafeJson, loads
from etcd_agent.typedjson import Document


@pytest.mark.parametrize("text,why", [
    ("1e400", "the number 1e400 is out of range"),
    ("[-1e400]", "the number -1e400 is out of range"),
    ("9" * 400, "an integer of 400 digits, more than the 20 allowed"),
    ("NaN", "NaN is not a JSON number"),
    ("[" * 1000 + "]" * 1000, "nested deeper than 32 levels"),
])
def test_numbers_and_nesting_no_writer_of_ours_produces_are_one_clear_error(text: str, why: str) -> None:
    with pytest.raises(UnsafeJson) as ei:
        loads(text, max_bytes=1 << 20)
    assert str(ei.value) == why


def test_the_numbers_a_writer_of_ours_produces_read_as_ever() -> None:
    assert loads('[18446744073709551615, -9223372036854775808, 1e300, 0.5]', max_bytes=100) == [
        (1 << 64) - 1, -(1 << 63), 1e300, 0.5]


@dataclass(frozen=True)
class _Doc(Document):
    t: float
    n: Optional[int] = None

    RANGES = {"t": (0.0, 10.0)}


def test_a_document_checks_its_ranges_and_that_numbers_fit() -> None:
    assert _Doc.from_json({"t": 5, "n": 7}, "x") == _Doc(5.0, 7)
    for bad, why in [({"t": 11}, "x: _Doc.t must be between 0 and 10"),
                     ({"t": float("inf")}, "x: _Doc.t is out of range (a 64-bit integer or a finite number)"),
                     ({"t": 1, "n": 1 << 64}, "x: _Doc.n is out of range (a 64-bit integer or a finite number)")]:
        with pytest.raises(ProtocolError) as ei:
            _Doc.from_json(bad, "x")
        assert ei.value.message == why
