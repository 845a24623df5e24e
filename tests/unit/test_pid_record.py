"""The process backend's pid file: a typed record (``PidRecord``), its bytes pinned, a record of
the previous version still read, and a damaged one "not ours" (no signal sent) naming the field."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import psutil
import pytest

from etcd_agent.errors import ProtocolError
from etcd_agent.member.process import PidRecord, ProcessBackend
from etcd_agent.proctime import start_ticks
from etcd_agent.waiting import poll
from tests.unit.test_proctime import cfg


def backend(tmp_path: Any) -> ProcessBackend:
    c = cfg(tmp_path)  # the config the pid file's other tests use
    os.makedirs(c.etcd.run_dir)
    return ProcessBackend(c, "m1")


def test_the_pid_record_is_written_byte_for_byte_as_before() -> None:
    rec = PidRecord(4242, 1765000000.25, 987654, "/usr/bin/etcd")
    # what ProcessBackend.start wrote before the record was typed: json.dumps of this dict
    assert json.dumps(rec.to_json()).encode() == (
        b'{"pid": 4242, "create_time": 1765000000.25, "start_ticks": 987654, "binary": "/usr/bin/etcd"}')


def test_a_pid_record_of_an_older_agent_still_reads() -> None:
    # before start_ticks: only the wall-clock time, and an integral create time written as an int
    rec = PidRecord.from_json(json.loads('{"pid": 7, "create_time": 1765000000, "binary": "/usr/bin/etcd"}'), "pid file")
    assert rec == PidRecord(7, 1765000000.0, None, "/usr/bin/etcd")
    assert PidRecord.from_json({"pid": 7, "create_time": 1.5}, "pid file").binary == ""


@pytest.mark.parametrize("doc,field", [
    ({"pid": "7", "create_time": 1.0}, "PidRecord.pid"),
    ({"create_time": 1.0}, "'pid'"),
    ({"pid": 7, "create_time": "yesterday"}, "PidRecord.create_time"),
    ({"pid": 7, "create_time": 1.0, "start_ticks": 1.5}, "PidRecord.start_ticks"),
    ({"pid": 7, "create_time": 1.0, "binary": ["etcd"]}, "PidRecord.binary"),
    ({"pid": 0, "create_time": 1.0}, "PidRecord.pid"),
])
def test_a_wrong_field_is_one_protocol_error_naming_it(doc: Any, field: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        PidRecord.from_json(doc, "pid file /run/m1.pid")
    assert field in exc.value.message and "pid file /run/m1.pid" in exc.value.message


def test_a_damaged_pid_file_is_not_ours_and_a_good_one_is(tmp_path: Any) -> None:
    b = backend(tmp_path)
    etcd = os.path.join(str(tmp_path), os.path.basename(b.cfg.etcd.binary))
    os.symlink(sys.executable, etcd)
    child = subprocess.Popen([etcd, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             env={**os.environ, "ETCD_NAME": "m1"})
    try:
        # the exec done: its cmdline names the stand-in (an empty one: forked, not yet exec'd)
        poll(lambda: os.path.basename((psutil.Process(child.pid).cmdline() or [""])[0]) == os.path.basename(etcd),
             timeout=10.0, interval=0.01, what="the stand-in to exec")
        good = PidRecord(child.pid, psutil.Process(child.pid).create_time(), start_ticks(child.pid), etcd)
        with open(b.pid_file, "w") as fh:
            json.dump(good.to_json(), fh)
        assert b.pid() == child.pid
        for bad in ({**good.to_json(), "pid": str(child.pid)}, {**good.to_json(), "start_ticks": "x"}, [child.pid]):
            with open(b.pid_file, "w") as fh:
                json.dump(bad, fh)
            assert b.pid() is None, bad
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
