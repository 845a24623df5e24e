"""The bucket off-host copies go to: a boto3 S3 client bound to one bucket and key prefix.

``Bucket`` is built from ``[backup.remote]``: the prefix with ``{cluster}`` and ``{host}``
expanded, the credentials (inline, an AWS-style credentials file that others cannot read, or
boto3's default chain), timeouts and retries. This is the only module that imports boto3 and
botocore, and only when a bucket is made, so importing it (and ``--help``) stays cheap; their
errors become ``BackupError`` here, with credentials scrubbed from every message.
"""
from __future__ import annotations

import configparser
import contextlib
import hashlib
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

from etcd_agent.config import Config, RemoteSection
from etcd_agent.config.security import is_ip_endpoint
from etcd_agent.errors import BackupError, ConfigError

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# an object's deadline is [backup.remote] deadline plus this much per MiB of it: a floor rate of
# 1 MiB/s, so a big archive on a slow link still lands while a trickling server is cut off
DEADLINE_SECONDS_PER_MIB = 1.0


class Refused(Exception):
    """The store answered with one of the statuses a caller named (``Bucket.refused_as``): a
    request it does not take, said by its HTTP status and code."""


class DeadlinePassed(Exception):
    """Raised from botocore's before-send hook: the object's deadline passed (no more attempts)."""


@dataclass(frozen=True)
class Integrity:
    """What one endpoint was found to enforce (``probe``): only what a refused wrong value proved."""

    sha256_enforced: bool  # a wrong x-amz-checksum-sha256 was refused
    sha256_returned: bool  # HEAD with ChecksumMode returned the one we sent
    md5_enforced: bool  # a wrong Content-MD5 was refused

    @property
    def sha256(self) -> bool:
        return self.sha256_enforced and self.sha256_returned


# endpoint, region, bucket -> what the probe found: once per process (the daemon probes again
# when a reload points it elsewhere: a new key)
_PROBED: Dict[Tuple[str, str, str], Integrity] = {}
_PROBE_MU = threading.Lock()


def expand_prefix(prefix: str, cluster: str, host: Optional[str] = None) -> str:
    """``{cluster}`` and ``{host}`` in the key prefix. Every master backs up on its own schedule:
    with ``{host}`` in the prefix their copies never share a key (two masters uploading in the
    same second would otherwise overwrite each other) and each keeps its own remote retention."""
    if host is None:
        import socket

        host = socket.gethostname()
    safe_host = re.sub(r"[^A-Za-z0-9._-]", "_", host.split(".")[0]) or "host"
    return prefix.replace("{cluster}", cluster).replace("{host}", safe_host)


