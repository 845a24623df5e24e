"""Scripted hosts for the component tier: the orchestration runs for real against them, no etcd.

A ``ScriptedHost`` answers ``Host.spawn``: ``node serve`` gets the REAL node server
(``etcd_agent.node.server.serve``) in a thread, over real pipes, with a real flock for the host's
operation lock (each host its own backup dir), but with step handlers taken from a ``Script``;
``node receive`` gets a receiver that hashes what arrives. Everything not scripted fails closed:
an unscripted step is refused and recorded as a violation the test asserts on, and every other
``Host`` method raises. A host can be made unreachable, or to lose its session at a step.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from etcd_agent.backup.identity import Evidence
from etcd_agent.config import Config
from etcd_agent.errors import AgentError, HostUnreachable, RefusedError
from etcd_agent.hosts.local import PipeSession
from etcd_agent.node.protocol import PROTOCOL, Args, encode
from etcd_agent.node.replies import StepReply, StepsReply
from etcd_agent.node.server import Handler, NodeContext, serve
from etcd_agent.node.transfer import Decoder, FrameReader, Order, Ready, Received, StreamError
from etcd_agent.restore.host.facts import NodeFacts, work_dir_for
from etcd_agent.typedjson import Document

StepFn = Callable[[str, Args], Dict[str, Any]]  # (member, args) -> result; raise to fail


@dataclass(frozen=True)
class Verbatim(Document):
    """A scripted reply, sent exactly as the script wrote it (a test may script a malformed one:
    the orchestrator's reading is what it tests)."""

    doc: Dict[str, Any]

    def to_json(self) -> Dict[str, Any]:
        return dict(self.doc)


class Script:
    """What the hosts answer. ``calls`` records (host, step, member) in order, for assertions."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.calls: List[Tuple[str, str, str]] = []
        self.violations: List[str] = []
        self.steps: Dict[str, StepFn] = {}
        self.failures: Dict[Tuple[str, str], AgentError] = {}  # (step, member) -> error to raise
        self.facts: Dict[str, Dict[str, Any]] = {}  # member -> NodeFacts overrides
        self.received: Dict[str, str] = {}  # member -> sha256 of what arrived
        self.codecs: Dict[str, str] = {}  # member -> how it travelled
        self.stalls: List[str] = []  # members whose receiver stops reading after its ready line
        self.gone: List[str] = []  # hosts whose first receiver exits at once, without a word
        # (step, member) -> called as that step begins ("ship-data": a receiver before its first
        # frame), before any scripted failure: a test's probe of what runs at the same time
        self.hooks: Dict[Tuple[str, str], Callable[[], None]] = {}
        self.lock = threading.Lock()
        for name in ("begin", "restore", "fence", "halt", "stop", "aside", "install", "chown", "repair", "start", "serving", "unfence", "finish",
                     "rollback", "receive", "lock", "cleanup", "backup", "upgrade-member", "release-version"):
            self.steps[name] = self._ok(name)
        self.steps["precheck"] = self._precheck
        self.steps["rollback"] = self._rollback
        self.steps["receive"] = self._receive

    def fail(self, step: str, member: str, error: AgentError) -> None:
        self.failures[(step, member)] = error

    def _ok(self, name: str) -> StepFn:
        def fn(member: str, args: Args) -> Dict[str, Any]:
            return {"step": name, "member": member}
        return fn

    def _receive(self, member: str, args: Args) -> Dict[str, Any]:
        """``receive``: after a ship, the receipt; with ``copy_from`` (a member on the restoring
        master), the copy: the bytes at that offset of that file hashed like a receiver would."""
        from etcd_agent.restore.host.steps import ReceiveArgs

        a = args.read(ReceiveArgs)
        path = a.copy_from
        if path is None:
            return {"step": "receive", "member": member}
        offset = a.offset or 0
        size = os.path.getsize(path) - offset
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            fh.seek(offset)
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        with self.lock:
            self.received[member] = h.hexdigest()
            self.codecs[member] = "copy"
        return {"step": "receive", "member": member, "sha256": h.hexdigest(), "size": size}

    def _rollback(self, member: str, args: Args) -> Dict[str, Any]:
        return {"step": "rollback", "member": member, "did": ["etcd stopped", "old data dir back", "etcd started again"],
                "running": True, "was_running": True}

    def batch(self, host: str, args: Args, die_at: Optional[Tuple[str, str]]) -> StepsReply:
        """``steps``: several members' simple steps through the real server's ``run_members``
        (the members at once, each one's results and error). ``die_at`` (step, member) in the
        request: the session drops instead of answering, before any of it runs."""
        from etcd_agent.restore.host.steps import member_steps, run_members

        plan = member_steps(args)
        if any(die_at == (n, member) for member, names in plan for n in names):
            raise _Dropped()
        return run_members(plan, lambda member: lambda name: StepReply.from_json(
            self.run(host, name, member, args), f"scripted {name}"))

    def _host_of(self, member: str) -> str:
        return self.cfg.member(member).ssh_host

    def _precheck(self, member: str, args: Args) -> Dict[str, Any]:
        m = self.cfg.member(member)
        data_dir = self.cfg.data_dir(member)
        facts = NodeFacts(
            member=member, protocol=PROTOCOL, agent_version="test", etcd_version="3.5.16", etcdctl_version="3.5.16",
            etcdutl_version="3.5.16", free_bytes=10 << 30, data_dir=data_dir.rstrip("/"), data_dir_state="member",
            work_dir=work_dir_for(data_dir.rstrip("/"), member), conf_file=self.cfg.conf_file(member), conf_present=True,
            unit_present=True, backend="systemd", running=True, fence_ok=True, fence_detail="", identity_match=True,
            peer_url=m.peer_url, client_url=m.client_url,
        ).to_json()
        facts.update(self.facts.get(member, {}))
        return facts

    def run(self, host: str, step: str, member: str, args: Args) -> Dict[str, Any]:
        with self.lock:
            self.calls.append((host, step, member))
        hook = self.hooks.get((step, member))
        if hook is not None:
            hook()
        err = self.failures.get((step, member))
        if err is not None:
            raise err
        fn = self.steps.get(step)
        if fn is None:
            self.violations.append(f"unscripted step {step} for {member} on {host}")
            raise RefusedError(f"scripted host {host}: step {step!r} is not scripted")
        return fn(member, args)

    def steps_of(self, member: str) -> List[str]:
        return [s for _h, s, m in self.calls if m == member]


class ScriptedHost:
    """A ``Host`` whose only working method is ``spawn`` (the node protocol)."""

    def __init__(self, name: str, script: Script, cfg: Config, backup_dir: str) -> None:
        self.name = name
        self.script = script
        # the host's own backup dir: its operation lock is a real flock there
        self.cfg = dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, dir=backup_dir))
        self.reachable = True
        self.die_at: Optional[Tuple[str, str]] = None  # (step, member): the session drops instead of answering
        self.protocol = PROTOCOL  # another number plays an agent of another version
        self.sessions: List["ScriptedSession"] = []
        self.attempts: List[List[str]] = []  # every spawn asked for, reachable or not

    def spawn(self, argv: Sequence[str]) -> "ScriptedSession":
        self.attempts.append(list(argv))
        if not self.reachable:
            raise HostUnreachable(f"{self.name}: connect timed out (scripted)")
        if "serve" in argv:
            s: ScriptedSession = ServeSession(self)
        elif "receive" in argv:
            s = ReceiveSession(self, list(argv))
        else:
            raise AssertionError(f"{self.name}: unscripted command {list(argv)}")
        self.sessions.append(s)
        return s

    def spawn_stream(self, argv: Sequence[str]) -> "ScriptedSession":
        """What the OpenSSH client would carry: the same scripted session, marked as a stream."""
        s = self.spawn(argv)
        s.via = "stream"
        return s

    def _unscripted(self, *a: Any, **k: Any) -> Any:
        raise AssertionError(f"{self.name}: only the node protocol is scripted")

    run = read = write_atomic = exists = put = get = _unscripted

    def close(self) -> None:
        pass


class ScriptedSession(PipeSession):
    """Pipes to a thread playing the host's side (the caller's end is the product's, LocalHost's)."""

    def __init__(self, host: ScriptedHost) -> None:
        self.host = host
        self._in_r, self._in_w = os.pipe()  # we write the host's stdin
        self._out_r, self._out_w = os.pipe()  # the host writes its stdout
        super().__init__(host.name, os.fdopen(self._in_w, "wb"), self._out_r)
        self.code: Optional[int] = None
        self.via = "channel"  # or "stream": started by spawn_stream (the OpenSSH client's way)
        self.aborted = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        raise NotImplementedError

    def close(self, grace: float = 10.0) -> None:
        self.close_input()
        self._thread.join(grace)
        try:
            os.close(self._out_r)
        except OSError:
            pass

    def abort(self) -> None:
        """The connection drops, as ``SshSession.abort`` drops it: every session of this host
        ends (its side closing its pipe ends), the node session holding its lock included."""
        for s in list(self.host.sessions):
            s.aborted.set()
            s.close_input()

    def exit_code(self) -> Optional[int]:
        return self.code

    def stderr_tail(self) -> str:
        return ""


class _Dropped(BaseException):
    """The scripted host loses its session here."""


class ServeSession(ScriptedSession):
    def _main(self) -> None:
        stdin = os.fdopen(self._in_r, "rb")
        stdout = os.fdopen(self._out_w, "wb")
        host = self.host

        def handler_for(step: str) -> Handler:
            def handler(ctx: NodeContext, args: Args) -> Document:
                if step == "lock":
                    return ctx.take_lock()
                if step == "steps":
                    ctx.require_lock(step)
                    return host.script.batch(host.name, args, host.die_at)
                member = args.raw.get("member")
                if not isinstance(member, str):
                    raise RefusedError(f"scripted host: step {step} without a member")
                if host.die_at == (step, member):
                    raise _Dropped()
                if step != "precheck":
                    ctx.require_lock(step)
                return Verbatim(host.script.run(host.name, step, member, args))
            return handler

        handlers = {name: handler_for(name) for name in list(host.script.steps) + ["lock", "steps"]}
        try:
            self.code = serve(host.cfg, stdin, stdout, handlers, protocol=host.protocol)
        except _Dropped:
            self.code = -1  # the host vanished mid-step: no reply, the stream ends
        finally:
            # stdout only: the caller sees the end; the server's reader thread may still sit in a
            # read of stdin, which ends when the caller closes its side
            try:
                stdout.close()
            except OSError:
                pass


class ReceiveSession(ScriptedSession):
    """``node receive`` on a scripted host: the real stream rules (``node.transfer``: ready line,
    frames, codec, bounds, the end record), hashing instead of writing. ``Script.fail("ship-ready",
    member, error)`` refuses before any data, ``Script.fail("ship", member, error)`` after all of it."""

    def __init__(self, host: ScriptedHost, argv: List[str]) -> None:
        self.argv = argv
        self.order: Optional[Order] = None  # what the sender's first frame asked for
        self.nth = sum(isinstance(x, ReceiveSession) for x in host.sessions)  # receivers on the host before it
        super().__init__(host)

    def _main(self) -> None:
        failures = self.host.script.failures
        with os.fdopen(self._in_r, "rb") as stdin, os.fdopen(self._out_w, "wb") as stdout:
            def say(doc: Dict[str, Any]) -> None:
                stdout.write(encode(doc))
                stdout.flush()

            self.code = 1
            if self.host.name in self.host.script.gone and self.nth == 0:
                self.code = -1  # it died (or gave up waiting) before its order came
                return
            frames = FrameReader(stdin.readinto, f"{self.host.name}: the shipped snapshot")
            try:
                self.order = frames.order()
            except AgentError as exc:
                say(exc.to_json())
                return
            if self.order is None:  # started ahead, not needed
                self.code = 0
                return
            member, size, codec = self.order.member, self.order.size, self.order.codec
            frames.what = f"{member}: the shipped snapshot"
            refused = failures.get(("ship-ready", member))
            if refused is not None:
                say(refused.to_json())
                return
            say(Ready(PROTOCOL, codec, 10 << 30).to_json())
            if member in self.host.script.stalls:
                self.aborted.wait()  # a cut link: nothing read until the sender drops the connection
                return
            hook = self.host.script.hooks.get(("ship-data", member))
            if hook is not None:
                hook()
            h = hashlib.sha256()
            try:
                dec = Decoder(frames, codec, size)
                for chunk in dec.chunks():
                    h.update(chunk)
                end = dec.finish()
                if end.sha256 != h.hexdigest():
                    raise StreamError(f"{member}: sha256 mismatch (scripted)")
                err = failures.get(("ship", member))
                if err is not None:
                    raise err
            except AgentError as exc:
                say(exc.to_json())
                return
            self.host.script.received[member] = h.hexdigest()
            self.host.script.codecs[member] = codec
            self.code = 0
            say(Received(member, size, h.hexdigest(), frames.wire).to_json())


def scripted_nodes(script: Script, hosts: Dict[str, ScriptedHost],
                   here: Sequence[str] = ()) -> Callable[[Config], List[Any]]:
    """A ``nodes`` factory for ``Restore``/``Upgrade``: one node per configured member's host;
    the hosts in ``here`` are the master the restore runs on (their members copy, not receive)."""
    from etcd_agent.node.sessions import HostNode

    def make(cfg: Config) -> List[Any]:
        out: Dict[str, HostNode] = {}
        for m in cfg.members:
            n = out.get(m.ssh_host) or HostNode(m.ssh_host, hosts[m.ssh_host], m.ssh_host in here, [])
            n.members.append(m)
            out[m.ssh_host] = n
        return list(out.values())

    return make


class ScriptedCluster:
    """``LiveCluster`` with fixed answers: who leads, and that the restored members converge."""

    def __init__(self, cfg: Config, leader: Optional[str] = None, converge: bool = True) -> None:
        self.cfg = cfg
        self._leader = leader
        self.converge = converge
        self.lineage: List[List[str]] = []

    def evidence(self) -> Evidence:
        return Evidence(notes=("scripted: no running cluster",))

    def leader(self) -> Optional[str]:
        return self._leader

    def converged(self, timeout: float, say: Callable[[str], None]) -> Dict[str, int]:
        from etcd_agent.errors import OperationFailed

        if not self.converge:
            raise OperationFailed(f"restored cluster not healthy at one revision after {timeout:.0f}s (scripted)")
        return {m.name: 42 for m in self.cfg.members}

    def member_ids(self) -> Dict[str, Tuple[str, str]]:
        return {m.name: (f"{i + 1:x}", "c1") for i, m in enumerate(self.cfg.members)}

    def record_lineage(self, member_ids: List[str]) -> None:
        self.lineage.append(list(member_ids))

    def k8s_cleanup(self) -> List[str]:
        return []

    def wait_ready(self, member: object) -> Optional[float]:
        return None

    def writer(self) -> Any:
        raise AssertionError("the scripted cluster takes no writes: a point-in-time tail loaded into the members "
                             "needs a real etcd")
