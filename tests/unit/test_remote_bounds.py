"""[backup.remote] bounds and warnings (issue 39 items 2 and 4): the defaults end a hung gateway's
wait within a minute; the new keys are validated; "virtual" on an IP endpoint is said."""
from __future__ import annotations

from typing import List

import pytest

from etcd_agent.bucket.client import client_error_text
from etcd_agent.config import RemoteSection, parse_text, security_warnings
from etcd_agent.config.model import REMOTE_VERIFY_MODES

# botocore's standard retry mode: a random backoff of at most 2**(attempt-1) s before each retry
STANDARD_BACKOFF_MAX = 20.0


def test_the_defaults_end_a_hung_gateways_wait_within_a_minute() -> None:
    r = RemoteSection()
    assert r.connect_timeout <= 10 and r.read_timeout <= 30  # seconds, not minutes
    backoff = sum(min(2.0 ** i, STANDARD_BACKOFF_MAX) for i in range(r.max_attempts - 1))
    # a PUT waits up to 1 s for "100 Continue" before it sends its body (botocore's AWSConnection)
    worst = r.max_attempts * (r.connect_timeout + r.read_timeout + 1.0) + backoff
    assert worst < 60, worst
    assert 0 < r.deadline <= 600
    assert r.verify == "auto" and "auto" in REMOTE_VERIFY_MODES


def _remote(extra: str, endpoint: str = "http://10.0.0.5:7480") -> str:
    return f"""
[cluster]
name = "c"
[[member]]
name = "m1"
host = "127.0.0.1"
[backup.remote]
enabled = true
endpoint = "{endpoint}"
bucket = "etcd-backups"
{extra}"""


def test_new_keys_are_validated() -> None:
    _cfg, errors = parse_text(_remote("max_attempts = 0\ndeadline = -1\n"))
    assert "backup.remote.max_attempts must be between 1 and 10" in errors
    assert "backup.remote.deadline must be > 0 seconds" in errors
    cfg, errors = parse_text(_remote("max_attempts = 2\ndeadline = 30\nverify = \"auto\"\n"))
    assert not errors and cfg is not None and cfg.backup.remote.max_attempts == 2


def test_virtual_addressing_with_an_ip_endpoint_is_warned() -> None:
    cfg, errors = parse_text(_remote('addressing_style = "virtual"\n'))
    assert not errors and cfg is not None
    assert any('addressing_style = "virtual" has no effect with an IP address endpoint' in w
               for w in security_warnings(cfg))
    for extra, endpoint in (('addressing_style = "path"\n', "http://10.0.0.5:7480"),
                            ('addressing_style = "virtual"\n', "https://oss-cn-hangzhou.aliyuncs.com")):
        cfg, errors = parse_text(_remote(extra, endpoint))
        assert not errors and cfg is not None and not any("addressing_style" in w for w in security_warnings(cfg))


def test_an_s3_error_without_a_message_names_the_status_and_code() -> None:
    rgw = {"Error": {"Code": "BadDigest", "Message": None}, "ResponseMetadata": {"HTTPStatusCode": 400}}
    assert client_error_text(rgw) == "HTTP 400 BadDigest (the server sent no message)"
    aws = {"Error": {"Code": "AccessDenied", "Message": "Access Denied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}
    assert client_error_text(aws) == "HTTP 403 AccessDenied: Access Denied"
    head = {"Error": {"Code": "404", "Message": "Not Found"}, "ResponseMetadata": {"HTTPStatusCode": 404}}
    assert client_error_text(head) == "HTTP 404: Not Found"


def test_a_second_bucket_client_parses_no_model_file_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy makes a Bucket: the S3 model, its endpoint rules and the partitions (~0.1 CPU s
    and ~13 MB each time, the bench's upload paying it in its timing) are parsed once a process."""
    import botocore.loaders

    from etcd_agent.bucket.client import Bucket

    cfg, errors = parse_text(_remote('access_key = "AKIDEXAMPLE"\nsecret_key = "not-a-secret"\n'))
    assert not errors and cfg is not None
    Bucket(cfg)  # the first client of the process (or of the test run) may parse them
    parsed: List[str] = []
    real = botocore.loaders.JSONFileLoader.load_file

    def counted(self: object, file_path: str) -> object:
        parsed.append(file_path)
        return real(self, file_path)  # type: ignore[arg-type]
    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counted)
    second = Bucket(cfg)
    assert parsed == []
    assert second.client.meta.endpoint_url == "http://10.0.0.5:7480" and second.client.meta.region_name


def test_buckets_made_in_each_fetch_worker_share_the_parsed_s3_model_and_keep_their_own_deadline() -> None:
    """A Bucket is made per fetch worker (``staging.stage_all``: a deadline is per object) and per
    step of a plan: each with a fresh SDK session loaded and parsed the S3 model again (~0.1-0.2
    CPU s, four workers at once ~0.5 s before the first byte of a restore from the bucket). With
    the credentials in the config they share one session's loader; each keeps its own deadline
    hook (one object's deadline passed fails no other's request)."""
    from etcd_agent.bucket.client import Bucket, DeadlinePassed

    cfg, errors = parse_text(_remote('access_key = "AKIAEXAMPLE"\nsecret_key = "s3cr3t-example"\n'))
    assert not errors and cfg is not None
    a, b = Bucket(cfg), Bucket(cfg)
    assert a.client is not b.client
    assert a.client.meta.service_model._service_description is b.client.meta.service_model._service_description
    with a.within(0):
        a._deadline = 0.0  # passed
        try:
            a.client.meta.events.emit("before-send.s3.GetObject", request=None)
            raise AssertionError("a passed deadline let a request go")
        except DeadlinePassed:
            pass
        b.client.meta.events.emit("before-send.s3.GetObject", request=None)  # b's own: none set
    assert a.client.meta.region_name == "us-east-1" and b.client.meta.config.retries["total_max_attempts"] == 3

