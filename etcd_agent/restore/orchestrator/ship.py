"""Shipping a restore's snapshot to every member at once, as fast as the links carry it.

The snapshot is read once here, hashed once as it is read, compressed once when that pays
(``node.transfer.choose_codec``), and the same frames go to one ``etcd-agent node receive`` per
member over a stream of its own (a channel of that host's SSH connection; a child process for this
host), one thread per member: hosts in parallel, the slowest sets the pace, memory stays bounded
(``QUEUE_DEPTH`` frames per member). Nothing is sent before every receiver said it is ready, and
the end record - the only thing that lets a receiver commit - goes out only once the sha256 read
here matches the manifest's. A member that fails stops the whole ship (a restore needs them all):
the others are closed without an end record, so every receiver removes its temp file, and etcd
has not been touched anywhere.

A watchdog closes the connection of a host whose stream has not moved for ``idle`` seconds: on a
cut link a send (or a close) would otherwise wait forever inside paramiko.

Starting a receiver (an SSH session and an agent start on a loaded host: ~0.3 s) is not on the
ship's clock when the restore runs unattended: ``Standby`` starts them as each host's session opens,
and a receiver learns what it takes from the stream's first frame (``node.transfer.Order``).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from etcd_agent.config import Config, Member
from etcd_agent.errors import AgentError, CommandTimedOut, HostUnreachable, OperationFailed, error_from_json
from etcd_agent.hosts.base import Host, Session
from etcd_agent.node.client import agent_argv
from etcd_agent.node.protocol import PROTOCOL, SILENCE_LIMIT, Owner, decode
from etcd_agent.node.sessions import HostNode, message, parallel
from etcd_agent.node.transfer import (
    CodecChoice,
    Encoder,
    End,
    Order,
    Ready,
    Received,
    choose_codec,
    data_frames,
    end_frame,
    order_frame,
)
from etcd_agent.restore.orchestrator.source import Source

log = logging.getLogger(__name__)

READ_SIZE = 1 << 20
QUEUE_DEPTH = 16  # frames in flight per member: 16 MiB at most when raw
READY_TIMEOUT = 60.0  # an agent starting on a loaded host, over SSH
WATCH_EVERY = 0.5
# a receiver waits this much longer for data than the sender's watchdog: the sender, which knows
# which host stalled, is the one that reports it
RECEIVER_GRACE = 10.0
ANSWER_LIMIT = 1 << 16

Frame = Tuple[bytes, memoryview]
Item = Union[Frame, None]  # None: the stream is complete, close it and wait for the receipt


@dataclass(frozen=True)
class Target:
    """One member's receiver: where it runs, the command that starts it, what it is to take."""

    member: str
    where: str  # "er2 (10.213.4.12)", for messages
    host: Host
    argv: List[str]
    order: Order
    standby: Optional[Session] = None  # a receiver started ahead for it (``Standby``)


@dataclass(frozen=True)
class Shipped:
    """What a ship did: the sha256 every member confirmed, and how fast."""

    sha256: str
    size: int
    codec: CodecChoice
    wire: int  # bytes sent to each member, frames included
    seconds: float
    hosts: Dict[str, float] = field(default_factory=dict)  # member -> seconds until its receipt
    ready: float = 0.0  # seconds until every receiver was ready (a receiver's start included)

    def describe(self) -> str:
        slowest = max(self.hosts.values()) if self.hosts else self.seconds
        rate = f", {self.size / slowest / 1e6:.0f} MB/s per member" if slowest > 0 else ""
        return (f"shipped {self.size} bytes to {len(self.hosts)} member(s) in {self.seconds:.2f}s{rate}; "
                f"{self.codec.describe()}: {self.wire} bytes on each link")


class _Cancelled(Exception):
    """Another member failed: this stream ends without an end record."""


