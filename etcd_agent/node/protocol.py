"""The node protocol: what an orchestrator and ``etcd-agent node serve`` say to each other.

One session per host over the command's stdin/stdout, one JSON document per line, bounded:

- the caller opens with a ``Hello`` (protocol version, who it is, whether it wants the host's
  operation lock); the server answers with a ``Welcome`` (its versions) or an error and exits;
- then ``Request`` lines (``id``, ``step``, ``args``), each answered by one ``Reply`` with the same
  id: a result document or an error carrying its class, message, details and exit code, which the
  client rebuilds as the same ``AgentError`` class (``errors.error_from_json``);
- ``{"ping": n}`` lines keep the session alive while the caller waits; the server ends a session
  whose caller closed the stream or went silent for ``SILENCE_LIMIT`` seconds.

Every line is at most ``MAX_LINE`` bytes and parsed with ``safejson`` limits; each document is a
``typedjson.Document``, so a malformed one is a ``ProtocolError`` naming its field ("node
protocol: Hello.lock must be a boolean, not a string"), refused where it is read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Type, TypeVar

from etcd_agent.errors import AgentError, OperationFailed, ProtocolError, RefusedError, error_from_json
from etcd_agent.safejson import UnsafeJson, loads
from etcd_agent.typedjson import Document, JsonObject

D = TypeVar("D", bound=Document)

# Bumped when the documents change incompatibly; both ends must speak the same one, so an agent
# of another version is refused at the hello (the pre-check names it), never half-way through.
# 3: one `steps` call runs a host's members at once.
# 4: `node receive` speaks node.transfer's stream (ready line, frames, zstd, end record).
# 5: `restore` stages the restored data beside the data dir while etcd serves; `install` moves it in.
# 6: `halt`: a follower is signalled to stop and waited for only until its db is closed.
# 7: `node receive` takes what it receives, and for whom, from the stream's first frame (the order).
PROTOCOL = 7
MAX_LINE = 4 * 1024 * 1024
PING_EVERY = 5.0
# no line from the caller (requests or pings) for this long: it is gone or cut off
SILENCE_LIMIT = 60.0
WHERE = "node protocol"  # what a malformed document's ProtocolError starts with

@dataclass(frozen=True)
class Owner(Document):
    """Who drives a session: recorded in the host's lock so a refused second caller can be told."""

    token: str  # random per orchestrator run
    host: str  # the orchestrator's host name
    pid: int
    command: str  # e.g. "restore 20261201T100000Z-1a2b3c4d"

    def describe(self) -> str:
        return f"`etcd-agent {self.command}` (pid {self.pid} on {self.host})"


@dataclass(frozen=True)
class Hello(Document):
    ENVELOPE = "hello"  # {"hello": {...}}: the key says what the line is
    NOT_ENVELOPED = "the session must start with a hello"

    protocol: int
    owner: Owner
    lock: bool  # take this host's operation lock for the whole session


@dataclass(frozen=True)
class Welcome(Document):
    ENVELOPE = "welcome"
    NOT_ENVELOPED = "no welcome"

    protocol: int
    agent_version: str
    host: str


@dataclass(frozen=True)
class Request(Document):
    id: int
    step: str
    args: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class Reply(Document):
    """A result document or an error (``AgentError.to_json()``); the writer sets exactly one."""

    id: int
    result: Optional[JsonObject] = None
    error: Optional[JsonObject] = None

    @classmethod
    def failure(cls, rid: int, exc: AgentError) -> "Reply":
        return cls(rid, error=exc.to_json())

    def raise_for(self, where: str) -> JsonObject:
        """The result, or the sender's error rebuilt as its own class (same exit code)."""
        if self.error is not None:
            raise error_from_json(self.error, where=f"{where}: ")
        if self.result is None:
            raise ProtocolError(f"{WHERE}: a reply needs a result or an error")
        return self.result


def encode(doc: Mapping[str, Any]) -> bytes:
    line = json.dumps(doc, separators=(",", ":"), sort_keys=True, default=str).encode() + b"\n"
    if len(line) > MAX_LINE:
        raise OperationFailed(f"node protocol: a document of {len(line)} bytes exceeds the {MAX_LINE}-byte line limit")
    return line


def decode(line: bytes, where: str) -> JsonObject:
    """One line as a JSON object; OperationFailed naming ``where`` when it is not one."""
    try:
        doc = loads(line.strip(), max_bytes=MAX_LINE)
    except UnsafeJson as exc:
        raise OperationFailed(f"{where}: unreadable node protocol line ({exc})") from None
    if not isinstance(doc, dict):
        raise OperationFailed(f"{where}: node protocol line is not a JSON object")
    return doc


class StepArgs(Document):
    """Base of a step's arguments, one typed document per step (``Args.read``)."""

    ERROR = RefusedError  # the request is wrong: refused (exit 3), never a KeyError deep inside a step


class Args:
    """A request's arguments as they came (``raw``), read as the step's typed document."""

    def __init__(self, raw: Mapping[str, Any], step: str) -> None:
        self.raw = raw
        self.step = step

    def read(self, kind: Type[D]) -> D:
        """The arguments as ``kind``: a wrong or missing one is its refusal (a ``StepArgs``'s is
        RefusedError, exit 3) naming the step and the field."""
        return kind.from_json(self.raw, f"node {self.step}")
