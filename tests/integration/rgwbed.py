"""A one-node Ceph RGW for the copy-queue tests (../shared/testbed/rgw_up.sh), until the shared
``rgw`` fixture of tests/harness/rgw.py lands: the same few calls (endpoint, keys, new_bucket,
client, stop_gateway / start_gateway: an outage that keeps the data).

ETCD_AGENT_TEST_RGW_DIR names a bed already up (rgw_up.sh DIR PORT): it is used and left running.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
import uuid
from contextlib import contextmanager
from typing import Any, Dict, Iterator

import pytest

TESTBED = os.environ.get("ETCD_AGENT_TESTBED", "/work/shared/testbed")


class RgwBed:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        env: Dict[str, str] = {}
        with open(os.path.join(directory, "s3.env")) as fh:
            for line in fh:
                k, _, v = line.strip().partition("=")
                env[k] = v
        self.endpoint = env["S3_ENDPOINT"]
        self.access_key = env["AWS_ACCESS_KEY_ID"]
        self.secret_key = env["AWS_SECRET_ACCESS_KEY"]

    def client(self) -> Any:
        import boto3
        from botocore.config import Config as BotoConfig

        return boto3.session.Session(aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key).client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            config=BotoConfig(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                              response_checksum_validation="when_required"))

    def new_bucket(self) -> str:
        name = "q-" + uuid.uuid4().hex[:16]
        self.client().create_bucket(Bucket=name)
        return name

    def _pid(self) -> int:
        with open(os.path.join(self.dir, "run", "rgw.pid")) as fh:
            return int(fh.read().strip())

    def stop_gateway(self) -> None:
        """radosgw stops (connections refused); mon and osd keep the data."""
        pid = self._pid()
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.2)
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)

    def start_gateway(self) -> None:
        conf = os.path.join(self.dir, "ceph.conf")
        with open(os.path.join(self.dir, "log", "rgw.out"), "ab") as log:
            p = subprocess.Popen(["/usr/bin/setsid", "/usr/bin/radosgw", "-n", "client.rgw.gw", "-c", conf, "-f"],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        with open(os.path.join(self.dir, "run", "rgw.pid"), "w") as fh:
            fh.write(f"{p.pid}\n")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"radosgw did not come back on {self.endpoint}")


@contextmanager
def rgw_bed(tmp: str) -> Iterator[RgwBed]:
    given = os.environ.get("ETCD_AGENT_TEST_RGW_DIR")
    if given:
        yield RgwBed(given)
        return
    if not os.path.exists("/usr/bin/radosgw"):
        pytest.skip("Ceph RGW is not installed (packaging/install-deps.sh test)")
    d = os.path.join(tmp, "bed")
    subprocess.run([os.path.join(TESTBED, "rgw_up.sh"), d, "7682"], check=True, timeout=180)
    try:
        yield RgwBed(d)
    finally:
        subprocess.run([os.path.join(TESTBED, "rgw_down.sh"), d], timeout=120)