class _Sink:
    """One member: its session, its queue of frames, how far it got."""

    def __init__(self, target: Target, broken: threading.Event) -> None:
        self.t = target
        self.broken = broken  # set when any member (or the read here) failed: everyone stops
        self.q: "queue.Queue[Item]" = queue.Queue(QUEUE_DEPTH)
        self.session: Optional[Session] = None
        self.error: Optional[BaseException] = None
        self.receipt: Optional[Received] = None
        self.wire = 0
        self.moved = time.monotonic()  # when its stream last moved, or began to wait on the link
        self.blocked = False  # inside a send or close that waits on the link
        self.seconds = 0.0
        self._answered = False  # the receiver has said something (ready, or why not)
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the receiver's lines

    def _answer(self, timeout: float) -> Dict[str, Any]:
        assert self.session is not None
        line = self.session.recv_line(timeout, ANSWER_LIMIT)
        if not line.endswith(b"\n"):
            tail = self.session.stderr_tail()
            raise OperationFailed(f"{self.t.where}: the receiver ended without an answer" + (f": {tail}" if tail else ""))
        doc = decode(line, self.t.where)
        self._answered = True
        if "error" in doc:
            raise error_from_json(doc, where=f"{self.t.where}: ")
        return doc

    def open(self) -> None:
        """Give the receiver its order (starting one, unless one was started ahead); return once
        it is ready for the data (or raise why it is not). The first receiver is a stream session
        (``Host.spawn_stream``: the OpenSSH client, usually). One that is gone without a word (it
        gave up waiting, its link broke, the OpenSSH client would not connect where paramiko
        did) is replaced once by a fresh one on a channel of the host's own connection, the one
        that already works: the first was a shortcut, not a promise. One that answered - a
        refusal - has spoken for its host."""
        self.session = self.t.standby if self.t.standby is not None else self.t.host.spawn_stream(self.t.argv)
        try:
            self._order()
            return
        except CommandTimedOut:
            raise  # it is there, but slow: a second one would not be quicker
        except AgentError as exc:
            if self._answered:
                raise
            log.warning("%s: the receiver is gone without a word (%s); starting another over the host's "
                        "own connection", self.t.where, message(exc))
            # that session alone: ``abort`` on a channel would close the host's whole
            # connection, and with it the session that holds the host's lock
            self.session.close(1.0)
        self.session = self.t.host.spawn(self.t.argv)
        self._order()

    def _order(self) -> None:
        assert self.session is not None
        for part in order_frame(self.t.order):
            self.session.send(part)
        ready = Ready.from_json(self._answer(READY_TIMEOUT), self.t.where)
        codec = self.t.order.codec
        if ready.protocol != PROTOCOL or ready.codec != codec:
            raise OperationFailed(f"{self.t.where}: the receiver speaks protocol {ready.protocol} with codec "
                                  f"{ready.codec}, this sender {PROTOCOL} with {codec}")

    # ------------------------------------------------------------ streaming (its own thread)

    def run(self, t0: float, finish_timeout: float) -> None:
        session = self.session
        assert session is not None
        try:
            while True:
                try:
                    item = self.q.get(timeout=0.25)
                except queue.Empty:
                    if self.broken.is_set():
                        raise _Cancelled() from None
                    continue
                if self.broken.is_set():
                    raise _Cancelled()
                if item is None:
                    break
                for part in item:
                    self._blocking(functools.partial(session.send, part))
                    self.wire += len(part)
            self._blocking(session.close_input)
            self.receipt = Received.from_json(self._answer(finish_timeout), self.t.where)
            self.seconds = time.monotonic() - t0
        except _Cancelled:
            self._end_quietly()
        except BaseException as exc:
            self.fail(self._explain(exc))

    def _blocking(self, fn: Callable[[], None]) -> None:
        """``fn`` may wait on the link: the watchdog times it from here (a wait for frames does not count)."""
        self.moved = time.monotonic()
        self.blocked = True
        try:
            fn()
        finally:
            self.blocked = False
            self.moved = time.monotonic()

    def _explain(self, exc: BaseException) -> BaseException:
        """A send that failed mostly means the receiver stopped and said why: its line beats ours."""
        if not isinstance(exc, HostUnreachable) or self.error is not None or self.session is None:
            return exc
        try:
            line = self.session.recv_line(2.0, ANSWER_LIMIT)
            doc = decode(line, self.t.where) if line.endswith(b"\n") else {}
        except AgentError:
            return exc
        return error_from_json(doc, where=f"{self.t.where}: ") if "error" in doc else exc

    def _end_quietly(self) -> None:
        """End the stream without an end record: the receiver removes what it wrote."""
        try:
            self._blocking(self.session.close_input)  # type: ignore[union-attr]
        except AgentError:
            pass

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc
        self.broken.set()

    def stalled(self, now: float, idle: float) -> bool:
        return self.blocked and self.error is None and now - self.moved > idle

    def close(self) -> None:
        if self.session is None:
            return
        if isinstance(self.error, HostUnreachable):
            self.session.abort()  # a polite close could wait on the dead link
        else:
            self.session.close()


