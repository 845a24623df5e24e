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
import logging
import os
import re
from typing import Any, Iterator, Optional, Tuple

from etcd_agent.config import Config, RemoteSection
from etcd_agent.errors import BackupError, ConfigError


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
        self.client = _client(r, access, secret)

    def key(self, name: str) -> str:
        return self.prefix + name

    def where(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Turn botocore errors into BackupError, never quoting a credential."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            err = exc.response.get("Error", {})
            code = err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            raise BackupError(self.scrub(f"{what}: {code}: {err.get('Message') or exc}")) from None
        except BotoCoreError as exc:
            raise BackupError(self.scrub(f"{what}: {exc}")) from None

    def scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text


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
        raise ConfigError(f"backup.remote.credentials_file {path}: {exc.strerror}")
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
        raise ConfigError(f"backup.remote.credentials_file {path} is not readable INI ({type(exc).__name__})")
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


def _client(r: RemoteSection, access: Optional[str], secret: Optional[str]) -> Any:
    import boto3.session  # lazy: importing boto3 costs ~0.3 s
    from botocore.config import Config as BotoConfig

    _quiet_sdk_logs()
    config = BotoConfig(
        region_name=r.region,
        signature_version="s3v4",
        s3={"addressing_style": r.addressing_style},  # type: ignore[arg-type]  # a Literal in the stubs; validated: auto|path|virtual
        connect_timeout=r.connect_timeout,
        read_timeout=r.read_timeout,
        # botocore retries only throttling, 5xx and connection errors, with backoff
        retries={"mode": "standard", "max_attempts": 5},
        # botocore >= 1.36 adds CRC32 checksum trailers to every upload, which several
        # S3-compatible servers (OSS, older Ceph RGW) reject; we send our own digests instead
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    session = boto3.session.Session(aws_access_key_id=access, aws_secret_access_key=secret)
    verify: Any = r.ca_bundle if r.ca_bundle else r.verify_tls
    return session.client("s3", endpoint_url=r.endpoint, config=config, verify=verify)


def _quiet_sdk_logs() -> None:
    """botocore's DEBUG output includes request headers (the access key id in Authorization)."""
    for name in ("botocore", "boto3", "s3transfer"):
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)
