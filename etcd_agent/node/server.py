"""``etcd-agent node serve``: the remote end of the node protocol, run on every host it drives.

The same program as the orchestrator, so the steps it runs are the ones tested once. A reader
thread takes lines off stdin (requests go to a queue; pings only prove the caller is alive); the
main thread runs one request at a time and answers on stdout. The session - and with it this
host's operation lock, when the caller asked for it - ends at end-of-file, when the caller has
been silent for ``SILENCE_LIMIT`` seconds, or on SIGTERM/SIGHUP, always after the step that is
running finished (a step never stops half-way because its caller went away: it is journaled, and
the next run resumes or rolls back from there). Logs go to stderr.

A step that is still running ``STOP_GRACE`` seconds after the session ended (stuck on a read that
never returns, a helper that hangs) is not waited for: its helpers (this process group's other
processes) and this process end, and the lock with them. Without that, a caller killed with -9
left its session running for ever, holding the host's lock against every later command.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, List, Optional

from etcd_agent import __version__
from etcd_agent.config import Config
from etcd_agent.errors import EXIT_FAILED, AgentError, BusyError, OperationFailed, RefusedError
from etcd_agent.node.protocol import (
    MAX_LINE,
    PROTOCOL,
    SILENCE_LIMIT,
    WHERE,
    Args,
    Hello,
    Owner,
    Reply,
    Request,
    Welcome,
    decode,
    encode,
)
from etcd_agent.node.replies import LockReply
from etcd_agent.state.locks import SHORT_WAIT, Holder, OperationLock, SessionOwner, lock_path_for
from etcd_agent.typedjson import Document, JsonObject
from etcd_agent.waiting import SYSTEM_CLOCK, Clock, poll

log = logging.getLogger(__name__)

# how long a step may still run once its session is over (the caller closed it, died, went silent,
# or SIGTERM/SIGHUP): a journaled step that ends within it is kept; one that does not is stuck
STOP_GRACE = 30.0
HELPER_TERM_WAIT = 5.0


@dataclass
class NodeContext:
    """What a step handler gets: the host's config, who drives the session, the lock it holds."""

    cfg: Config
    owner: Owner
    lock: Optional[OperationLock]

    def take_lock(self) -> LockReply:
        """This host's operation lock for the rest of the session (BusyError naming the holder)."""
        if self.lock is None or not self.lock.held:
            from etcd_agent.fs import ensure_private_dir

            ensure_private_dir(self.cfg.backup.dir)
            # this host's own backup (the daemon's or cron's) ends by itself: wait for it
            self.lock = OperationLock(lock_path_for(self.cfg.backup.dir), self.owner.command,
                                      holder=Holder(owner=SessionOwner(**self.owner.to_json()))).acquire(wait=SHORT_WAIT)
        return LockReply(self.lock.path, True)

    def require_lock(self, step: str) -> None:
        """Steps that change anything run only inside a session holding this host's lock."""
        if self.lock is None or not self.lock.held:
            raise RefusedError(f"node {step}: this session does not hold the host's operation lock")


Handler = Callable[[NodeContext, Args], Document]  # a step: its typed reply


class _Stop:
    """Sentinel on the request queue: the session is over."""

    def __init__(self, why: str) -> None:
        self.why = why


def serve(cfg: Config, stdin: BinaryIO, stdout: BinaryIO, handlers: Dict[str, Handler],
          silence_limit: float = SILENCE_LIMIT, stop: Callable[[], str] = lambda: "", protocol: int = PROTOCOL,
          stuck: Optional[Callable[[str, str], None]] = None) -> int:
    """Run one session; returns the process exit code. ``stop()`` returning a reason ends the
    session after the running step (``node serve`` sets it from SIGTERM/SIGHUP). ``protocol``
    is what this end speaks (tests play an agent of another version with it). ``stuck(step,
    why)`` is called when a step is still running ``STOP_GRACE`` seconds after the session ended
    (``node serve``: ``end_stuck_session``, which does not return); None: keep waiting for it."""
    hello_line = stdin.readline(MAX_LINE + 1)
    if not hello_line:
        return 0  # the caller went away before saying anything
    try:
        hello = Hello.from_json(decode(hello_line, "hello"), WHERE)
        if hello.protocol != protocol:
            raise RefusedError(f"this agent ({__version__}) speaks node protocol {protocol}, the caller "
                               f"{hello.protocol}: install the same etcd-agent version on every master")
    except AgentError as exc:
        _write(stdout, {"error": exc.to_json()})
        return exc.exit_code
    ctx = NodeContext(cfg, hello.owner, None)
    if hello.lock:
        try:
            ctx.take_lock()
        except AgentError as exc:
            _write(stdout, {"error": exc.to_json()})
            return exc.exit_code
    try:
        if not _write(stdout, Welcome(protocol, __version__, socket.gethostname()).to_json()):
            return 0
        log.info("node session for %s started%s", hello.owner.describe(), " (host lock held)" if ctx.lock else "")
        why = _loop(ctx, stdin, stdout, handlers, silence_limit, stop, stuck)
        log.info("node session for %s ended: %s", hello.owner.describe(), why)
        return 0
    finally:
        if ctx.lock is not None:
            ctx.lock.release()