def fan_out(source: Source, targets: Sequence[Target], *, codec: CodecChoice, idle: float) -> Shipped:
    """Ship ``source``'s snapshot to every target at once (see the module's docstring)."""
    broken = threading.Event()
    sinks = [_Sink(t, broken) for t in targets]
    t0 = time.monotonic()
    try:
        refused = [f"{message(e)}" for _s, _r, e in parallel(lambda s: s.open(), sinks) if e is not None]
        if refused:
            broken.set()
            raise OperationFailed("shipping the snapshot was refused before any data was sent; nothing stopped",
                                  details=refused)
        ready = time.monotonic() - t0
        threads = [threading.Thread(target=s.run, args=(t0, max(120.0, source.size / 20e6)),
                                    name=f"ship-{s.t.member}", daemon=True) for s in sinks]
        for th in threads:
            th.start()
        joined = threading.Event()
        watchdog = threading.Thread(target=_watch, args=(sinks, idle, joined), name="ship-watchdog", daemon=True)
        watchdog.start()
        try:
            sha = _pump(source, sinks, codec.codec, broken)
        except BaseException:
            broken.set()
            raise
        finally:
            for th in threads:
                th.join()  # bounded: the watchdog frees a thread stuck on a cut link
            joined.set()
            watchdog.join()
        errors = [s.error for s in sinks if s.error is not None]
        if errors:
            raise OperationFailed("shipping the snapshot failed; nothing stopped", details=[message(e) for e in errors])
        assert sha is not None
    finally:
        parallel(lambda s: s.close(), sinks)
    return Shipped(sha, source.size, codec, sinks[0].wire if sinks else 0, time.monotonic() - t0,
                   {s.t.member: s.seconds for s in sinks}, ready)


def _pump(source: Source, sinks: List[_Sink], codec: str, broken: threading.Event) -> Optional[str]:
    """Read, hash and encode the snapshot once; every frame to every member. The end record only
    once what was read is what the manifest claims. None when a member failed meanwhile."""

    def put(item: Item) -> bool:
        for s in sinks:
            while True:
                if broken.is_set():
                    return False
                try:
                    s.q.put(item, timeout=0.25)
                    break
                except queue.Full:
                    continue
        return True

    h = hashlib.sha256()
    enc = Encoder(codec, source.size)
    left = source.size
    with source.open() as fh:
        while left > 0:
            chunk = fh.read(min(READ_SIZE, left))
            if not chunk:
                raise OperationFailed(f"{source.path}: the snapshot ended {left} bytes early; nothing stopped")
            left -= len(chunk)
            h.update(chunk)
            for frame in data_frames(enc.feed(chunk)):
                if not put(frame):
                    return None
    for frame in data_frames(enc.flush()):
        if not put(frame):
            return None
    sha = h.hexdigest()
    if source.sha256 is not None and sha != source.sha256:
        raise OperationFailed(f"{source.path}: the snapshot read {sha[:16]}..., the manifest says "
                              f"{source.sha256[:16]}...; no member kept it, nothing stopped")
    if not put(end_frame(End(source.size, sha))) or not put(None):
        return None
    return sha


