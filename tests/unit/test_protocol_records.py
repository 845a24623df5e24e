"""The node protocol's documents: the same bytes on the wire as before they were typed
documents, and a hostile field refused where it is read, naming the field."""
import pytest

from etcd_agent.errors import OperationFailed
from etcd_agent.node.protocol import Hello, Owner, Reply, Request, Welcome, decode, encode

OWNER = Owner("ab" * 16, "ops1", 42, "restore 20261201T100000Z-1a2b3c4d")


def test_the_lines_are_those_of_the_previous_version() -> None:
    # literals as the previous version wrote them (sort_keys, no spaces)
    assert encode(Hello(7, OWNER, True).to_json()) == (
        b'{"hello":{"lock":true,"owner":{"command":"restore 20261201T100000Z-1a2b3c4d","host":"ops1",'
        b'"pid":42,"token":"' + b"ab" * 16 + b'"},"protocol":7}}\n')
    assert encode(Welcome(7, "1.2.3", "m1").to_json()) == b'{"welcome":{"agent_version":"1.2.3","host":"m1","protocol":7}}\n'
    assert encode(Request(3, "begin", {"member": "m1"}).to_json()) == b'{"args":{"member":"m1"},"id":3,"step":"begin"}\n'
    assert encode(Request(4, "lock").to_json()) == b'{"args":{},"id":4,"step":"lock"}\n'
    assert encode(Reply(3, result={"x": 1}).to_json()) == b'{"id":3,"result":{"x":1}}\n'
    assert encode(Reply(3, error={"error": "BusyError"}).to_json()) == b'{"error":{"error":"BusyError"},"id":3}\n'


def test_lines_of_the_previous_version_are_read() -> None:
    line = (b'{"hello":{"lock":false,"owner":{"command":"upgrade","host":"ops1","pid":42,"token":"t"},'
            b'"protocol":7}}\n')
    assert Hello.from_json(decode(line, "hello"), "node protocol") == Hello(7, Owner("t", "ops1", 42, "upgrade"), False)
    assert Welcome.from_json(decode(b'{"welcome":{"agent_version":"1.2.3","host":"m1","protocol":7}}', "x"), "node protocol") == \
        Welcome(7, "1.2.3", "m1")
    assert Request.from_json(decode(b'{"id":3,"step":"lock"}', "x"), "node protocol") == Request(3, "lock", {})
    assert Reply.from_json({"id": 3, "result": {"a": [1]}}, "node protocol").raise_for("h1") == {"a": [1]}


@pytest.mark.parametrize("doc, message", [
    ({}, "node protocol: the session must start with a hello"),
    ({"hello": [1]}, "node protocol: the session must start with a hello"),
    ({"hello": {"protocol": 7, "lock": True, "owner": {"token": "t", "host": "h", "pid": "42", "command": "c"}}},
     "node protocol: Hello.owner: Owner.pid must be an integer, not a string"),
    ({"hello": {"protocol": 7, "lock": "yes", "owner": OWNER.to_json()}},
     "node protocol: Hello.lock must be a boolean, not a string"),
    ({"hello": {"protocol": True, "lock": True, "owner": OWNER.to_json()}},
     "node protocol: Hello.protocol must be an integer, not a boolean"),
])
def test_a_hostile_hello_is_refused_naming_the_field(doc: object, message: str) -> None:
    with pytest.raises(OperationFailed) as ei:
        Hello.from_json(doc, "node protocol")
    assert ei.value.message == message


def test_a_hostile_request_or_reply_is_refused_naming_the_field() -> None:
    with pytest.raises(OperationFailed) as ei:
        Request.from_json({"id": 1, "step": 5}, "node protocol")
    assert ei.value.message == "node protocol: Request.step must be a string, not a number"
    with pytest.raises(OperationFailed) as ei:
        Request.from_json({"id": 1, "step": "x", "args": [1]}, "node protocol")
    assert ei.value.message == "node protocol: Request.args must be an object, not a list"
    with pytest.raises(OperationFailed) as ei:
        Reply.from_json({"id": 1, "error": "boom"}, "node protocol")
    assert ei.value.message == "node protocol: Reply.error must be an object, not a string"
    with pytest.raises(OperationFailed) as ei:
        Reply.from_json({"id": 1}, "node protocol").raise_for("h1")
    assert ei.value.message == "node protocol: a reply needs a result or an error"
    with pytest.raises(OperationFailed) as ei:
        Welcome.from_json({"error": {}}, "node protocol")
    assert ei.value.message == "node protocol: no welcome"
