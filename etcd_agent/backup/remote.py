"""Off-host copies of backup archives in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, OSS).

Every copy is verified after upload, and a copy that does not verify is deleted at once: a bucket
holds only objects whose size and SHA-256 match the local archive. The SHA-256 of the whole
archive travels as object metadata (``x-amz-meta-sha256``) so ``download`` can check a copy
end to end; the upload itself is checked by the server part by part (``x-amz-checksum-sha256``,
or ``Content-MD5`` for servers without the newer checksums) and read back after completion.

Uploads are streamed in parts of ``part_size_mb``: memory does not grow with the archive size.
boto3 is imported inside the functions so that importing this module (and ``--help``) stays
cheap. This is the only module that imports boto3; its errors become ``BackupError`` here, with
credentials scrubbed from every message.
"""
from __future__ import annotations

import base64
import configparser
import contextlib
import hashlib
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from ..config import Config, RemoteSection
from ..errors import BackupCorrupt, BackupError, ConfigError
from ..fs import fsync_dir
from .archive import parse_name
from .retention import BackupRef, Decision, plan

log = logging.getLogger(__name__)

MiB = 1024 * 1024
MAX_PARTS = 10000  # the S3 limit on parts per multipart upload
READ_CHUNK = MiB
MD5_ETAG_RE = re.compile(r"^[0-9a-fA-F]{32}(?:-\d+)?$")
# manifest fields copied into object metadata so a bucket listing tells what a copy holds
MANIFEST_META = ("revision", "member", "created", "etcd_version", "host")


@dataclass(frozen=True)
class RemoteObject:
    """One backup copy in the bucket."""

    name: str
    key: str
    size: int
    # wall-clock time in the name (UTC when backup.utc), as the local catalog reads it
    time: datetime
    last_modified: Optional[datetime]
    sha256: Optional[str]
    etag: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "size": self.size,
            "time": self.time.isoformat(),
            "last_modified": self.last_modified.isoformat() if self.last_modified else None,
            "sha256": self.sha256,
            "metadata": dict(self.metadata),
        }


@dataclass(frozen=True)
class _Digests:
    """What one streamed pass over the local file found: size, SHA-256, and per-part digests."""

    size: int
    sha256: str
    part_size: int
    parts: Tuple[Tuple[bytes, bytes], ...]  # (md5, sha256) raw digests per part

    @property
    def multipart(self) -> bool:
        return len(self.parts) > 1

    def checksum_sha256(self) -> str:
        """The x-amz-checksum-sha256 S3 reports: plain for one PUT, composite ("…-N") for parts."""
        if not self.multipart:
            return _b64(self.parts[0][1])
        return f"{_b64(hashlib.sha256(b''.join(s for _, s in self.parts)).digest())}-{len(self.parts)}"

    def md5_etag(self) -> str:
        """The ETag S3 computes without SSE-KMS/SSE-C: MD5, or MD5 of the part MD5s plus "-N"."""
        if not self.multipart:
            return self.parts[0][0].hex()
        return f"{hashlib.md5(b''.join(m for m, _ in self.parts)).hexdigest()}-{len(self.parts)}"


def expand_prefix(prefix: str, cluster: str, host: Optional[str] = None) -> str:
    """``{cluster}`` and ``{host}`` in the key prefix. Every master backs up on its own schedule:
    with ``{host}`` in the prefix their copies never share a key (two masters uploading in the
    same second would otherwise overwrite each other) and each keeps its own remote retention."""
    if host is None:
        import socket

        host = socket.gethostname()
    safe_host = re.sub(r"[^A-Za-z0-9._-]", "_", host.split(".")[0]) or "host"
    return prefix.replace("{cluster}", cluster).replace("{host}", safe_host)


class _Bucket:
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


# ---------------------------------------------------------------- public entry points


def upload_and_verify(cfg: Config, path: str, manifest: Mapping[str, Any]) -> RemoteObject:
    """Upload a finished archive, verify the copy, return it; a bad copy is deleted, BackupError raised."""
    name = os.path.basename(path)
    if parse_name(name) is None:
        raise BackupError(f"{name!r} is not a backup archive name (etcd-YYYY-MM-DD-HH-MM-SS.tar)")
    return upload_file(cfg, path, name, lambda sha: _metadata(sha, manifest))