def _watch(sinks: List[_Sink], idle: float, joined: threading.Event) -> None:
    """Until every member's thread is done: close the connection of one whose stream has not
    moved for ``idle`` seconds."""
    while not joined.wait(WATCH_EVERY):
        now = time.monotonic()
        for s in sinks:
            if s.stalled(now, idle) and s.session is not None:
                s.fail(HostUnreachable(f"{s.t.where}: the stream has not moved for {idle:g}s after {s.wire} bytes "
                                       "(a cut link, or a host that stopped reading); its connection was closed"))
                s.session.abort()


def _idle(cfg: Config) -> float:
    return min(cfg.ssh.command_timeout, SILENCE_LIMIT)


def receiver_argv(cfg: Config, local: bool) -> List[str]:
    """``node receive`` on a host: the same for every member and op (the order says the rest)."""
    return agent_argv(cfg, local) + ["node", "receive", "--idle-timeout", f"{_idle(cfg) + RECEIVER_GRACE:g}"]


class Standby:
    """Receivers started ahead, one per member on another master: ``start(node)`` as soon as
    that host's session is open (so never on a host that cannot be reached), while the other
    sessions open and the hosts pre-check. Each waits for its order; one the ship does not take
    is closed before any order and exits having looked at nothing. ``close`` (always called)
    ends those, once their start is done."""

    def __init__(self, cfg: Config, workers: int) -> None:
        self.cfg = cfg
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="standby")
        self._started: Dict[str, "Future[Session]"] = {}
        self._lock = threading.Lock()

    def start(self, node: HostNode) -> None:
        """A receiver for each of ``node``'s members, started in the background."""
        if node.local:
            return  # this master's own members copy from the file here
        with self._lock:
            for m in node.members:
                self._started[m.name] = self._pool.submit(node.host.spawn_stream, receiver_argv(self.cfg, node.local))

    def take(self, member: str) -> Optional[Session]:
        """The receiver started for ``member``, or None (none was, or its start failed: the ship
        starts one itself and reports why if that fails too)."""
        with self._lock:
            fut = self._started.pop(member, None)
        if fut is None:
            return None
        try:
            return fut.result()  # bounded: a spawn's connect and exec have their own timeouts
        except Exception as exc:
            log.info("%s: the receiver started ahead did not start: %s", member, message(exc))
            return None

    def close(self) -> None:
        with self._lock:
            left, self._started = list(self._started.values()), {}
        for fut in left:
            fut.add_done_callback(_end_unused)
        self._pool.shutdown(wait=True)


def _end_unused(fut: "Future[Session]") -> None:
    if fut.exception() is None:
        try:
            fut.result().close(2.0)  # end-of-file before any order: it exits 0, nothing looked at
        except Exception as exc:  # closing a session that broke meanwhile may fail in many ways
            log.debug("closing an unused receiver: %s", exc)


def ship_snapshot(cfg: Config, source: Source, members: Sequence[Tuple[Member, HostNode]], *, op: str, owner: Owner,
                  say: Callable[[str], None], standby: Optional[Standby] = None) -> Shipped:
    """The restore's ship: decide the codec from samples, order a receiver per member (started
    ahead by ``standby``, or now), fan out."""
    codec = choose_codec(source.read_at, source.size)
    say(f"shipping {source.size} bytes to {len(members)} member(s), {codec.describe()}")
    targets = [Target(m.name, f"{m.name} ({n.where})", n.host, receiver_argv(cfg, n.local),
                      Order(m.name, op, owner.token, source.size, codec.codec),
                      standby.take(m.name) if standby is not None else None)
               for m, n in members]
    shipped = fan_out(source, targets, codec=codec, idle=_idle(cfg))
    log.info("%s", shipped.describe())
    return shipped
