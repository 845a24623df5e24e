"""The bootstrap record and the version pin: typed documents read bounded, records of the
previous version still read, and each one's leniency kept (an unreadable bootstrap record still
says "bootstrapped", a damaged pin falls back to the configured binary)."""
import json
import logging
import os

from etcd_agent.config import parse_text
from etcd_agent.state import bootstrap, pins

DEEP = "[" * 50_000  # json.load meets RecursionError on it, which no reader caught


def cfg(tmp_path):
    c, errors = parse_text(
        '[cluster]\nname = "u"\ntoken = "t"\n[[member]]\nname = "m1"\nhost = "10.0.0.1"\n'
        f'[etcd]\nversions_dir = "{tmp_path / "opt"}"\n[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
    )
    assert c is not None, errors
    os.makedirs(c.daemon.state_dir)
    return c


def put(path, text):
    with open(path, "w") as fh:
        fh.write(text)


def test_a_bootstrap_record_of_the_previous_version_is_read(tmp_path):
    c = cfg(tmp_path)
    path = bootstrap.record_path(c, "m1")
    put(path, '{"cluster": "u", "cluster_id": "cafe", "member_id": "beef", "since": "2026-01-01T00:00:00Z", "token": null}\n')
    assert bootstrap.read(c, "m1") == bootstrap.BootstrapRecord("u", "cafe", "beef", None, "2026-01-01T00:00:00Z")
    put(path, '{"cluster": "u", "cluster_id": "", "member_id": "beef", "since": ""}\n')  # before the token, an empty id
    assert bootstrap.read(c, "m1") == bootstrap.BootstrapRecord("u", None, "beef", None, "")
    bootstrap.remember(c, "m1", 0xCAFE, 0xBEEF, "tok")
    rec = bootstrap.read(c, "m1")
    assert rec is not None and (rec.cluster_id, rec.member_id, rec.token) == ("cafe", "beef", "tok")


def test_a_damaged_bootstrap_record_still_says_bootstrapped_but_carries_no_ids(tmp_path):
    c = cfg(tmp_path)
    path = bootstrap.record_path(c, "m1")
    for text in ('{"cluster": "u", "cluster_id": 51966, "member_id": "beef", "since": ""}', "{not json", DEEP, "[1]"):
        put(path, text)
        assert bootstrap.read(c, "m1") == bootstrap.BootstrapRecord("u"), text[:40]
        assert bootstrap.ever_bootstrapped(c, "m1")


def test_a_pin_of_the_previous_version_is_read(tmp_path):
    c = cfg(tmp_path)
    put(pins.pin_path(c, "m1"), json.dumps({
        "version": "3.5.1", "binary": "/opt/etcd/3.5.1/etcd", "etcdctl": "/opt/etcd/3.5.1/etcdctl", "etcdutl": None,
        "previous": "/usr/bin/etcd", "since": "2026-01-01T00:00:00Z"}, indent=1) + "\n")
    assert pins.read_pin(c, "m1") == pins.Pin("/opt/etcd/3.5.1/etcd", "3.5.1", "/opt/etcd/3.5.1/etcdctl", None,
                                              "/usr/bin/etcd", "2026-01-01T00:00:00Z")


def test_a_hostile_pin_falls_back_to_the_configured_binary_naming_the_field(tmp_path, caplog):
    c = cfg(tmp_path)
    caplog.set_level(logging.WARNING)
    put(pins.pin_path(c, "m1"), '{"version": "3.5.1", "binary": "/opt/etcd/3.5.1/etcd", "etcdctl": ["x"]}')
    assert pins.read_pin(c, "m1") is None
    assert "Pin.etcdctl must be a string, not a list" in caplog.text
    put(pins.pin_path(c, "m1"), DEEP)
    assert pins.read_pin(c, "m1") is None
    assert pins.pinned_binary(c, "m1") == c.etcd.binary
