"""etcd's messages read from the wire: the generated classes of ``pb``, parsed bounded.

Every response is hostile until parsed: its size is checked against the caller's bound before
protobuf sees it (the channel's max receive size is the first bound, this the explicit second),
and a parse failure is a ``ValueError`` naming the message, which each caller turns into its own
error (``EtcdError``, ``StreamEnded``). Pure code, no grpc.
"""
from __future__ import annotations

from typing import Type, TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)


def parse(cls: Type[M], raw: bytes, limit: int) -> M:
    """``raw`` as a ``cls``; ValueError when longer than ``limit`` bytes or not a ``cls``.

    proto3 parsing is lenient where the format allows it (unknown fields kept aside, absent
    fields at their defaults) and strict where it does not: truncation, bad varints, wire types
    that do not exist and strings that are not UTF-8 fail."""
    if len(raw) > limit:
        raise ValueError(f"{cls.__name__} of {len(raw)} bytes exceeds the bound of {limit}")
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        raise ValueError(f"not a {cls.__name__} ({exc})") from None


def serialize(message: Message) -> bytes:
    """A request's bytes: the serializer handed to gRPC for every call made with raw channels."""
    return message.SerializeToString()
