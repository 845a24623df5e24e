"""A segment's header and footer as the reader meets them: typed documents, every hostile one
(a field of the wrong type, an over-long string, a number no 64 bits hold, a signature of the
wrong shape, a field missing) refused as SegmentCorrupt naming the file in one sentence - never
taken, never a ValueError or TypeError out of the reader."""
from __future__ import annotations

import json
from typing import Any, Dict

import pytest

from etcd_agent.chain.errors import SegmentCorrupt
from etcd_agent.chain.reader import read_header, read_summary
from etcd_agent.chain.segments import MAGIC, PUT, U32, Event, SegmentFooter, SegmentHeader, Txn
from etcd_agent.chain.writer import SegmentWriter

T0 = 1_700_000_000_000
HEADER = SegmentHeader("ab" * 16, 0, 100, 101, "", T0, 0x8E9E05C52164694D, 0x1, "https://10.0.0.1:2379")


def header_file(tmp_path: Any, doc: Dict[str, Any]) -> str:
    """A file that begins as a segment does with ``doc`` as its header (``read_header`` reads no
    further)."""
    raw = json.dumps(doc).encode()
    path = str(tmp_path / "etcd-delta-0000000000000101-0000000000000105-20261205T100000.000Z.seg")
    with open(path, "wb") as fh:
        fh.write(MAGIC + U32.pack(len(raw)) + raw + b"\0" * 64)
    return path


def test_headers_and_footers_written_before_read_as_ever(tmp_path: Any) -> None:
    old = {"format": "etcd-agent-delta", "format_version": 1, "chain_id": "ab" * 16, "seq": 0, "base_revision": 100,
           "start_revision": 101, "prev_sha256": "", "start_time_ms": T0, "cluster_id": "8e9e05c52164694d",
           "member_id": "1", "endpoint": "https://10.0.0.1:2379"}
    assert read_header(header_file(tmp_path, old)) == HEADER
    assert HEADER.to_json() == old  # no base_sha256: absent, as older writers left it
    with_base = SegmentHeader("ab" * 16, 0, 100, 101, "", T0, base_sha256="c" * 64)
    assert read_header(header_file(tmp_path, with_base.to_json())) == with_base
    assert read_header(header_file(tmp_path, dict(old, cluster_id="", member_id=""))).cluster_id == 0
    (tmp_path / "w").mkdir()
    w = SegmentWriter(str(tmp_path / "w"), HEADER)
    w.add_txn(Txn(101, T0 + 1, (Event(PUT, b"k", b"v", 101, 101, 1, 0),)))
    info = w.close(T0 + 200, confirmed=True)
    assert info.footer.to_json() == {"end_revision": 101, "end_time_ms": T0 + 200, "txns": 1, "events": 1,
                                     "leases": 0, "confirmed": True, "catchup_until": 0}
    assert read_summary(info.path) == (HEADER, info.footer)


@pytest.mark.parametrize("change, why", [
    ({"cluster_id": "f" * 2000}, "SegmentHeader.cluster_id must be up to 16 hex digits"),
    ({"member_id": "0x1f"}, "SegmentHeader.member_id must be up to 16 hex digits"),
    ({"endpoint": "h" * 5000}, "SegmentHeader.endpoint is longer than 4096 characters"),
    ({"endpoint": ["https://a"]}, "SegmentHeader.endpoint must be a string, not a list"),
    ({"base_revision": 99999999999999999998, "start_revision": 99999999999999999999},
     "SegmentHeader.base_revision is out of range"),
    ({"start_time_ms": {"ms": [1]}}, "SegmentHeader.start_time_ms must be an integer, not an object"),
    ({"format_version": 2}, "SegmentHeader.format_version must be 1"),
    ({"format": "other"}, "SegmentHeader.format must be 'etcd-agent-delta'"),
    ({"chain_id": "AB" * 16}, "SegmentHeader.chain_id is malformed"),
    ({"seq": 1}, "only the first segment of a chain (seq 0, at base + 1) has no previous segment"),
])
def test_a_hostile_header_is_segment_corrupt(tmp_path: Any, change: Dict[str, Any], why: str) -> None:
    path = header_file(tmp_path, dict(HEADER.to_json(), **change))
    with pytest.raises(SegmentCorrupt) as ei:
        read_header(path)
    assert ei.value.message.startswith(f"segment {path}: ") and why in ei.value.message, ei.value.message
    assert "\n" not in ei.value.message