class Bucket:
    """A boto3 S3 client bound to one bucket and prefix, translating SDK errors."""

    def __init__(self, cfg: Config) -> None:
        r = cfg.backup.remote
        if not r.enabled:
            raise BackupError("remote copies are not enabled ([backup.remote] enabled = false)")
        self.section = r
        self.bucket = r.bucket
        prefix = expand_prefix(r.prefix, cfg.cluster.name)
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        access, secret = _credentials(r)
        self._secrets = [s for s in (access, secret) if s]
        self._deadline: Optional[float] = None  # monotonic; set by within()
        self.hung = False  # a request timed out: best-effort clean-ups are skipped, not waited on
        self.client = _client(r, access, secret, self._check_deadline)

    @property
    def store(self) -> Tuple[str, str, str]:
        """Endpoint, region and bucket: what is found out once per store (``probe``)."""
        r = self.section
        return r.endpoint or f"aws:{r.region}", r.region, self.bucket

    def key(self, name: str) -> str:
        return self.prefix + name

    def where(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    @contextlib.contextmanager
    def within(self, size: int = 0) -> Iterator[None]:
        """One object's deadline: ``deadline`` seconds plus one a MiB of ``size``, retries included.
        Checked before every request attempt (botocore's before-send) and every chunk read."""
        seconds = self.section.deadline + size / MiB * DEADLINE_SECONDS_PER_MIB
        outer, self._deadline = self._deadline, time.monotonic() + seconds
        try:
            yield
        finally:
            self._deadline = outer

    def _check_deadline(self, **_kwargs: Any) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise DeadlinePassed()

    def check_deadline(self, what: str) -> None:
        """For loops outside botocore (a body read in chunks): BackupError once the deadline passed."""
        with self.errors(what):
            self._check_deadline()

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Turn botocore errors into BackupError in one sentence, never quoting a credential."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            ReadTimeoutError,
        )

        r = self.section
        try:
            yield
        except ClientError as exc:
            raise BackupError(self.scrub(f"{what}: {client_error_text(exc.response)}")) from None
        except DeadlinePassed:
            self.hung = True
            raise BackupError(f"{what}: gave up after the object's deadline ([backup.remote] deadline = "
                              f"{r.deadline:g} s plus {DEADLINE_SECONDS_PER_MIB:g} s a MiB) passed") from None
        except (ReadTimeoutError, ConnectTimeoutError) as exc:
            self.hung = True
            kind = "accept a connection" if isinstance(exc, ConnectTimeoutError) else "answer"
            limit = r.connect_timeout if isinstance(exc, ConnectTimeoutError) else r.read_timeout
            raise BackupError(f"{what}: {self.endpoint_name()} did not {kind} within {limit:g} s, "
                              f"{r.max_attempts} attempt(s) ([backup.remote] connect_timeout, read_timeout, "
                              "max_attempts)") from None
        except EndpointConnectionError as exc:
            raise BackupError(self.scrub(f"{what}: {exc}{self.addressing_hint()}")) from None
        except BotoCoreError as exc:
            raise BackupError(self.scrub(f"{what}: {exc}")) from None

    @contextlib.contextmanager
    def refused_as(self, statuses: "frozenset[int]") -> Iterator[None]:
        """An S3 error of one of ``statuses`` raised as ``Refused`` (inside ``errors``: every
        other one stays a failure)."""
        from botocore.exceptions import ClientError

        try:
            yield
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in statuses:
                raise Refused(client_error_text(exc.response)) from None
            raise

    def endpoint_name(self) -> str:
        return self.section.endpoint or f"the AWS endpoint of {self.section.region}"

    def addressing_hint(self) -> str:
        """Virtual-hosted addresses put the bucket in the host name (bucket.host): a private
        endpoint's DNS rarely resolves it, and the SDK's error names only the URL."""
        r = self.section
        if r.addressing_style != "virtual" or r.endpoint is None or is_ip_endpoint(r.endpoint):
            return ""
        return (f" (addressing_style = \"virtual\" puts the bucket in the host name, {r.bucket}.<endpoint host>; "
                "MinIO, Ceph RGW and most private endpoints need addressing_style = \"path\")")

    def scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text


def client_error_text(response: Any) -> str:
    """S3's error in one sentence: HTTP status, code and message. Ceph RGW sends no message, and
    botocore's own text then ends in "operation: None": the status and code are what is known."""
    err = response.get("Error", {}) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = err.get("Code") or ""
    message = err.get("Message") or ""
    head = " ".join(p for p in (f"HTTP {status}" if status else "", code if code != str(status) else "") if p)
    return f"{head or 'an S3 error'}: {message}" if message else f"{head or 'an S3 error'} (the server sent no message)"


