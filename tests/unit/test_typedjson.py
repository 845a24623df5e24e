"""What ``typedjson.Document`` offers a record beyond field types: its own error class, an
envelope, bounded strings and counts, fixed-length tuples, codecs, constant tags, closed key sets
and rules across fields - each refusal one sentence of the record's own error."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Dict, List, Optional, Tuple

import pytest

from etcd_agent.errors import AgentError, BackupCorrupt, ProtocolError
from etcd_agent.typedjson import HEX, Document, Items, Key, Text


@dataclass(frozen=True)
class _Inner(Document):
    name: Annotated[str, Text(8, pattern=r"[a-z]+")]


@dataclass(frozen=True)
class _Rec(Document):
    ERROR = BackupCorrupt
    TAGS = {"format": ("rec",), "format_version": (1, 2)}
    CLOSED = True
    OMIT_DEFAULT = ("note",)

    codec: Annotated[str, Text(8, choices=("none", "zstd"))]
    member_id: Annotated[int, HEX, Key("member")]
    pair: Tuple[str, int]
    inner: Tuple[_Inner, ...] = ()
    counts: Annotated[Tuple[int, ...], Items(0, 2)] = ()
    note: str = ""
    low: int = 0
    high: Optional[int] = None

    def violation(self) -> Optional[str]:
        return "low above high" if self.high is not None and self.low > self.high else None


@dataclass(frozen=True)
class _Wrapped(Document):
    ENVELOPE = "ready"
    free: int


GOOD = {"format": "rec", "format_version": 1, "codec": "zstd", "member": "8e9e05c52164694d", "pair": ["a", 1],
        "inner": [{"name": "ab"}], "counts": [1, 2], "low": 1, "high": 2}


def test_a_good_record_reads_and_writes_back_the_same() -> None:
    r = _Rec.from_json(GOOD, "x")
    assert r == _Rec("zstd", 0x8E9E05C52164694D, ("a", 1), (_Inner("ab"),), (1, 2), "", 1, 2)
    assert r.to_json() == GOOD  # "note" left out at its default, the tags written first-valued
    assert _Wrapped.from_json({"ready": {"free": 3}}, "x") == _Wrapped(3)
    assert _Wrapped(3).to_json() == {"ready": {"free": 3}}
    assert _Rec.from_json(dict(GOOD, member=""), "x").member_id == 0  # as older writers of ids left it


@pytest.mark.parametrize("change, why", [
    ({"format": "other"}, "_Rec.format must be 'rec'"),
    ({"format_version": True}, "_Rec.format_version must be 1 or 2"),
    ({"extra": 1}, "_Rec has unknown field(s) extra"),
    ({"codec": "lz4"}, "_Rec.codec must be one of none, zstd"),
    ({"codec": "z" * 9}, "_Rec.codec is longer than 8 characters"),
    ({"member": "f" * 17}, "_Rec.member must be up to 16 hex digits"),
    ({"member": 5}, "_Rec.member must be up to 16 hex digits"),
    ({"pair": ["a", 1, 2]}, "_Rec.pair must be a list of 2, not of 3"),
    ({"pair": ["a", "b"]}, "_Rec.pair[1] must be an integer, not a string"),
    ({"inner": [{"name": "AB"}]}, "_Rec.inner[0]: _Inner.name is malformed"),
    ({"inner": [{"name": ["ab"]}]}, "_Rec.inner[0]: _Inner.name must be a string, not a list"),
    ({"counts": [1, 2, 3]}, "_Rec.counts must hold 0 to 2 items, not 3"),
    ({"low": 3}, "low above high"),
    ({"pair": None}, "_Rec.pair must not be null"),
])
def test_a_hostile_record_is_refused_with_its_own_error_in_one_sentence(change: Dict[str, Any], why: str) -> None:
    with pytest.raises(BackupCorrupt) as ei:
        _Rec.from_json(dict(GOOD, **change), "f.json")
    assert ei.value.message == f"f.json: {why}"


def test_an_envelope_must_hold_its_record() -> None:
    bads: List[Any] = [{"free": 3}, {"ready": [1]}, [], {"ready": {"free": "3"}}]
    for bad in bads:
        with pytest.raises(ProtocolError) as ei:
            _Wrapped.from_json(bad, "host")
        assert ei.value.message.startswith("host: "), ei.value.message


def test_missing_field_and_non_object() -> None:
    with pytest.raises(AgentError, match=r"^x: _Rec lacks its field 'pair'$"):
        _Rec.from_json({k: v for k, v in GOOD.items() if k != "pair"}, "x")
    with pytest.raises(BackupCorrupt, match=r"^x: _Rec must be a JSON object, not a list$"):
        _Rec.from_json([GOOD], "x")
