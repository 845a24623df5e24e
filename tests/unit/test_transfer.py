"""node.transfer, the snapshot stream of `node receive`: framing, bounds, bombs, the codec choice (pure)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import struct
from typing import Any, List, Optional, Tuple

import pytest

from etcd_agent.errors import RefusedError
from etcd_agent.node import transfer as T
from etcd_agent.node.transfer import Decoder, End, FrameReader, Ready, Received, StreamError


def compressible(n: int, seed: int = 1) -> bytes:
    """Text-like bytes that zstd shrinks several times (like Kubernetes objects)."""
    rnd = random.Random(seed)
    words = [bytes(rnd.choices(b"abcdefghijklmnopqrstuvwxyz", k=rnd.randint(3, 12))) for _ in range(300)]
    out = bytearray()
    while len(out) < n:
        out += b'{"name": "' + rnd.choice(words) + b'", "uid": "' + os.urandom(4).hex().encode() + b'"}\n'
    return bytes(out[:n])


def stream(data: bytes, codec: str, *, end: Optional[End] = None, chunk: int = 1 << 20) -> bytes:
    """What a sender puts on the wire for ``data``: D frames, then the end record."""
    enc = T.Encoder(codec, len(data))
    out = bytearray()
    for i in range(0, len(data), chunk):
        for head, payload in T.data_frames(enc.feed(data[i:i + chunk])):
            out += head + payload
    for head, payload in T.data_frames(enc.flush()):
        out += head + payload
    head, payload = T.end_frame(end or End(len(data), hashlib.sha256(data).hexdigest()))
    return bytes(out + head + payload)


def receive(wire: bytes, codec: str, size: int) -> Tuple[bytes, End, List[int]]:
    frames = FrameReader(io.BytesIO(wire).readinto, "test")
    dec = Decoder(frames, codec, size)
    pieces = [bytes(c) for c in dec.chunks()]
    return b"".join(pieces), dec.finish(), [len(p) for p in pieces]


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_stream_round_trips_and_ends_with_the_senders_record(codec: str) -> None:
    data = compressible(3 << 20) + os.urandom(1 << 20)
    wire = stream(data, codec)
    got, end, sizes = receive(wire, codec, len(data))
    assert got == data and end == End(len(data), hashlib.sha256(data).hexdigest())
    if codec == "zstd":
        assert len(wire) < len(data) * 0.6 and max(sizes) <= T.SLICE  # decoded in bounded slices


def test_an_empty_payload_makes_no_frame_and_a_big_one_is_cut() -> None:
    assert T.data_frames(b"") == []
    parts = T.data_frames(b"x" * (T.MAX_FRAME + 5))
    assert [len(p) for _h, p in parts] == [T.MAX_FRAME, 5]
    assert [struct.unpack(">cI", h) for h, _p in parts] == [(b"D", T.MAX_FRAME), (b"D", 5)]


def test_a_zstd_bomb_is_refused_after_the_declared_size_not_written_past_it() -> None:
    import zstandard

    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (1 << 30))  # 1 GiB in ~32 KB
    head, payload = T.data_frames(bomb)[0]
    wire = head + bytes(payload) + b"".join(bytes(x) for x in T.end_frame(End(1 << 20, "0" * 64)))
    dec = Decoder(FrameReader(io.BytesIO(wire).readinto, "test"), "zstd", 1 << 20)
    seen = 0
    with pytest.raises(StreamError, match="more than the declared 1048576 bytes.*bomb"):
        for chunk in dec.chunks():
            seen += len(chunk)
    assert seen <= 1 << 20  # every slice handed out fits in the declared size


def test_raw_data_beyond_the_declared_size_is_refused() -> None:
    data = os.urandom(5000)
    with pytest.raises(StreamError, match="more than the declared 4096"):
        receive(stream(data, "none"), "none", 4096)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_fewer_bytes_than_declared_or_claimed_are_refused(codec: str) -> None:
    data = compressible(200_000)
    with pytest.raises(StreamError, match="200000 bytes arrived, 300000 were declared"):
        receive(stream(data, codec), codec, 300_000)
    with pytest.raises(StreamError, match="the sender says 9"):
        receive(stream(data, codec, end=End(9, "0" * 64)), codec, len(data))


@pytest.mark.parametrize("cut", [0, 3, 5, 100, -40, -1])
def test_a_stream_cut_anywhere_is_refused_and_names_where(cut: int) -> None:
    wire = stream(compressible(10_000), "none")
    with pytest.raises(StreamError, match="cut"):
        receive(wire[:cut], "none", 10_000)


def test_malformed_frames_are_refused_before_their_payload_is_read() -> None:
    def refused(wire: bytes, match: str) -> None:
        with pytest.raises(StreamError, match=match):
            receive(wire, "none", 10)

    refused(struct.pack(">cI", b"D", T.MAX_FRAME + 1), "a data frame of")
    refused(struct.pack(">cI", b"D", 0), "a data frame of 0")
    refused(struct.pack(">cI", b"X", 1) + b"x", "unknown frame kind")
    refused(struct.pack(">cI", b"E", T.MAX_END + 1), "an end record of")
    refused(struct.pack(">cI", b"E", 3) + b"[1]", "not an object")
    refused(struct.pack(">cI", b"E", 5) + b"{nope", "unreadable end record")
    refused(struct.pack(">cI", b"E", 2) + b"{}", "End lacks its field 'size'")
    end = json.dumps({"size": 10, "sha256": "AB" * 32}).encode()
    refused(struct.pack(">cI", b"E", len(end)) + end, "End.sha256 is malformed")
    good = stream(b"0123456789", "none")
    refused(good + b"!", "data after the end record")
    refused(good[:-40], "cut")


def test_corrupt_zstd_is_refused() -> None:
    data = compressible(1 << 20)
    wire = bytearray(stream(data, "zstd"))
    wire[5:20] = b"\xff" * 15  # the frame header
    with pytest.raises(StreamError, match="corrupt zstd"):
        receive(bytes(wire), "zstd", len(data))


def test_codecs_are_checked_before_any_data() -> None:
    T.require_codec("none")
    T.require_codec("zstd")
    with pytest.raises(RefusedError, match="unknown codec 'lz4'"):
        T.require_codec("lz4")
    with pytest.raises(RefusedError, match="unknown codec"):
        Decoder(FrameReader(io.BytesIO(b"").readinto, "t"), "gzip", 1)


def test_documents_are_typed_and_checked() -> None:
    r = Ready(3, "zstd", 123)
    assert Ready.from_json(r.to_json(), "x") == r
    with pytest.raises(StreamError, match="Ready.codec must be one of none, zstd"):
        Ready.from_json({"ready": {"protocol": 3, "codec": "lz4", "free": 1}}, "x")
    with pytest.raises(StreamError, match="Ready.free must be between 0 and"):
        Ready.from_json({"ready": {"protocol": 3, "codec": "none", "free": -1}}, "x")
    rec = Received("m1", 10, "a" * 64, 99)
    assert Received.from_json(rec.to_json(), "x") == rec
    with pytest.raises(StreamError, match="not a Received"):
        Received.from_json({"member": "m1"}, "x")


def sampler(pattern: bytes, size: int) -> Tuple[T.ReadAt, List[int]]:
    """read_at over a virtual file repeating ``pattern``; records the offsets read."""
    seen: List[int] = []

    def read_at(off: int, n: int) -> bytes:
        seen.append(off)
        n = max(0, min(n, size - off))
        reps = pattern * (n // len(pattern) + 2)
        start = off % len(pattern)
        return reps[start:start + n]

    return read_at, seen


def test_the_codec_is_chosen_from_samples_spread_over_the_snapshot() -> None:
    size = 10 << 30  # a virtual 10 GiB: only the samples are read
    read_at, seen = sampler(compressible(3 << 20), size)
    choice = T.choose_codec(read_at, size)
    assert choice.codec == "zstd" and choice.ratio >= 1.3 and choice.sampled == 8 << 20
    assert len(seen) == 8 and seen[0] == 0 and seen[-1] == size - (1 << 20)
    read_at, _ = sampler(os.urandom(3 << 20), size)
    choice = T.choose_codec(read_at, size)
    assert choice.codec == "none" and choice.ratio < 1.05
    assert "sent as it is" in choice.describe()
    assert T.choose_codec(read_at, 0).codec == "none"


def test_a_small_snapshot_is_sampled_whole_once() -> None:
    read_at, seen = sampler(compressible(1 << 16), 300_000)
    choice = T.choose_codec(read_at, 300_000)
    assert seen == [0] and choice.sampled == 300_000 and choice.codec == "zstd"


def test_mediocre_compression_is_not_worth_its_cpu() -> None:
    half = os.urandom(1 << 19) + b"\0" * (1 << 19)  # 2x: pays
    assert T.choose_codec(sampler(half, 64 << 20)[0], 64 << 20).codec == "zstd"
    some = os.urandom(900_000) + b"\0" * 148_576  # 1.17x: does not
    assert T.choose_codec(sampler(some, 64 << 20)[0], 64 << 20).codec == "none"


# ---------------------------------------------------------------- the order: the stream's first frame

ORDER = T.Order("m2", "20261202T035334Z-a9786d53-6e4962", "ab" * 16, 3 << 20, "zstd")


def framed(kind: bytes, body: bytes) -> bytes:
    return T.HEADER.pack(kind, len(body)) + body


def test_an_order_opens_the_stream_and_the_data_follows_it() -> None:
    data = compressible(1 << 20)
    head, body = T.order_frame(T.Order("m2", "op-1", "ab" * 16, len(data), "zstd"))
    frames = FrameReader(io.BytesIO(bytes(head) + bytes(body) + stream(data, "zstd")).readinto, "test")
    order = frames.order()
    assert order == T.Order("m2", "op-1", "ab" * 16, len(data), "zstd")
    dec = Decoder(frames, order.codec, order.size)
    assert b"".join(bytes(c) for c in dec.chunks()) == data and dec.finish().size == len(data)


def test_a_stream_that_ends_before_its_order_was_not_needed() -> None:
    assert FrameReader(io.BytesIO(b"").readinto, "test").order() is None


@pytest.mark.parametrize("wire, why", [
    (b"O\0", "the stream was cut inside the order"),  # cut in the header
    (T.HEADER.pack(b"O", 100) + b'{"member": "m2"', "the stream was cut inside the order"),  # less than it said
    (stream(b"x" * 10, "none"), "does not begin with the sender's order (frame b'D')"),
    (T.HEADER.pack(b"O", T.MAX_ORDER + 1), f"an order of {T.MAX_ORDER + 1} bytes (at most {T.MAX_ORDER})"),
    (T.HEADER.pack(b"O", 0), "an order of 0 bytes"),
    (framed(b"O", b"[1, 2]"), "the order is not an object"),
    (framed(b"O", b"{\"member\": "), "unreadable order"),
])
def test_a_stream_that_does_not_open_with_a_sound_order_is_refused(wire: bytes, why: str) -> None:
    with pytest.raises(StreamError) as err:
        FrameReader(io.BytesIO(wire).readinto, "test").order()
    assert why in err.value.message, err.value.message


@pytest.mark.parametrize("field, value", [
    ("member", "m2; rm -rf /"), ("member", ""), ("member", 7), ("op", "../../etc"), ("owner", "not-hex"),
    ("owner", "ab"), ("size", -1), ("size", True), ("size", "3"), ("codec", ""), ("member", None),
])
def test_an_order_with_a_field_out_of_shape_is_refused_naming_it(field: str, value: object) -> None:
    doc = dict(ORDER.to_json(), **{field: value})
    with pytest.raises(StreamError) as err:
        FrameReader(io.BytesIO(framed(b"O", json.dumps(doc).encode())).readinto, "test").order()
    assert f"Order.{field} " in err.value.message, err.value.message


BIG = 99999999999999999999  # 20 digits: what safejson lets through, more than 64 bits hold


@pytest.mark.parametrize("cls, doc, why", [
    (Ready, {"ready": {"protocol": 3, "codec": "none", "free": BIG}}, "Ready.free is out of range"),
    (Ready, ["ready"], "not a Ready"),
    (T.Order, {"member": "m1", "op": "op1", "owner": "a" * 16, "size": 1, "codec": "z" * 200},
     "Order.codec is longer than 16 characters"),
    (T.Order, {"member": "m1", "op": "op1", "owner": "a" * 16, "size": 1}, "Order lacks its field 'codec'"),
    (T.End, {"size": BIG, "sha256": "a" * 64}, "End.size is out of range"),
    (T.End, {"size": 1, "sha256": ["a" * 64]}, "End.sha256 must be a string, not a list"),
    (Received, {"received": {"member": "m" * 5000, "size": 1, "sha256": "a" * 64, "wire": 1}},
     "Received.member is longer than 63 characters"),
])
def test_a_hostile_stream_record_is_a_stream_error(cls: Any, doc: Any, why: str) -> None:
    """Out of 64 bits, over-long, of the wrong type or not an object: one StreamError naming the
    record and the field, never accepted, never an AttributeError."""
    with pytest.raises(StreamError) as ei:
        cls.from_json(doc, "h1: order")
    assert ei.value.message.startswith(f"h1: order: {why}"), ei.value.message
