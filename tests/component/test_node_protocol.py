"""The node protocol end to end over real pipes: the real server, the real client."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

import pytest

from etcd_agent.config import parse_text
from etcd_agent.errors import EXIT_BUSY, EXIT_REFUSED, AgentError, BusyError, CommandTimedOut, HostUnreachable
from etcd_agent.node.client import NodeClient, new_owner
from etcd_agent.node.protocol import MAX_LINE, Args, StepArgs
from etcd_agent.node.server import NodeContext, serve
from tests.harness.scripted import Script, ScriptedHost, ServeSession

pytestmark = pytest.mark.component


def cfg(tmp: str) -> Any:
    c, errors = parse_text(f'[backup]\ndir = "{tmp}/b"\n[[member]]\nname = "h1"\nhost = "10.0.0.1"\n', path=f"{tmp}/a.toml")
    assert c is not None and not errors
    os.makedirs(f"{tmp}/b", mode=0o700)
    return c


def client(tmp: str, script: Script, **kw: Any) -> NodeClient:
    c = cfg(tmp)
    host = ScriptedHost("h1", script, c, f"{tmp}/b")
    return NodeClient(c, host, "h1", local=False, owner=new_owner("test"), lock=False, **kw)


def test_errors_cross_the_wire_as_their_own_class(tmp_path: object) -> None:
    c = cfg(str(tmp_path / "x"))  # type: ignore[operator]
    script = Script(c)
    script.fail("stop", "h1", BusyError("h1: someone else is stopping it"))
    with client(str(tmp_path), script) as nc:
        nc.call("lock")
        with pytest.raises(BusyError) as ei:
            nc.call("stop", member="h1", op="x")
        assert ei.value.exit_code == EXIT_BUSY and ei.value.message.startswith("h1: h1: someone else")
        with pytest.raises(AgentError) as ei2:
            nc.call("no-such-step", member="h1")
        assert ei2.value.exit_code == EXIT_REFUSED and "unknown step 'no-such-step'" in ei2.value.message
        assert nc.call("start", member="h1", op="x")["step"] == "start"


def test_a_changing_step_without_the_lock_is_refused(tmp_path: object) -> None:
    c = cfg(str(tmp_path / "x"))  # type: ignore[operator]
    with client(str(tmp_path), Script(c)) as nc:
        with pytest.raises(AgentError) as ei:
            nc.call("stop", member="h1", op="x")
    assert ei.value.exit_code == EXIT_REFUSED and "does not hold the host's operation lock" in ei.value.message


def test_a_silent_caller_loses_its_session_and_the_lock(tmp_path: object) -> None:
    c = cfg(str(tmp_path))  # type: ignore[arg-type]
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    ended: Dict[str, int] = {}

    def run() -> None:
        # stdin stays open, as a half-open connection leaves it (closing it under the server's
        # reader thread would block, which is why `node serve` leaves with os._exit)
        stdin = os.fdopen(r, "rb")
        with os.fdopen(out_w, "wb") as stdout:
            ended["code"] = serve(c, stdin, stdout, {"lock": lambda ctx, a: ctx.take_lock()}, silence_limit=0.5)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    from etcd_agent.node.protocol import PROTOCOL, Hello, encode
    from etcd_agent.state.locks import holder_of

    os.write(w, encode(Hello(PROTOCOL, new_owner("silent"), True).to_json()))
    with os.fdopen(out_r, "rb") as replies:
        assert b"welcome" in replies.readline()
        assert holder_of(c.backup.dir) is not None  # held while the session lives
        th.join(10)
    assert ended["code"] == 0 and holder_of(c.backup.dir) is None  # silence ended it and freed the lock
    os.close(w)


def test_a_step_that_never_answers_times_out_and_drops_the_session(tmp_path: object) -> None:
    c = cfg(str(tmp_path / "x"))  # type: ignore[operator]
    script = Script(c)
    release = threading.Event()
    script.steps["start"] = lambda member, args: (release.wait(5), {"step": "start"})[1]  # type: ignore[func-returns-value]
    nc = client(str(tmp_path), script, timeout=0.5)
    nc.open()
    nc.call("lock")
    t = time.monotonic()
    with pytest.raises(CommandTimedOut):
        nc.call("start", member="h1", op="x")
    assert time.monotonic() - t < 3
    release.set()
    with pytest.raises(HostUnreachable):
        nc.call("stop", member="h1", op="x")  # the session is gone; nothing runs on a stale one


def test_an_oversized_line_ends_the_session_cleanly(tmp_path: object) -> None:
    c = cfg(str(tmp_path / "x"))  # type: ignore[operator]
    script = Script(c)
    with client(str(tmp_path), script) as nc:
        assert nc._session is not None
        nc._session.send(b'{"id": 1, "step": "x", "args": {"a": "' + b"a" * (MAX_LINE + 10) + b'"}}\n')
        with pytest.raises(HostUnreachable):
            nc.call("lock")


@dataclass(frozen=True)
class _Args(StepArgs):
    n: int
    s: str
    b: bool = False
    missing: Optional[str] = None


def test_args_are_typed(tmp_path: object) -> None:
    a = Args({"n": 3, "s": "x", "b": True, "other": "3"}, "step").read(_Args)
    assert (a.n, a.s, a.b, a.missing) == (3, "x", True, None)
    for raw, field in (({"n": "3", "s": "x"}, "_Args.n"), ({"n": 3, "s": 3}, "_Args.s"), ({"s": "x"}, "'n'")):
        with pytest.raises(AgentError) as ei:
            Args(raw, "step").read(_Args)
        assert ei.value.exit_code == EXIT_REFUSED and ei.value.message.startswith("node step: ") and field in ei.value.message


def test_scripted_serve_session_is_the_real_server() -> None:
    assert ServeSession._main.__qualname__.startswith("ServeSession") and callable(serve) and NodeContext


def test_a_malformed_reply_is_refused_where_it_is_read(tmp_path: object) -> None:
    from etcd_agent.errors import ProtocolError
    from etcd_agent.node.replies import RepairReply, StepReply

    c = cfg(str(tmp_path / "x"))  # type: ignore[operator]
    script = Script(c)
    script.steps["start"] = lambda member, args: {"step": "start", "member": 7}
    script.steps["repair"] = lambda member, args: {"step": "repair", "member": member, "at": 1, "extra": {"x": 1}}
    with client(str(tmp_path), script) as nc:
        nc.call("lock")
        with pytest.raises(ProtocolError) as ei:
            nc.ask(StepReply, "start", member="h1", op="x")
        assert ei.value.message == "h1: node start reply: StepReply.member must be a string, not a number"
        # the session is still good: the next reply is read, its unknown key dropped
        assert nc.ask(StepReply, "repair", member="h1", op="x") == RepairReply(step="repair", member="h1", at=1.0)