def _credentials(r: RemoteSection) -> Tuple[Optional[str], Optional[str]]:
    """Inline keys, or the AWS-style credentials file (must not be readable by others); else (None, None).

    (None, None) lets boto3 use its default chain (environment, ~/.aws, instance profile).
    """
    if r.access_key is not None:
        return r.access_key, r.secret_key
    path = r.credentials_file
    if path is None:
        return None, None
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"backup.remote.credentials_file {path}: {exc.strerror}") from None
    if st.st_mode & 0o077:
        raise ConfigError(
            f"backup.remote.credentials_file {path} has mode {st.st_mode & 0o777:04o}: "
            "it holds secrets, make it 0600 (chmod 600)"
        )
    parser = configparser.ConfigParser(interpolation=None)
    try:
        with open(path, encoding="utf-8") as fh:
            parser.read_file(fh)
    except (OSError, UnicodeDecodeError, configparser.Error) as exc:
        # configparser errors may quote lines of the file: name only the kind of problem
        raise ConfigError(f"backup.remote.credentials_file {path} is not readable INI ({type(exc).__name__})") from None
    section = r.credentials_profile
    if not parser.has_section(section):
        raise ConfigError(f"backup.remote.credentials_file {path} has no [{section}] profile")
    access = parser.get(section, "aws_access_key_id", fallback="").strip()
    secret = parser.get(section, "aws_secret_access_key", fallback="").strip()
    if not access or not secret:
        raise ConfigError(
            f"backup.remote.credentials_file {path} [{section}] needs aws_access_key_id and aws_secret_access_key"
        )
    return access, secret


# one SDK session for every Bucket whose credentials the config holds: a fresh one loads and
# parses the S3 model again for each client (~0.1-0.2 CPU s), and a restore from the bucket makes
# one per fetch worker (a deadline is per object) and per step of its plan; its clients are
# botocore's (no boto3 transfer methods: none is called here), each with its own event hooks
_SESSION: Any = None
_SESSION_MU = threading.Lock()


def _shared_session() -> Any:
    """The process's SDK session (under ``_SESSION_MU``)."""
    global _SESSION
    if _SESSION is None:
        import botocore.session

        _SESSION = botocore.session.get_session()
    return _SESSION