def upload_file(cfg: Config, path: str, name: str,
                metadata: Callable[[str], Dict[str, str]] = lambda sha: {"sha256": sha}) -> RemoteObject:
    """Upload ``path`` as ``name`` under the prefix (``name`` may hold one "/": delta segments go
    under ``delta-<revision>/``), verified as every copy is; ``metadata(sha256)`` names the object's
    metadata (it must keep ``sha256``)."""
    b = _Bucket(cfg)
    started = time.monotonic()
    try:
        digests = _local_digests(path, _part_size(b.section, os.path.getsize(path)))
        _put_file(b, name, path, digests, metadata(digests.sha256))
    except OSError as exc:
        raise BackupError(f"cannot read {path}: {exc.strerror or exc}") from exc
    obj = _verify_upload(b, name, digests)
    log.info(
        "copied %s to %s (%d bytes in %d part%s, %.1fs, verified by %s)",
        name, b.where(name), digests.size, len(digests.parts), "s" if digests.multipart else "",
        time.monotonic() - started, b.section.verify,
    )
    return obj


def list_names(cfg: Config, under: str) -> List[str]:
    """Object names (relative to the prefix) that start with ``under``."""
    b = _Bucket(cfg)
    out: List[str] = []
    with b.errors(f"cannot list s3://{b.bucket}/{b.prefix}{under}"):
        for page in b.client.get_paginator("list_objects_v2").paginate(Bucket=b.bucket, Prefix=b.prefix + under):
            out += [item["Key"][len(b.prefix):] for item in page.get("Contents", [])]
    return out


def delete_names(cfg: Config, names: List[str]) -> None:
    b = _Bucket(cfg)
    for name in names:
        with b.errors(f"cannot delete {b.where(name)}"):
            b.client.delete_object(Bucket=b.bucket, Key=b.key(name))


def list_remote(cfg: Config) -> List[RemoteObject]:
    """The backup copies under the prefix, newest first (objects not named like backups are ignored)."""
    return _list(_Bucket(cfg))


def _list(b: _Bucket) -> List[RemoteObject]:
    out: List[RemoteObject] = []
    with b.errors(f"cannot list s3://{b.bucket}/{b.prefix}"):
        # Delimiter: the delta segments under delta-<revision>/ are not walked
        pages = b.client.get_paginator("list_objects_v2").paginate(Bucket=b.bucket, Prefix=b.prefix, Delimiter="/")
        for page in pages:
            for item in page.get("Contents", []):
                name = item["Key"][len(b.prefix):]
                if "/" in name or parse_name(name) is None:  # only backups are listed or pruned
                    continue
                out.append(_head(b, name))
    out.sort(key=lambda o: (o.time, o.name), reverse=True)
    return out


def prune_remote(cfg: Config, dry_run: bool) -> List[Decision]:
    """Apply the remote retention (``[backup.remote] keep_*``); each deletion is logged with its reason."""
    r = cfg.backup.remote
    b = _Bucket(cfg)
    objects = _list(b)
    # a copy counts as verified when it carries our checksum: bad uploads were deleted at once
    refs = [BackupRef(o.name, o.time, verified=o.sha256 is not None) for o in objects]
    decisions = plan(refs, keep_last=r.keep_last, keep_hourly=r.keep_hourly, keep_daily=r.keep_daily)
    failed: List[str] = []
    for d in decisions:
        if d.keep:
            log.debug("keeping %s: %s", b.where(d.name), d.reason)
        elif dry_run:
            log.info("would delete %s: %s", b.where(d.name), d.reason)
        else:
            try:
                with b.errors(f"cannot delete {b.where(d.name)}"):
                    b.client.delete_object(Bucket=b.bucket, Key=b.key(d.name))
                log.info("deleted %s: %s", b.where(d.name), d.reason)
            except BackupError as exc:
                failed.append(exc.message)
    from ..delta import offsite  # a copy and the delta chain that continues it go together

    keep = {d.name for d in decisions if d.keep}
    kept_revisions = {int(o.metadata["revision"]) for o in objects
                      if o.name in keep and str(o.metadata.get("revision", "")).isdigit()}
    try:
        decisions = decisions + offsite.prune_remote_chains(cfg, kept_revisions, dry_run=dry_run)
    except BackupError as exc:
        failed.append(exc.message)
    if failed:
        raise BackupError(f"remote prune: {len(failed)} deletion(s) failed", details=failed)
    return decisions


