"""``NodeClient``: the one client of the node protocol, for restore, upgrade and whatever else
runs a step on another master (or on this one, through the same code path).

It starts ``etcd-agent -c CONFIG node serve`` on the host (``Host.spawn``: a child process
locally, an SSH channel remotely), says hello, optionally takes the host's operation lock for the
whole session, then sends requests and rebuilds every error the host sends as its own class
(same exit code). A ping thread keeps the session alive while a step runs long.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import threading
from types import TracebackType
from typing import Any, List, Optional, Type, TypeVar

from etcd_agent.config import DEFAULT_PATH, Config
from etcd_agent.errors import AgentError, CommandTimedOut, HostUnreachable, OperationFailed, error_from_json
from etcd_agent.hosts.base import Host, Session
from etcd_agent.node.protocol import (
    MAX_LINE,
    PING_EVERY,
    PROTOCOL,
    WHERE,
    Hello,
    Owner,
    Reply,
    Request,
    Welcome,
    decode,
    encode,
)
from etcd_agent.typedjson import Document, JsonObject

log = logging.getLogger(__name__)
D = TypeVar("D", bound=Document)


def new_owner(command: str) -> Owner:
    """The identity of this run, recorded in every host lock it takes."""
    return Owner(secrets.token_hex(16), socket.gethostname(), os.getpid(), command)


def agent_argv(cfg: Config, local: bool) -> List[str]:
    """How to run this program on a host: the installed agent, or - rehearsing on a laptop, where
    the agent runs from a virtualenv - this very interpreter and package."""
    agent = cfg.ssh.agent_path
    prefix = [agent] if not local or os.path.exists(agent) else [sys.executable, "-m", "etcd_agent.cli.main"]
    return prefix + ["-c", cfg.path or DEFAULT_PATH]


class NodeClient:
    """A session with one host's agent."""

    def __init__(self, cfg: Config, host: Host, where: str, *, local: bool, owner: Owner, lock: bool,
                 timeout: Optional[float] = None) -> None:
        self.cfg = cfg
        self.host = host
        self.where = where
        self.local = local
        self.owner = owner
        self.lock = lock
        self.timeout = timeout if timeout is not None else cfg.ssh.command_timeout
        self.welcome: Optional[Welcome] = None
        self._session: Optional[Session] = None
        self._next_id = 0
        self._call_lock = threading.Lock()
        self._closed = threading.Event()
        self._pinger: Optional[threading.Thread] = None

    # ------------------------------------------------------------ session

    def open(self) -> Welcome:
        argv = agent_argv(self.cfg, self.local) + ["node", "serve"]
        self._session = self.host.spawn(argv)
        try:
            self._session.send(encode(Hello(PROTOCOL, self.owner, self.lock).to_json()))
            doc = self._read_doc(min(self.timeout, max(30.0, self.cfg.ssh.connect_timeout * 3)))
            if "error" in doc:
                raise error_from_json(doc["error"], where=f"{self.where}: ")
            self.welcome = Welcome.from_json(doc, WHERE)
        except BaseException:
            self._drop()
            raise
        self._pinger = threading.Thread(target=self._ping, name=f"ping-{self.where}", daemon=True)
        self._pinger.start()
        return self.welcome

    def _ping(self) -> None:
        n = 0
        while not self._closed.wait(PING_EVERY):
            n += 1
            session = self._session
            if session is None:
                return
            try:
                session.send(encode({"ping": n}))
            except AgentError:
                return  # the session broke: the next call says so

    def close(self) -> None:
        """End the session (the host releases its lock once its current step is done)."""
        self._drop()

    def _drop(self, grace: float = 10.0) -> None:
        self._closed.set()
        session, self._session = self._session, None
        if session is not None:
            try:
                session.close(grace)
            except Exception as exc:  # closing a broken session may fail in many ways
                log.debug("%s: closing the session: %s", self.where, exc)

    def __enter__(self) -> "NodeClient":
        if self._session is None:
            self.open()
        return self

    def __exit__(self, t: Optional[Type[BaseException]], e: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()

    # ------------------------------------------------------------ calls

    def ask(self, kind: Type[D], step: str, *, timeout: Optional[float] = None, **args: Any) -> D:
        """``call``, its result read as ``kind`` (ProtocolError naming the field that is not one)."""
        return kind.from_json(self.call(step, timeout=timeout, **args), f"{self.where}: node {step} reply")

    def call(self, step: str, *, timeout: Optional[float] = None, **args: Any) -> JsonObject:
        """Run ``step`` on the host; its result, or its error rebuilt (BusyError stays exit 4 ...)."""
        with self._call_lock:
            if self._session is None:
                raise HostUnreachable(f"{self.where}: no open session (it ended earlier)")
            self._next_id += 1
            req = Request(self._next_id, step, args)
            try:
                self._session.send(encode(req.to_json()))
                while True:
                    doc = self._read_doc(timeout if timeout is not None else self.timeout)
                    reply = Reply.from_json(doc, WHERE)
                    if reply.id in (req.id, -1):
                        break
                    log.debug("%s: dropping a reply to an earlier request %s", self.where, reply.id)
            except CommandTimedOut:
                self._drop(grace=0.0)  # the host finishes its step, then ends the session by itself
                raise CommandTimedOut(f"{self.where}: node {step} did not answer within "
                                      f"{timeout if timeout is not None else self.timeout:g}s; session closed") from None
            except HostUnreachable:
                self._drop()
                raise
            return reply.raise_for(self.where)

    def _read_doc(self, timeout: float) -> JsonObject:
        assert self._session is not None
        line = self._session.recv_line(timeout, MAX_LINE)
        if not line.endswith(b"\n"):
            tail = self._session.stderr_tail()
            code = self._session.exit_code()
            if code in (126, 127):
                raise HostUnreachable(f"{self.where}: etcd-agent is not runnable there (exit {code}): {tail}")
            raise HostUnreachable(f"{self.where}: the node session ended"
                                  + (f" (exit {code})" if code is not None else "") + (f": {tail}" if tail else ""))
        try:
            return decode(line, self.where)
        except OperationFailed:
            self._drop()
            raise


__all__ = ["NodeClient", "agent_argv", "new_owner"]
