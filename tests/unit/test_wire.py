import pytest

from etcd_agent.etcd import wire
from etcd_agent.etcd.client import prefix_end


def test_roundtrip():
    buf = wire.encode_field(1, 300) + wire.encode_field(2, "abc") + wire.encode_field(3, b"x") + wire.encode_field(3, b"y")
    f = wire.fields(buf)
    assert wire.get_int(f, 1) == 300
    assert wire.get_bytes(f, 2) == b"abc"
    assert wire.get_strings(f, 3) == ["x", "y"]
    assert wire.get_int(f, 9, default=7) == 7


def test_large_ids():
    mid = 0xFFFF_FFFF_FFFF_FFF0
    assert wire.get_int(wire.fields(wire.encode_field(1, mid)), 1) == mid


def test_truncated_input_raises():
    with pytest.raises(ValueError):
        wire.fields(wire.encode_field(2, "abcdef")[:-2])
    with pytest.raises(ValueError):
        wire.fields(b"\x08\xff")


def test_prefix_end():
    assert prefix_end(b"a") == b"b"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"") == b"\0"


def test_bytes_view_is_the_field_without_a_copy():
    blob = bytes(range(256)) * 128  # a 32 KiB snapshot chunk
    msg = wire.encode_field(1, wire.encode_field(1, 7)) + wire.encode_field(2, 12345) + wire.encode_field(3, blob)
    view = wire.bytes_view(msg, 3)
    assert isinstance(view, memoryview) and view.obj is msg and bytes(view) == blob
    assert bytes(wire.bytes_view(msg, 4)) == b""  # absent: empty
    assert bytes(wire.bytes_view(msg + wire.encode_field(3, b"last"), 3)) == b"last"  # the last one wins


def test_bytes_view_refuses_what_does_not_add_up():
    msg = wire.encode_field(3, b"x" * 100)
    for bad in (msg[:-1], msg[:1], wire.encode_field(2, 1)[:-1] + b"\x80", b"\x0b"):  # short, no length, wire type 3
        with pytest.raises(ValueError):
            wire.bytes_view(bad, 3)
