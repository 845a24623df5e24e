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


def test_what_a_refusal_is_about_for_readers_that_word_it_their_own_way() -> None:
    from etcd_agent import safejson

    for data, kind, detail in [(b"x" * 11, safejson.SIZE, "11 bytes, more than the 10 allowed"),
                               (b'"\xff"', safejson.ENCODING, "not UTF-8 (invalid start byte at byte 1)"),
                               (b"[[1]]", safejson.DEPTH, "nested deeper than 1 levels"),
                               (b"{nope", safejson.SYNTAX, "Expecting property name enclosed in double quotes: "
                                                           "line 1 column 2 (char 1)"),
                               (b"NaN", safejson.SYNTAX, "NaN is not a JSON number")]:
        with pytest.raises(UnsafeJson) as ei:
            loads(data, max_bytes=10, max_depth=1)
        assert (ei.value.kind, ei.value.detail) == (kind, detail)


def test_a_key_named_twice_is_refused_when_asked() -> None:
    assert loads('{"a": 1, "a": 2}', max_bytes=100) == {"a": 2}
    with pytest.raises(UnsafeJson, match="duplicate key 'a'"):
        loads('{"b": {"a": 1, "a": 2}}', max_bytes=100, unique_keys=True)


def test_a_file_is_read_no_further_than_its_bound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent.safejson import load

    (tmp_path / "ok.json").write_text('{"a": [1, 2]}')
    (tmp_path / "big.json").write_text('{"a": "' + "x" * (1 << 20) + '"}')
    with open(tmp_path / "ok.json", "rb") as fh:
        assert load(fh, max_bytes=100) == {"a": [1, 2]}
    with open(tmp_path / "big.json", encoding="utf-8") as fh, pytest.raises(UnsafeJson, match="101 bytes, more than"):
        load(fh, max_bytes=100)