class _State:
    """What the watchdog reads: the step running now, and why the session is over ("": it is not)."""

    def __init__(self) -> None:
        self.step: Optional[str] = None
        self.over = ""


def _watch(over: Callable[[], str], state: _State, stuck: Callable[[str, str], None], grace: float,
           clock: Clock = SYSTEM_CLOCK) -> None:
    """Once the session is over (``over()`` says why), give the running step ``grace`` seconds,
    then call ``stuck`` if one still runs."""
    why = poll(over, timeout=math.inf, what="the end of the session", interval=0.5, clock=clock)
    clock.sleep(grace)
    step = state.step
    if step is not None:
        stuck(step, why)


def end_stuck_session(step: str, why: str) -> None:
    """A step outlived its session by ``STOP_GRACE``: end its helpers and this process (and so
    the lock). Its journal says how far it got: the next run resumes or rolls back from there."""
    log.error("node step %s still running %.0fs after the session ended (%s): stopping it, its helpers and this "
              "session; the host's journal lets the next run resume or roll back", step, STOP_GRACE, why)
    for pid in _helpers():
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    time.sleep(HELPER_TERM_WAIT)
    for pid in _helpers():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    logging.shutdown()
    os._exit(EXIT_FAILED)


def _helpers() -> List[int]:
    """This process's descendants in its own process group: what its steps started (etcdutl, ...).
    A member etcd started by the process backend has a session of its own and is left alone."""
    import psutil

    me = psutil.Process()
    out = []
    for child in me.children(recursive=True):
        try:
            if os.getpgid(child.pid) == os.getpgrp():
                out.append(child.pid)
        except OSError:
            continue
    return out


def _loop(ctx: NodeContext, stdin: BinaryIO, stdout: BinaryIO, handlers: Dict[str, Handler],
          silence_limit: float, stop: Callable[[], str], stuck: Optional[Callable[[str, str], None]]) -> str:
    requests: "queue.Queue[Any]" = queue.Queue()
    last_heard = [time.monotonic()]
    state = _State()

    def over() -> str:
        if state.over or stop():
            return state.over or stop()
        silent = time.monotonic() - last_heard[0]
        return f"the caller was silent for {silent:.0f}s" if silent > silence_limit else ""

    if stuck is not None:
        threading.Thread(target=_watch, args=(over, state, stuck, STOP_GRACE), name="node-watchdog",
                         daemon=True).start()

    def reader() -> None:
        while True:
            try:
                line = stdin.readline(MAX_LINE + 1)
            except (OSError, ValueError) as exc:
                requests.put(_Stop(f"stdin unreadable ({exc})"))
                return
            if not line:
                state.over = "the caller closed the session (or died)"
                requests.put(_Stop(state.over))
                return
            last_heard[0] = time.monotonic()
            if len(line) > MAX_LINE:
                requests.put(_Stop(f"a line longer than {MAX_LINE} bytes"))
                return
            try:
                doc = decode(line, "request")
            except OperationFailed as exc:
                requests.put(_Stop(exc.message))
                return
            if "ping" not in doc:
                requests.put(doc)

    threading.Thread(target=reader, name="node-reader", daemon=True).start()
    while True:
        why = stop()
        if why:
            return why
        try:
            item = requests.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() - last_heard[0] > silence_limit:
                return f"the caller was silent for {silence_limit:g}s"
            continue
        if isinstance(item, _Stop):
            return item.why
        state.step = str(item.get("step", "?"))
        try:
            reply = _dispatch(ctx, item, handlers)
        finally:
            state.step = None
        if not _write(stdout, reply.to_json()):
            return "the caller stopped reading"


def _dispatch(ctx: NodeContext, doc: JsonObject, handlers: Dict[str, Handler]) -> Reply:
    rid = doc.get("id") if isinstance(doc.get("id"), int) else -1
    try:
        req = Request.from_json(doc, WHERE)
        fn = handlers.get(req.step)
        if fn is None:
            raise RefusedError(f"node: unknown step {req.step!r} (agent {__version__})")
        return Reply(req.id, result=fn(ctx, Args(req.args, req.step)).to_json())
    except AgentError as exc:
        return Reply.failure(int(rid or -1), exc)
    except Exception as exc:  # a bug in a step: reported to the caller as a failure, not a hang
        log.exception("node step failed unexpectedly")
        return Reply.failure(int(rid or -1), OperationFailed(f"node step crashed: {type(exc).__name__}: {exc}"))


def _write(stdout: BinaryIO, doc: JsonObject) -> bool:
    try:
        stdout.write(encode(doc))
        stdout.flush()
        return True
    except (BrokenPipeError, OSError, ValueError):
        return False


__all__ = ["NodeContext", "Handler", "serve", "BusyError"]
