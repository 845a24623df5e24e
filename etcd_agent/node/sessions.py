"""The hosts of the cluster as a cluster-wide operation sees them: one ``NodeClient`` session
per host (its members grouped), opened together and locked in a fixed order.

Restore and upgrade both drive the cluster this way: the sessions are opened in parallel, then
every host's operation lock is taken one host at a time, always in the same order, so of two
runs started together exactly one gets every lock and the other is refused (exit 4) having
touched nothing. Each lock lives as long as its session.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

from etcd_agent.config import Config, Member
from etcd_agent.errors import AgentError, BusyError, CommandTimedOut, HostUnreachable, RefusedError
from etcd_agent.hosts.base import Host
from etcd_agent.locality import is_local, machine_identity
from etcd_agent.node.client import NodeClient
from etcd_agent.node.protocol import Owner
from etcd_agent.node.replies import LockReply
from etcd_agent.typedjson import Document

log = logging.getLogger(__name__)
Progress = Callable[[str], None]
T = TypeVar("T")
D = TypeVar("D", bound=Document)


@dataclass
class HostNode:
    """One host of the cluster and the members it runs, spoken to through one session."""

    where: str  # "local" or the SSH address
    host: Host
    local: bool
    members: List[Member]
    client: Optional[NodeClient] = None

    def ask(self, kind: Type[D], step: str, **args: Any) -> D:
        """``step`` on this host, its reply read as ``kind`` (``NodeClient.ask``)."""
        if self.client is None:
            raise HostUnreachable(f"{self.where}: no session")
        return self.client.ask(kind, step, **args)


def group_hosts(cfg: Config) -> List[HostNode]:
    """Members grouped by the host that runs them (config order)."""
    from etcd_agent.hosts.local import LocalHost

    me = machine_identity() if cfg.local.name is None else None
    out: Dict[str, HostNode] = {}
    for m in cfg.members:
        if is_local(cfg, m, me):
            key = "local"
            node = out.get(key) or HostNode(key, LocalHost("local"), True, [])
        else:
            from etcd_agent.hosts.ssh import SshHost

            key = m.ssh_host
            node = out.get(key) or HostNode(key, SshHost(m.name, m.ssh_host, cfg.ssh), False, [])
        node.members.append(m)
        out[key] = node
    return list(out.values())


class StopWaiting(KeyboardInterrupt):
    """A second Ctrl-C while ``parallel`` waited for steps still running: the operator stops
    waiting. Nothing more is asked of the hosts (a rollback would queue behind those steps); the
    hosts' journals say how far each got."""


def parallel(fn: Callable[[Any], T], items: Sequence[Any]) -> List[Tuple[Any, Optional[T], Optional[BaseException]]]:
    """(item, result, error) for ``fn`` over ``items``, all at once. A Ctrl-C waits for every call
    to end (a step is never abandoned half-way by the orchestrator), says so, then is raised; a
    second one raises ``StopWaiting`` at once. Before, a Ctrl-C was taken for the error of the
    call being waited for, and the wait went on as if nothing happened."""
    if not items:
        return []
    out: List[Tuple[Any, Optional[T], Optional[BaseException]]] = []
    interrupted: Optional[KeyboardInterrupt] = None
    ex = ThreadPoolExecutor(max_workers=len(items))
    futs: "List[Tuple[Any, Future[T]]]" = []
    try:
        futs += [(it, ex.submit(fn, it)) for it in items]
        for it, f in futs:
            while True:
                try:
                    err = f.exception()  # the call's own error; a Ctrl-C in this wait is raised here
                    break
                except KeyboardInterrupt as exc:
                    if interrupted is not None:
                        raise StopWaiting("interrupted twice") from exc
                    interrupted = exc
                    running = sum(1 for _i, g in futs if not g.done())
                    log.warning("interrupted (Ctrl-C): waiting for the %d step(s) still running on the hosts to end "
                                "before stopping; Ctrl-C again to stop waiting", running)
            out.append((it, None, err) if err is not None else (it, f.result(), None))
    finally:
        ex.shutdown(wait=interrupted is None or all(f.done() for _i, f in futs), cancel_futures=True)
    if interrupted is not None:
        raise interrupted
    return out


def message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, AgentError) else f"{type(exc).__name__}: {exc}"


def no_answer(exc: Optional[BaseException]) -> bool:
    """The host did not answer (cut off, its session gone, a step timed out), as opposed to
    answering with a refusal or a failure."""
    return exc is None or isinstance(exc, (HostUnreachable, CommandTimedOut))


def open_sessions(cfg: Config, nodes: List[HostNode], owner: Owner, say: Progress,
                  require_all: bool = True, opened: Optional[Callable[[HostNode], None]] = None) -> Dict[str, str]:
    """A session on every host (in parallel), then every reachable host's lock in config order
    (``nodes`` as ``group_hosts`` returns them: by each host's first member), the same order on
    whichever master the run started: of two runs started together the first to lock the first
    host gets every lock, the other is refused at that host. BusyError (exit 4) names the holder
    (every session is closed then). A host that cannot be reached: RefusedError (exit 3) when
    ``require_all``, else it is returned (where -> why) with its session left empty, for a
    per-host report. Nothing is touched either way. ``opened(node)`` is told as each host's
    session is open, before any lock (restore starts its receivers there)."""

    def start(n: HostNode) -> None:
        n.client = NodeClient(cfg, n.host, n.where, local=n.local, owner=owner, lock=False)
        try:
            n.client.open()
        except BaseException:
            n.client = None
            raise
        if opened is not None:
            opened(n)

    failed = {n.where: message(e) for n, _r, e in parallel(start, nodes) if e is not None}
    if failed and require_all:
        close_sessions(nodes)
        raise RefusedError("cannot reach every master's agent; nothing touched",
                           details=[f"{w}: {why}" for w, why in failed.items()])
    for n in (n for n in nodes if n.client is not None):
        try:
            n.ask(LockReply, "lock")
        except BusyError as exc:
            close_sessions(nodes)
            raise BusyError(exc.message, details=["wait for it to finish (`etcd-agent status` on that master shows "
                                                  "it), then run the same command again"]) from None
    held = [n.where for n in nodes if n.client is not None]
    if held:
        say("took the operation lock on " + ", ".join(held))
    return failed


def close_sessions(nodes: List[HostNode]) -> None:
    """End every session (each host then releases its lock) and connection, the hosts at once:
    each close waits for its server's exit."""

    def close(n: HostNode) -> None:
        if n.client is not None:
            n.client.close()
            n.client = None
        n.host.close()

    for _n, _r, err in parallel(close, nodes):
        if err is not None:
            log.debug("closing a session: %s", message(err))


def local_node(nodes: List[HostNode]) -> Optional[HostNode]:
    return next((n for n in nodes if n.local), None)


def node_of(nodes: List[HostNode], member: str) -> HostNode:
    return next(n for n in nodes if any(m.name == member for m in n.members))
