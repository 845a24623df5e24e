"""The restore and upgrade markers: typed documents read bounded, markers of the previous version
still read, and a damaged one still pauses the daemon, saying what is wrong."""
import json
import os

from etcd_agent.state import markers
from tests.unit.test_state_records import DEEP, cfg, put


def test_markers_of_the_previous_version_are_read(tmp_path):
    c = cfg(tmp_path)
    put(markers.restore_marker_path(c, "m1"), '{"backup": "/b/x.tar", "member": "m1", "op": "op1", "pid": 7, '
                                              '"started": "2026-01-01T00:00:00Z"}\n')
    assert markers.read_restore(c, "m1") == markers.RestoreMarker("op1", "m1", "/b/x.tar", 7, "2026-01-01T00:00:00Z")
    me = os.getpid()
    rec = {"member": "m1", "version": "3.5.1", "previous": "/usr/bin/etcd", "pid": me,
           "pid_started": markers._process_started(me), "started": "2026-01-01T00:00:00Z"}  # no ticks: an older agent
    put(markers.upgrade_marker_path(c, "m1"), json.dumps(rec, sort_keys=True) + "\n")
    got = markers.upgrading(c, "m1")
    assert got is not None and (got.version, got.pid, got.previous) == ("3.5.1", me, "/usr/bin/etcd")


def test_a_damaged_marker_still_pauses_the_daemon_naming_what_is_wrong(tmp_path):
    c = cfg(tmp_path)
    put(markers.restore_marker_path(c, "m1"), DEEP)
    rec = markers.read_restore(c, "m1")
    assert rec is not None and rec.op == "?" and rec.error is not None and "nested deeper" in rec.error
    # an upgrade marker whose pid is not a number: live (fail closed), not taken for a dead step's
    path = markers.upgrade_marker_path(c, "m1")
    put(path, json.dumps({"member": "m1", "version": "3.5.1", "pid": str(os.getpid())}))
    up = markers.upgrading(c, "m1")
    assert up is not None and up.error is not None and "UpgradeMarker.pid must be an integer, not a string" in up.error
    assert os.path.exists(path)