def download(cfg: Config, name: str, dest: str) -> str:
    """Stream copy ``name`` to ``dest`` (a file path or a directory), SHA-256 checked; returns the path.

    The file appears (mode 0600, via temp + rename) only once its size and checksum match.
    """
    if parse_name(name) is None:  # also keeps "../x" out of dest
        raise BackupError(f"{name!r} is not a backup archive name")
    b = _Bucket(cfg)
    obj = _head(b, name)
    if obj.sha256 is None:
        raise BackupCorrupt(f"{b.where(name)} carries no sha256 metadata: it cannot be checked")
    target = os.path.join(dest, name) if os.path.isdir(dest) else dest
    directory = os.path.dirname(os.path.abspath(target))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".part", dir=directory)
    except OSError as exc:
        raise BackupError(f"cannot write into {directory}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            size, sha = _stream_object(b, name, fh)
            fh.flush()
            os.fsync(fh.fileno())
        problems = _mismatches(obj.size, obj.sha256, size, sha)
        if problems:
            raise BackupCorrupt(f"{b.where(name)} failed its checksum on download", details=problems)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise BackupError(f"cannot write {target}: {exc.strerror or exc}") from exc
        raise
    fsync_dir(directory)
    log.info("downloaded %s to %s (%d bytes, sha256 ok)", b.where(name), target, size)
    return target


def verify_remote(cfg: Config, name: str) -> RemoteObject:
    """Read copy ``name`` back in full and check it against its sha256 metadata (nothing is deleted)."""
    b = _Bucket(cfg)
    obj = _head(b, name)
    if obj.sha256 is None:
        raise BackupCorrupt(f"{b.where(name)} carries no sha256 metadata: it cannot be checked")
    size, sha = _stream_object(b, name, None)
    problems = _mismatches(obj.size, obj.sha256, size, sha)
    if problems:
        raise BackupCorrupt(f"{b.where(name)} does not match its checksum", details=problems)
    return obj


# ---------------------------------------------------------------- upload and verification


def _part_size(r: RemoteSection, size: int) -> int:
    """The configured part size, raised when needed to stay within S3's 10,000 parts."""
    part = r.part_size_mb * MiB
    return max(part, -(-size // MAX_PARTS))


def _local_digests(path: str, part_size: int) -> _Digests:
    """One streamed pass: whole-file SHA-256 plus MD5/SHA-256 of each part (to send and expect)."""
    whole = hashlib.sha256()
    parts: List[Tuple[bytes, bytes]] = []
    size = 0
    with open(path, "rb") as fh:
        while True:
            md5, sha, n = hashlib.md5(), hashlib.sha256(), 0
            while n < part_size:
                chunk = fh.read(min(READ_CHUNK, part_size - n))
                if not chunk:
                    break
                md5.update(chunk)
                sha.update(chunk)
                whole.update(chunk)
                n += len(chunk)
            if n == 0 and parts:
                break
            parts.append((md5.digest(), sha.digest()))
            size += n
            if n < part_size:
                break
    return _Digests(size=size, sha256=whole.hexdigest(), part_size=part_size, parts=tuple(parts))


def _metadata(sha256: str, manifest: Mapping[str, Any]) -> Dict[str, str]:
    meta = {"sha256": sha256}
    for key in MANIFEST_META:
        value = manifest.get(key)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            # S3 user metadata is ASCII only and small
            meta[key.replace("_", "-")] = _ascii(value)
    cluster = manifest.get("cluster")
    if isinstance(cluster, Mapping) and isinstance(cluster.get("id"), str):
        meta["cluster-id"] = _ascii(cluster["id"])
    return meta


def _ascii(value: Any) -> str:
    return str(value).encode("ascii", "replace").decode()[:200]  # S3 user metadata is ASCII, small


def _put_file(b: _Bucket, name: str, path: str, d: _Digests, meta: Dict[str, str]) -> None:
    """Upload ``path``: one PUT, or a multipart upload that is aborted on any failure.

    Each request carries the digest from the first pass, so the server rejects a part whose
    bytes changed in transit or on disk since.
    """
    key = b.key(name)
    checksum = b.section.verify == "checksum"

    def integrity(md5: bytes, sha: bytes) -> Dict[str, str]:
        return {"ChecksumSHA256": _b64(sha)} if checksum else {"ContentMD5": _b64(md5)}

    if not d.multipart:
        extra = {"ChecksumAlgorithm": "SHA256"} if checksum else {}
        with open(path, "rb") as fh, b.errors(f"cannot upload {b.where(name)}"):
            b.client.put_object(
                Bucket=b.bucket, Key=key, Body=fh, ContentLength=d.size, Metadata=meta,
                **integrity(*d.parts[0]), **extra,
            )
        return
    extra = {"ChecksumAlgorithm": "SHA256"} if checksum else {}
    with b.errors(f"cannot start the upload of {b.where(name)}"):
        upload_id = b.client.create_multipart_upload(Bucket=b.bucket, Key=key, Metadata=meta, **extra)["UploadId"]
    try:
        done: List[Dict[str, Any]] = []
        with open(path, "rb") as fh:
            for number, (md5, sha) in enumerate(d.parts, start=1):
                data = fh.read(d.part_size)  # one part in memory at a time
                with b.errors(f"cannot upload part {number}/{len(d.parts)} of {b.where(name)}"):
                    resp = b.client.upload_part(
                        Bucket=b.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data,
                        **integrity(md5, sha),
                    )
                part = {"PartNumber": number, "ETag": resp["ETag"]}
                if checksum:
                    part["ChecksumSHA256"] = _b64(sha)
                done.append(part)
                del data
        with b.errors(f"cannot complete the upload of {b.where(name)}"):
            b.client.complete_multipart_upload(
                Bucket=b.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
            )
    except BaseException:
        # leave no orphaned parts (they cost storage and never show in listings)
        try:
            b.client.abort_multipart_upload(Bucket=b.bucket, Key=key, UploadId=upload_id)
        except Exception as exc:  # the original error matters more
            log.warning("could not abort the upload of %s: %s", b.where(name), b.scrub(str(exc)))
        raise


def _verify_upload(b: _Bucket, name: str, d: _Digests) -> RemoteObject:
    """Check the fresh copy (size, our sha256 metadata, then checksum / ETag / full read); delete it if bad."""
    mode = b.section.verify
    obj, checksum = _head_raw(b, name, checksum_mode=mode == "checksum")
    problems = _mismatches(d.size, d.sha256, obj.size, obj.sha256 or "(none)", sha_what="sha256 metadata")
    if not problems:
        if mode == "checksum" and checksum:
            if not _same_checksum(checksum, d):
                problems.append(f"x-amz-checksum-sha256 {checksum} != expected {d.checksum_sha256()}")
        elif mode == "etag" and MD5_ETAG_RE.match(obj.etag):
            if obj.etag.lower() != d.md5_etag():
                problems.append(f"ETag {obj.etag} != expected {d.md5_etag()}")
        else:
            # no usable server checksum (not supported, SSE-KMS ETag, or asked for): read it back
            log.debug("verifying %s by reading it back", b.where(name))
            size, sha = _stream_object(b, name, None)
            problems = _mismatches(d.size, d.sha256, size, sha)
    if problems:
        try:
            with b.errors(f"cannot delete the bad copy {b.where(name)}"):
                b.client.delete_object(Bucket=b.bucket, Key=b.key(name))
            gone = "deleted"
        except BackupError as exc:
            gone = f"NOT deleted ({exc.message})"
        raise BackupCorrupt(f"the copy at {b.where(name)} did not verify and was {gone}", details=problems)
    return obj


def _same_checksum(server: str, d: _Digests) -> bool:
    """Compare the server's checksum; servers differ on whether a composite one ends in "-N"."""
    want, _, count = d.checksum_sha256().partition("-")
    got, _, got_count = server.partition("-")
    return got == want and (not got_count or got_count == count)


def _mismatches(want_size: int, want_sha: str, size: int, sha: str, *, sha_what: str = "sha256") -> List[str]:
    out = []
    if size != want_size:
        out.append(f"size {size} != expected {want_size}")
    if sha != want_sha:
        out.append(f"{sha_what} {sha} != expected {want_sha}")
    return out


def _head(b: _Bucket, name: str) -> RemoteObject:
    return _head_raw(b, name, checksum_mode=False)[0]


def _head_raw(b: _Bucket, name: str, *, checksum_mode: bool) -> Tuple[RemoteObject, Optional[str]]:
    """HEAD one object: the RemoteObject and the server's x-amz-checksum-sha256, if any."""
    extra = {"ChecksumMode": "ENABLED"} if checksum_mode else {}
    with b.errors(f"cannot read {b.where(name)}"):
        h = b.client.head_object(Bucket=b.bucket, Key=b.key(name), **extra)
    meta = {k.lower(): v for k, v in (h.get("Metadata") or {}).items()}
    obj = RemoteObject(
        name=name,
        key=b.key(name),
        size=int(h["ContentLength"]),
        time=_name_time(name, h.get("LastModified")),
        last_modified=h.get("LastModified"),
        sha256=meta.get("sha256"),
        etag=str(h.get("ETag", "")).strip('"'),
        metadata=meta,
    )
    return obj, h.get("ChecksumSHA256")


def _stream_object(b: _Bucket, name: str, out: Any) -> Tuple[int, str]:
    """GET the object in chunks, hashing (and writing to ``out`` if given); returns (size, sha256)."""
    sha = hashlib.sha256()
    size = 0
    with b.errors(f"cannot read {b.where(name)}"):
        body = b.client.get_object(Bucket=b.bucket, Key=b.key(name))["Body"]
        try:
            for chunk in body.iter_chunks(READ_CHUNK):
                sha.update(chunk)
                size += len(chunk)
                if out is not None:
                    out.write(chunk)
        finally:
            body.close()
    return size, sha.hexdigest()


def _name_time(name: str, fallback: Optional[datetime]) -> datetime:
    parsed = parse_name(name)
    if parsed is not None:
        return parsed[0]
    if fallback is not None:
        return fallback.astimezone(timezone.utc).replace(tzinfo=None)
    return datetime.fromtimestamp(0)


# ---------------------------------------------------------------- client and credentials


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


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")

