"""The restore's ship against scripted hosts: the real sender (restore.ship) and the real stream
rules (node.transfer) on both ends, over real pipes; no etcd, no SSH. The codec choice, refusals
before any data, the manifest check before the end record, a stalled host cut off, an agent of
another protocol refused at the pre-check."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import threading
import time
from typing import Any, Dict, List

import pytest

from etcd_agent.errors import EXIT_FAILED, EXIT_REFUSED, AgentError, OperationFailed, RefusedError
from etcd_agent.node.protocol import PROTOCOL
from etcd_agent.node.transfer import CodecChoice, Order
from etcd_agent.restore.orchestrator import ship as S
from etcd_agent.restore.orchestrator.source import Source
from tests.component.test_restore_orchestration import Bed, identity_of
from tests.harness.scripted import ReceiveSession, ScriptedHost

pytestmark = pytest.mark.component

BEFORE_SHIP = ["precheck", "begin"]


@pytest.fixture
def bed(tmp_path: object) -> Bed:
    return Bed(str(tmp_path))


def kubernetes_like(n: int) -> bytes:
    rnd = random.Random(3)
    names = [f"pod-{rnd.randrange(10**6)}".encode() for _ in range(500)]
    out = bytearray()
    while len(out) < n:
        out += b'{"kind":"Pod","metadata":{"name":"' + rnd.choice(names) + b'","uid":"' + os.urandom(6).hex().encode() + b'"}}'
    return bytes(out[:n])


def with_snapshot(bed: Bed, data: bytes, sha256: "str | None" = None) -> Source:
    path = bed.source.path + ".alt"
    with open(path, "wb") as fh:
        fh.write(data)
    bed.source = Source(path, "agent", len(data), sha256 or hashlib.sha256(data).hexdigest(), 42, "3.5.16",
                        identity_of(bed.cfg), snapshot_path=path)
    return bed.source


def steps(bed: Bed) -> List[List[str]]:
    return [bed.script.steps_of(m) for m in ("h1", "h2", "h3")]


@pytest.mark.parametrize("kind", ["kubernetes-like", "random"])
def test_a_snapshot_travels_compressed_only_when_that_pays(bed: Bed, kind: str) -> None:
    data = kubernetes_like(12 << 20) if kind == "kubernetes-like" else os.urandom(12 << 20)
    src = with_snapshot(bed, data)
    said: List[str] = []
    r = bed.restore()
    r.say = said.append
    assert r.run().done
    want = "zstd" if kind == "kubernetes-like" else "none"
    assert bed.script.codecs == {"h1": want, "h2": want, "h3": want}
    assert set(bed.script.received.values()) == {src.sha256}  # every member got every byte
    shipped = next(line for line in said if line.startswith("shipped "))
    assert f"shipped {12 << 20} bytes to 3 member(s)" in shipped
    assert ("compressed in transit" if want == "zstd" else "sent as it is") in shipped


def test_a_receiver_that_cannot_take_it_refuses_before_any_data_and_nothing_stops(bed: Bed) -> None:
    bed.script.fail("ship-ready", "h3", RefusedError("h3: 1024 bytes free in /x, the snapshot needs 3145728; "
                                                      "refused before any data was sent"))
    with pytest.raises(OperationFailed) as err:
        bed.restore().run()
    assert err.value.exit_code == EXIT_FAILED
    assert "shipping the snapshot was refused before any data was sent; nothing stopped" in err.value.message
    assert any("h3 (10.0.0.3): h3: 1024 bytes free" in d for d in err.value.details), err.value.details
    assert len(receivers(bed, "10.0.0.3")) == 1  # a refusal is its host's answer: not asked again
    assert bed.script.received == {}
    assert steps(bed) == [BEFORE_SHIP + ["rollback"]] * 3  # etcd never stopped anywhere


def test_a_snapshot_that_is_not_the_manifests_is_sent_to_nobody_whole(bed: Bed) -> None:
    with_snapshot(bed, os.urandom(3 << 20), sha256="ab" * 32)
    with pytest.raises(OperationFailed) as err:
        bed.restore().run()
    assert "the manifest says abababababababab" in str(err.value.details) + err.value.message
    assert "no member kept it" in str(err.value.details) + err.value.message
    assert bed.script.received == {}  # no receiver saw the end record
    assert steps(bed) == [BEFORE_SHIP + ["rollback"]] * 3


def test_a_receiver_failing_at_the_end_fails_the_ship(bed: Bed) -> None:
    bed.script.fail("ship", "h2", OperationFailed("h2: the shipped snapshot: sha256 trailer does not match"))
    with pytest.raises(OperationFailed) as err:
        bed.restore().run()
    assert any("sha256 trailer does not match" in d for d in err.value.details), err.value.details
    assert "stop" not in sum(steps(bed), [])


def test_a_host_that_stops_reading_is_cut_off_and_the_others_keep_nothing(bed: Bed) -> None:
    src = with_snapshot(bed, os.urandom(24 << 20))  # far more than the pipes and queues hold
    bed.script.stalls.append("h2")
    hosts = {m.name: bed.hosts[m.ssh_host] for m in bed.cfg.members}
    targets = [S.Target(name, f"{name} (test)", h, ["etcd-agent", "node", "receive", "--idle-timeout", "10"],
                        Order(name, "op-1", "0" * 32, src.size, "none"))
               for name, h in hosts.items()]
    with pytest.raises(OperationFailed) as err:
        S.fan_out(src, targets, codec=CodecChoice("none", 1.0, 0), idle=0.5)
    assert "shipping the snapshot failed; nothing stopped" in err.value.message
    assert any(d.startswith("h2 (test): the stream has not moved for 0.5s") for d in err.value.details), \
        err.value.details
    assert bed.script.received == {}


def test_an_agent_of_another_protocol_is_refused_at_the_pre_check(bed: Bed) -> None:
    old: ScriptedHost = bed.hosts["10.0.0.3"]
    old.protocol = 3  # the agent before the framed stream
    with pytest.raises(AgentError) as err:
        bed.restore().run()
    assert err.value.exit_code == EXIT_REFUSED and "nothing touched" in err.value.message
    assert any("h3 (10.0.0.3)" in d and f"speaks node protocol 3, the caller {PROTOCOL}" in d
               and "install the same etcd-agent version on every master" in d for d in err.value.details), \
        err.value.details
    assert bed.script.received == {} and "begin" not in sum(steps(bed), [])


# ---------------------------------------------------------------- this master's own members


def test_this_masters_member_copies_and_restores_while_the_others_are_shipped_to(bed: Bed) -> None:
    """h1 is the master the restore runs on: its member copies the snapshot from the file here
    (no stream) and restores it while h2 and h3 still receive theirs."""
    restoring = threading.Event()
    seen: List[bool] = []
    bed.script.hooks[("restore", "h1")] = restoring.set
    # h2's receiver takes no data until h1's restore has begun: without the overlap it waits out
    # its 10 s and says so
    bed.script.hooks[("ship-data", "h2")] = lambda: seen.append(restoring.wait(10))
    said: List[str] = []
    r = bed.restore(here=["10.0.0.1"])
    r.say = said.append
    assert r.run().done
    assert seen == [True], "h1's restore did not run while h2 was still being shipped to"
    assert bed.script.codecs["h1"] == "copy" and set(bed.script.codecs) == {"h1", "h2", "h3"}
    assert set(bed.script.received.values()) == {bed.source.sha256}  # the same bytes everywhere
    assert any(line.startswith(f"shipped {bed.source.size} bytes to 2 member(s)") for line in said), said
    for m in ("h1", "h2", "h3"):
        assert bed.script.steps_of(m)[:4] == ["precheck", "begin", "receive", "restore"]
    assert not bed.script.violations


def test_a_copy_here_failing_rolls_everyone_back_once_the_ship_has_ended(bed: Bed) -> None:
    bed.script.fail("receive", "h1", OperationFailed("h1: the snapshot copied from /x: sha256 trailer does not match"))
    with pytest.raises(OperationFailed) as err:
        bed.restore(here=["10.0.0.1"]).run()
    assert "sha256 trailer does not match" in " ".join(err.value.details), err.value.details
    assert set(bed.script.received) == {"h2", "h3"}  # the ship was not cut short by the other half
    for m in ("h1", "h2", "h3"):  # nobody was fenced or stopped; every member rolled back
        steps_ = bed.script.steps_of(m)
        assert "fence" not in steps_ and "stop" not in steps_ and steps_[-1] == "rollback", (m, steps_)
    assert "restore" not in bed.script.steps_of("h1")


def test_a_copy_here_that_differs_from_what_was_shipped_is_refused_before_the_fence(bed: Bed) -> None:
    bed.source = dataclasses.replace(bed.source, sha256=None)  # no manifest claim: only the two reads can disagree
    real = bed.script.steps["receive"]

    def other_bytes(member: str, args: Any) -> Dict[str, Any]:
        got = real(member, args)
        return {**got, "sha256": "0" * 64} if member == "h1" else got

    bed.script.steps["receive"] = other_bytes
    with pytest.raises(OperationFailed) as err:
        bed.restore(here=["10.0.0.1"]).run()
    assert "the snapshot copied on this master is not the one shipped to the others" in err.value.message
    for m in ("h1", "h2", "h3"):
        assert "fence" not in bed.script.steps_of(m) and bed.script.steps_of(m)[-1] == "rollback"


# ---------------------------------------------------------------- receivers started ahead


def receivers(bed: Bed, host: str) -> List[ReceiveSession]:
    return [s for s in bed.hosts[host].sessions if isinstance(s, ReceiveSession)]


def ended(s: ReceiveSession, within: float = 5.0) -> bool:
    s._thread.join(within)
    return not s._thread.is_alive()


def test_unattended_the_receivers_start_while_the_hosts_pre_check_and_the_ship_uses_them(bed: Bed) -> None:
    # h3's pre-check answers only once a receiver runs on h2 and on h3: without the start ahead
    # it waits out its 5 s and the test says so
    started: List[bool] = []

    def both_started() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (receivers(bed, "10.0.0.2") and receivers(bed, "10.0.0.3")):
            time.sleep(0.01)
        started.append(bool(receivers(bed, "10.0.0.2") and receivers(bed, "10.0.0.3")))

    bed.script.hooks[("precheck", "h3")] = both_started
    r = bed.restore(here=["10.0.0.1"])
    assert r.run().done
    assert started == [True], "no receiver ran on h2 and h3 while the hosts pre-checked"
    for host, member in (("10.0.0.2", "h2"), ("10.0.0.3", "h3")):
        got = receivers(bed, host)
        assert len(got) == 1, got  # the one started ahead took the snapshot: no second start
        assert got[0].order is not None and got[0].order.member == member and got[0].order.op == r.op
        assert got[0].order.owner == r.owner.token if r.owner else False
    assert receivers(bed, "10.0.0.1") == []  # this master's member copies; no receiver here
    assert set(bed.script.received.values()) == {bed.source.sha256}


def test_asked_to_confirm_no_receiver_starts_before_the_answer(bed: Bed) -> None:
    with pytest.raises(RefusedError) as err:
        bed.restore(confirm=lambda plan: False).run()
    assert "not confirmed; nothing touched" in err.value.message
    assert all(receivers(bed, h) == [] for h in bed.hosts)
    assert bed.restore(confirm=lambda plan: True).run().done
    assert all(len(receivers(bed, h)) == 1 for h in bed.hosts)  # started when the ship needed them


def test_a_refused_restore_ends_its_receivers_before_any_order(bed: Bed) -> None:
    bed.script.fail("precheck", "h3", RefusedError("h3: data dir is a symlink (scripted)"))
    with pytest.raises(AgentError) as err:
        bed.restore().run()
    assert err.value.exit_code == EXIT_REFUSED and "nothing touched" in err.value.message
    started = [s for h in bed.hosts for s in receivers(bed, h)]
    assert len(started) == 3  # unattended: one ahead per member
    for s in started:  # each saw its stream end before any order: exit 0, nothing looked at
        assert ended(s) and s.order is None and s.code == 0
    assert bed.script.received == {} and "begin" not in sum(steps(bed), [])


def test_a_receiver_started_ahead_that_died_is_replaced_by_a_fresh_one(bed: Bed) -> None:
    bed.script.gone.append("h2")  # h2's first receiver exits before its order, without a word
    r = bed.restore()
    assert r.run().done
    first, second = receivers(bed, "10.0.0.2")
    assert ended(first) and first.order is None and first.code == -1
    assert second.order is not None and second.order.member == "h2"
    # the first was a stream session; its replacement rides the host's own connection
    assert (first.via, second.via) == ("stream", "channel")
    assert [s.via for s in receivers(bed, "10.0.0.3")] == ["stream"]
    assert [type(s).__name__ for s in bed.hosts["10.0.0.2"].sessions].count("ServeSession") == 1  # lock kept
    assert len(receivers(bed, "10.0.0.3")) == 1
    assert set(bed.script.received.values()) == {bed.source.sha256}


def test_asked_to_confirm_a_stream_receiver_gone_without_a_word_is_replaced_over_the_hosts_connection(
        bed: Bed) -> None:
    bed.script.gone.append("h3")  # its OpenSSH client would not connect, say: it exits at once, silent
    assert bed.restore(confirm=lambda plan: True).run().done
    first, second = receivers(bed, "10.0.0.3")
    assert (first.via, first.order, first.code) == ("stream", None, -1)
    assert second.via == "channel" and second.order is not None and second.order.member == "h3"
    assert set(bed.script.received.values()) == {bed.source.sha256}


def test_a_stream_receiver_that_refused_is_not_tried_again(bed: Bed) -> None:
    bed.script.fail("ship-ready", "h2", RefusedError("h2: no space for the snapshot (scripted)"))
    with pytest.raises(AgentError) as err:
        bed.restore(confirm=lambda plan: True).run()
    assert "no space for the snapshot" in err.value.message + " ".join(getattr(err.value, "details", []))
    assert len(receivers(bed, "10.0.0.2")) == 1  # it answered: its host has spoken


def test_no_receiver_is_started_on_a_host_that_cannot_be_reached(bed: Bed) -> None:
    bed.hosts["10.0.0.3"].reachable = False
    with pytest.raises(AgentError) as err:
        bed.restore().run()
    assert err.value.exit_code == EXIT_REFUSED and "nothing touched" in err.value.message
    assert [a for a in bed.hosts["10.0.0.3"].attempts if "receive" in a] == []  # only its session was tried
    assert len(bed.hosts["10.0.0.3"].attempts) == 1
    for host in ("10.0.0.1", "10.0.0.2"):  # the reachable ones got theirs, ended before any order
        (s,) = receivers(bed, host)
        assert ended(s) and s.order is None and s.code == 0
