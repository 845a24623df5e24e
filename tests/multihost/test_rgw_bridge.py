"""The RGW bed on the bridge (fixture rgw_bridge): namespace hosts reach the real S3 server."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

from tests.harness.netns import NetnsBed
from tests.harness.rgw import RgwBed

pytestmark = pytest.mark.multihost

# runs inside a namespace host: put a file, get it back, print the sha256 of what came back
INSIDE = """
import hashlib, sys, boto3
from botocore.config import Config
endpoint, access, secret, bucket, path = sys.argv[1:]
s3 = boto3.session.Session(aws_access_key_id=access, aws_secret_access_key=secret).client(
    "s3", endpoint_url=endpoint, region_name="us-east-1",
    config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=10))
s3.upload_file(path, bucket, "from-ns")
print(hashlib.sha256(s3.get_object(Bucket=bucket, Key="from-ns")["Body"].read()).hexdigest())
"""


def test_a_namespace_host_puts_and_gets_through_the_bridge(
    netns_bed: NetnsBed, rgw_bridge: RgwBed, tmp_path: Path
) -> None:
    assert rgw_bridge.endpoint.startswith(f"http://{netns_bed.gateway}:")
    bucket = rgw_bridge.new_bucket()
    data = tmp_path / "blob"
    data.write_bytes(os.urandom(20 * 1024 * 1024))  # above upload_file's 8 MiB threshold: multipart
    want = hashlib.sha256(data.read_bytes()).hexdigest()
    res = netns_bed.run(netns_bed.hosts[0], [sys.executable, "-c", INSIDE, rgw_bridge.endpoint,
                                             rgw_bridge.access_key, rgw_bridge.secret_key, bucket, str(data)],
                        timeout=60)
    assert res.stdout.strip() == want
    # the same object, seen from the root namespace
    head = rgw_bridge.client().head_object(Bucket=bucket, Key="from-ns")
    assert head["ContentLength"] == data.stat().st_size