def test_a_header_lacking_a_field_is_segment_corrupt(tmp_path: Any) -> None:
    doc = HEADER.to_json()
    del doc["member_id"]
    path = header_file(tmp_path, doc)
    with pytest.raises(SegmentCorrupt, match="SegmentHeader lacks its field 'member_id'"):
        read_header(path)


FOOTER = {"end_revision": 105, "end_time_ms": T0, "txns": 5, "events": 5, "leases": 0, "confirmed": True,
          "catchup_until": 0}


@pytest.mark.parametrize("change, why", [
    ({"signature": {"alg": "hmac-sha256", "key_id": "k", "mac": ["m"]}}, "SegmentFooter.signature"),
    ({"signature": ["k", "m"]}, "SegmentFooter.signature"),
    ({"txns": 99999999999999999999}, "SegmentFooter.txns is out of range"),
    ({"confirmed": 1}, "SegmentFooter.confirmed must be a boolean, not a number"),
    ({"end_revision": -1}, "negative count in footer"),
    ({"catchup_until": None}, "SegmentFooter.catchup_until must not be null"),
])
def test_a_hostile_footer_is_segment_corrupt(change: Dict[str, Any], why: str) -> None:
    with pytest.raises(SegmentCorrupt) as ei:
        SegmentFooter.from_json(dict(FOOTER, **change), "/b/x.seg")
    assert ei.value.message.startswith("segment /b/x.seg: bad footer: ") and why in ei.value.message, ei.value.message


def seal_file(tmp_path: Any, change: Dict[str, Any]) -> str:
    """An encrypted segment's file whose seal is the good one with ``change`` applied (its age file
    ten bytes of junk: ``read_seal`` checks the seal and the sizes, nothing inside)."""
    from etcd_agent.chain.seal import SEAL_BLOCK, SEAL_MAGIC, Seal
    from etcd_agent.chain.segments import SegmentFooter as F

    seal = Seal(HEADER, F(105, T0, 5, 5, 0, True), 100, "c" * 64, 10, "d" * 64, ("age1" + "q" * 58,))
    raw = json.dumps(dict(seal.to_json(), **change)).encode()
    path = str(tmp_path / "etcd-delta-0000000000000101-0000000000000105-20261205T100000.000Z.seg.age")
    with open(path, "wb") as fh:
        fh.write((SEAL_MAGIC + U32.pack(len(raw)) + raw).ljust(SEAL_BLOCK, b"\0") + b"x" * 10)
    return path


@pytest.mark.parametrize("change, why", [
    ({}, ""),
    ({"header": dict(HEADER.to_json(), cluster_id="f" * 2000)}, "Seal.header: SegmentHeader.cluster_id must be up to 16"),
    ({"header": dict(HEADER.to_json(), endpoint="h" * 5000)}, "Seal.header: SegmentHeader.endpoint is longer than 4096"),
    ({"footer": dict(FOOTER, txns=99999999999999999999)}, "Seal.footer: SegmentFooter.txns is out of range"),
    ({"recipients": ["age1" + "q" * 58, ["age1x"]]}, "Seal.recipients[1] must be a string, not a list"),
    ({"recipients": []}, "Seal.recipients must hold 1 to 64 items, not 0"),
    ({"plain_sha256": "c" * 65}, "Seal.plain_sha256 is longer than 64 characters"),
    ({"signature": {"alg": "hmac-sha256", "key_id": "k"}}, "Seal.signature is malformed"),
    ({"extra": 1}, "Seal has unknown field(s) extra"),
    ({"age_size": None}, "Seal.age_size must not be null"),
])
def test_a_hostile_seal_is_segment_corrupt(tmp_path: Any, change: Dict[str, Any], why: str) -> None:
    """A seal is read as its header and footer are, and refused as the seal (the file is damaged)."""
    from etcd_agent.chain.seal import read_seal

    path = seal_file(tmp_path, change)
    if not why:
        assert read_seal(path).header == HEADER  # the good seal reads
        return
    with pytest.raises(SegmentCorrupt) as ei:
        read_seal(path)
    assert ei.value.message.startswith(f"segment {path}: bad seal: {why}"), ei.value.message
