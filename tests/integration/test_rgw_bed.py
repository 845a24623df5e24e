"""The RGW test bed itself (tests/harness/rgw.py): it serves S3, its faults are the faults they
claim to be, and down() leaves no process and no listening port."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import psutil
import pytest
from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

from tests.harness.rgw import BLOCK, RgwBed, _listening_ports

pytestmark = pytest.mark.integration


def test_bed_up_faults_and_down(tmp_path: Path) -> None:
    bed = RgwBed(str(tmp_path / "bed"))
    bed.up()
    try:
        pids = {name: p.pid for name, p in bed.procs.items()}
        assert set(pids) == {"mon", "osd", "rgw"}
        assert bed.port in _listening_ports()
        s3 = bed.client()
        bucket = bed.new_bucket()
        body = os.urandom(256 * 1024)
        s3.put_object(Bucket=bucket, Key="a/b", Body=body)
        assert s3.get_object(Bucket=bucket, Key="a/b")["Body"].read() == body

        # a hung gateway: TCP still accepted, no answer; a 2 s read timeout ends the call
        hasty = bed.client(connect_timeout=2, read_timeout=2, retries={"total_max_attempts": 1})
        bed.pause()
        with pytest.raises(ReadTimeoutError):
            hasty.get_object(Bucket=bucket, Key="a/b")
        bed.resume()
        assert hasty.get_object(Bucket=bucket, Key="a/b")["Body"].read() == body

        # an outage: connections refused; back on the same port with the same data
        bed.stop_gateway()
        assert not psutil.pid_exists(pids["rgw"]) or psutil.Process(pids["rgw"]).status() == psutil.STATUS_ZOMBIE
        with pytest.raises(EndpointConnectionError):
            hasty.get_object(Bucket=bucket, Key="a/b")
        bed.start_gateway()
        got = hasty.get_object(Bucket=bucket, Key="a/b")["Body"].read()
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(body).hexdigest()

        # heal() undoes either fault
        bed.pause()
        bed.heal()
        assert hasty.head_object(Bucket=bucket, Key="a/b")["ContentLength"] == len(body)
        pids = {name: p.pid for name, p in bed.procs.items()}
    finally:
        bed.down()
    for name, pid in pids.items():
        assert not psutil.pid_exists(pid), f"{name} (pid {pid}) still exists after down()"
    assert not set(range(bed.mon_port, bed.mon_port + BLOCK)) & _listening_ports()
    assert os.listdir(tmp_path / "bed" / "log"), "the logs are kept for a failed test's post-mortem"


def test_beds_claim_distinct_port_blocks(tmp_path: Path) -> None:
    """Two beds starting at once (two xdist workers) never pick the same ports."""
    a, b = RgwBed(str(tmp_path / "a")), RgwBed(str(tmp_path / "b"))
    a._claim_ports()
    try:
        b._claim_ports()
        try:
            assert a.mon_port != b.mon_port
            assert abs(a.mon_port - b.mon_port) >= BLOCK
        finally:
            b.down()
    finally:
        a.down()


def test_session_bed_serves(rgw: RgwBed) -> None:
    """The shared fixture: a bucket of the test's own on a running gateway."""
    bucket = rgw.new_bucket()
    s3 = rgw.client()
    s3.put_object(Bucket=bucket, Key="k", Body=b"v")
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]] == ["k"]
    assert rgw.endpoint.startswith("http://127.0.0.1:")
