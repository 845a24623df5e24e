"""What a watch stream delivers, as whole revisions: responses decoded, fragments put together.

A WatchResponse that does not decode ends the stream (the watcher reconnects; a response is never
skipped). With ``fragment=True`` etcd splits a large response into parts: ``Fragments`` holds
their events until the last part, at most ``MAX_FRAGMENTED`` bytes. ``by_revision`` turns a
response's events into one ``Txn`` per revision: a transaction never spans two segments.
"""
from __future__ import annotations

from typing import Iterator, List, Tuple

from etcd_agent.chain.segments import Event, Txn
from etcd_agent.etcd import proto
from etcd_agent.etcd.rpc import StreamEnded

MAX_FRAGMENTED = 512 * 1024 * 1024  # one response reassembled from fragments, at most


def decode(raw: bytes, limit: int) -> proto.WatchMessage:
    """One WatchResponse of at most ``limit`` bytes (the stream's max receive size)."""
    try:
        return proto.decode_watch_response(raw, limit)
    except ValueError as exc:
        raise StreamEnded(f"malformed watch response ({exc})") from None


class Fragments:
    """The events of a fragmented response, held until its last part arrives."""

    def __init__(self) -> None:
        self._events: List[Event] = []
        self._bytes = 0

    def clear(self) -> None:
        self._events, self._bytes = [], 0

    def add(self, events: Tuple[Event, ...]) -> None:
        """A part that is not the last: its events are held (ending the stream past the bound)."""
        self._events.extend(events)
        self._bytes += sum(len(e.key) + len(e.value) for e in events)
        if self._bytes > MAX_FRAGMENTED:
            raise StreamEnded(f"a fragmented watch response exceeds {MAX_FRAGMENTED} bytes")

    def whole(self, events: Tuple[Event, ...]) -> Tuple[Event, ...]:
        """The last part's (or an unfragmented response's) events after those held; none held after."""
        if self._events:
            events = tuple(self._events) + events
            self.clear()
        return events


def by_revision(events: Tuple[Event, ...], time_ms: int, catchup_until: int) -> Iterator[Txn]:
    """One Txn per revision, in the response's order; revisions up to ``catchup_until`` were
    received while catching up (their time is only an upper bound of the commit time)."""
    i, n = 0, len(events)
    while i < n:
        rev = events[i].mod_revision
        j = i + 1
        while j < n and events[j].mod_revision == rev:
            j += 1
        yield Txn(rev, time_ms, events[i:j], rev <= catchup_until)
        i = j