def _client(r: RemoteSection, access: Optional[str], secret: Optional[str], deadline_hook: Any) -> Any:
    import boto3.session  # lazy: importing boto3 costs ~0.3 s
    from botocore.config import Config as BotoConfig

    _quiet_sdk_logs()
    config = BotoConfig(
        region_name=r.region,
        signature_version="s3v4",
        # a Literal in the stubs; validated: auto|path|virtual. No SHA-256 of each body for the
        # signature (botocore's own choice on https): every upload request carries its Content-MD5
        # (and its SHA-256 checksum where enforced) in a signed header, which binds the body as
        # well, and hashing each part once more cost the client and the server a core-second a GiB
        s3={"addressing_style": r.addressing_style, "payload_signing_enabled": False},  # type: ignore[arg-type]
        connect_timeout=r.connect_timeout,
        read_timeout=r.read_timeout,
        # botocore retries only throttling, 5xx, timeouts and connection errors, with backoff; a
        # hung gateway costs at most max_attempts x (connect_timeout + read_timeout + the 1 s a
        # PUT waits for "100 Continue") a request, plus the backoff. total_max_attempts counts
        # the first try; botocore's "max_attempts" would count retries only (one more than said)
        retries={"mode": "standard", "total_max_attempts": r.max_attempts},
        # botocore >= 1.36 adds CRC32 checksum trailers to every upload, which several
        # S3-compatible servers (OSS, older Ceph RGW) reject; we send our own digests instead
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    verify: Any = r.ca_bundle if r.ca_bundle else r.verify_tls
    if access is None or secret is None:  # boto3's default chain (environment, profile, instance role): a session of its own, as read now
        session = boto3.session.Session(aws_access_key_id=access, aws_secret_access_key=secret)
        client = session.client("s3", endpoint_url=r.endpoint, config=config, verify=verify)
    else:
        with _SESSION_MU:  # a session is not thread-safe; its clients are
            client = _shared_session().create_client("s3", endpoint_url=r.endpoint, config=config, verify=verify,
                                                      aws_access_key_id=access, aws_secret_access_key=secret)
    # before every attempt, retries included: an object past its deadline gets no more requests
    client.meta.events.register("before-send.s3", deadline_hook)
    return client


def probe(b: "Bucket") -> Integrity:
    """What the store enforces, found once per endpoint and bucket (cached for the process).

    A tiny object is put with the right x-amz-checksum-sha256 (does HEAD with ChecksumMode give it
    back?), then with a deliberately wrong one, then with a wrong Content-MD5: only a refusal
    proves the store checks that header (Ceph RGW 16 accepts the wrong SHA-256 and never returns
    it, but refuses a wrong MD5). The probe objects are deleted; they sit under the prefix with a
    name no backup or segment has, so listings pass over a leftover."""
    key = b.store
    with _PROBE_MU:
        found = _PROBED.get(key)
    if found is not None:
        return found
    import base64

    from botocore.exceptions import ClientError

    body = b"etcd-agent: what does this store check?\n"
    wrong = hashlib.sha256(b"not the body").digest()
    name = f".etcd-agent-probe-{uuid.uuid4().hex[:12]}"

    def put_refused(**integrity: str) -> bool:
        try:
            b.client.put_object(Bucket=b.bucket, Key=b.key(name), Body=body, **integrity)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 400:  # BadDigest, InvalidRequest, XAmzContentSHA256Mismatch: refused
                return True
            raise
        return False

    with b.within(), b.errors(f"cannot probe what {b.endpoint_name()} checks (put, head and delete {b.where(name)})"):
        try:
            # the right value first: a store that refuses the header itself checks nothing with it
            right = base64.b64encode(hashlib.sha256(body).digest()).decode()
            sha_enforced = returned = False
            if not put_refused(ChecksumSHA256=right):
                head = b.client.head_object(Bucket=b.bucket, Key=b.key(name), ChecksumMode="ENABLED")
                returned = head.get("ChecksumSHA256") == right
                sha_enforced = put_refused(ChecksumSHA256=base64.b64encode(wrong).decode())
            md5_enforced = put_refused(ContentMD5=base64.b64encode(hashlib.md5(b"not the body").digest()).decode())
        finally:
            if not b.hung:
                with contextlib.suppress(Exception):
                    b.client.delete_object(Bucket=b.bucket, Key=b.key(name))
    found = Integrity(sha256_enforced=sha_enforced, sha256_returned=returned, md5_enforced=md5_enforced)
    log.info("%s (bucket %s) %s a wrong x-amz-checksum-sha256%s, %s a wrong Content-MD5", b.endpoint_name(),
             b.bucket, "refuses" if sha_enforced else "ACCEPTS", "" if returned else " and does not return it",
             "refuses" if md5_enforced else "ACCEPTS")
    with _PROBE_MU:
        _PROBED[key] = found
    return found


def _quiet_sdk_logs() -> None:
    """botocore's DEBUG output includes request headers (the access key id in Authorization)."""
    for name in ("botocore", "boto3", "s3transfer"):
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)


# what each check proves, for the log line
CHECKS = {
    "checksum": "checksum (x-amz-checksum-sha256 of every part, checked by the store, and returned)",
    "etag": "etag (Content-MD5 of every part, checked by the store, and the MD5 ETag)",
    "read-back": "read-back (the object streamed back and its sha256 compared)",
}


def choose_check(b: Bucket) -> str:
    """The check an upload gets: what ``verify`` asks, from what the store was found to enforce.

    ``checksum`` on a store that accepts a wrong SHA-256 (or never returns one) is refused: a
    copy logged as checked by a checksum nobody checked is worse than no claim."""
    mode = b.section.verify
    if mode == "download":
        return "read-back"
    if mode == "etag":
        return "etag"
    found = probe(b)
    if found.sha256:
        return "checksum"
    if mode == "checksum":
        how = "accepts a wrong x-amz-checksum-sha256" if not found.sha256_enforced else "does not return it"
        raise BackupError(
            f"[backup.remote] verify = \"checksum\", but {b.endpoint_name()} {how}: it does not check SHA-256 "
            "checksums, so no copy could be verified by one; set verify = \"auto\" (the strongest check the "
            "store enforces: Content-MD5 and the MD5 ETag on Ceph RGW) or \"etag\""
        )
    return "etag" if found.md5_enforced else "read-back"
