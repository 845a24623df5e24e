"""Off-host copies of backup archives in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, OSS).

Every copy is verified after upload, and a copy that does not verify is deleted at once: a bucket
holds only objects whose size and SHA-256 match the local archive. The SHA-256 of the whole
archive travels as object metadata (``x-amz-meta-sha256``) so ``download`` can check a copy
end to end; the upload itself is checked by the server part by part (``x-amz-checksum-sha256``,
or ``Content-MD5`` for servers without the newer checksums) and read back after completion.

Uploads are streamed in parts of ``part_size_mb``: memory does not grow with the archive size.
What a correct copy shows is ``remotedigests``'; the client, its credentials and its errors are
``remotebucket``'s (the only importer of boto3).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..config import Config
from ..errors import BackupCorrupt, BackupError
from ..fs import fsync_dir, open_regular
from .archive import parse_name
from .remotebucket import Bucket
from .remotedigests import (
    MD5_ETAG_RE,
    READ_CHUNK,
    Digests,
    b64,
    local_digests,
    mismatches,
    part_size_for,
    same_checksum,
)
from .retention import BackupRef, Decision, plan

log = logging.getLogger(__name__)

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
    chain: str = ""  # the chain's key under chains/ ("" a legacy copy at the top of the prefix)

    def to_json(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "chain": self.chain or None,
            "legacy": not self.chain,
            "size": self.size,
            "time": self.time.isoformat(),
            "last_modified": self.last_modified.isoformat() if self.last_modified else None,
            "sha256": self.sha256,
            "metadata": dict(self.metadata),
        }


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
    b = Bucket(cfg)
    started = time.monotonic()
    try:
        digests = local_digests(path, part_size_for(b.section, os.path.getsize(path)))
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
    b = Bucket(cfg)
    out: List[str] = []
    with b.errors(f"cannot list s3://{b.bucket}/{b.prefix}{under}"):
        for page in b.client.get_paginator("list_objects_v2").paginate(Bucket=b.bucket, Prefix=b.prefix + under):
            out += [item["Key"][len(b.prefix):] for item in page.get("Contents", [])]
    return out


def list_objects(cfg: Config, under: str) -> List[Tuple[str, int, str]]:
    """(name relative to the prefix, size, ETag) of every object that starts with ``under``: one
    paginated listing, no metadata (the copy queue's view of the bucket)."""
    b = Bucket(cfg)
    out: List[Tuple[str, int, str]] = []
    with b.errors(f"cannot list s3://{b.bucket}/{b.prefix}{under}"):
        for page in b.client.get_paginator("list_objects_v2").paginate(Bucket=b.bucket, Prefix=b.prefix + under):
            out += [(item["Key"][len(b.prefix):], int(item.get("Size", 0)), str(item.get("ETag", "")).strip('"'))
                    for item in page.get("Contents", [])]
    return out


def head_sha256(cfg: Config, name: str) -> Optional[str]:
    """The sha256 metadata of object ``name`` (None: it carries none)."""
    return _head(Bucket(cfg), name).sha256


def manifest_metadata(sha256: str, manifest: Mapping[str, Any]) -> Dict[str, str]:
    """The metadata of a full backup's (or a checkpoint's) copy: its sha256 and manifest fields."""
    return _metadata(sha256, manifest)


def delete_names(cfg: Config, names: List[str]) -> None:
    b = Bucket(cfg)
    for name in names:
        with b.errors(f"cannot delete {b.where(name)}"):
            b.client.delete_object(Bucket=b.bucket, Key=b.key(name))


def list_remote(cfg: Config) -> List[RemoteObject]:
    """The backup copies under the prefix, newest first (objects not named like backups are ignored)."""
    return _list(Bucket(cfg))


def _list(b: Bucket) -> List[RemoteObject]:
    """Full backup copies: ``chains/<key>/<name>`` (``bucket.layout``) and the legacy ones at the
    top of the prefix; ``name`` is the backup's file name, ``chain`` its chain's key ("" legacy)."""
    from etcd_agent.bucket import layout

    out: List[RemoteObject] = []
    with b.errors(f"cannot list s3://{b.bucket}/{b.prefix}"):
        pages = b.client.get_paginator("list_objects_v2").paginate(Bucket=b.bucket, Prefix=b.prefix)
        for page in pages:
            for item in page.get("Contents", []):
                rel = item["Key"][len(b.prefix):]
                placed = layout.place(rel)
                if placed is None or placed.kind != layout.FULL:  # only full backups are listed or pruned here
                    continue
                obj = _head(b, rel)
                out.append(replace(obj, name=placed.file, time=_name_time(placed.file, obj.last_modified),
                                   chain=placed.key))
    out.sort(key=lambda o: (o.time, o.name, o.chain), reverse=True)
    return out


def prune_remote(cfg: Config, dry_run: bool) -> List[Decision]:
    """Apply the remote retention (``[backup.remote] keep_*``); each deletion is logged with its reason.

    The rule decides per backup name; a backup copied twice (a legacy copy at the top of the
    prefix and one under ``chains/``) is kept or deleted as one. Chains, checkpoints and legacy
    ``delta-<revision>/`` segments go with their full backup (``offsite.prune_remote_chains``)."""
    r = cfg.backup.remote
    b = Bucket(cfg)
    objects = _list(b)
    copies: Dict[str, List[RemoteObject]] = {}
    for o in objects:
        copies.setdefault(o.name, []).append(o)
    # a copy counts as verified when it carries our checksum: bad uploads were deleted at once
    refs = [BackupRef(n, cs[0].time, verified=any(c.sha256 is not None for c in cs)) for n, cs in copies.items()]
    decisions = plan(refs, keep_last=r.keep_last, keep_hourly=r.keep_hourly, keep_daily=r.keep_daily)
    failed: List[str] = []
    for d in decisions:
        for o in copies[d.name]:
            where = f"s3://{b.bucket}/{o.key}"
            if d.keep:
                log.debug("keeping %s: %s", where, d.reason)
            elif dry_run:
                log.info("would delete %s: %s", where, d.reason)
            else:
                try:
                    with b.errors(f"cannot delete {where}"):
                        b.client.delete_object(Bucket=b.bucket, Key=o.key)
                    log.info("deleted %s: %s", where, d.reason)
                except BackupError as exc:
                    failed.append(exc.message)
    from ..delta import offsite  # a copy and the delta chain that continues it go together

    keep = {d.name for d in decisions if d.keep}
    kept = [o for o in objects if o.name in keep]
    kept_revisions = {int(o.metadata["revision"]) for o in kept if str(o.metadata.get("revision", "")).isdigit()}
    try:
        decisions = decisions + offsite.prune_remote_chains(cfg, {o.chain for o in kept if o.chain}, kept_revisions,
                                                            dry_run=dry_run)
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
    b = Bucket(cfg)
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
        problems = mismatches(obj.size, obj.sha256, size, sha)
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
    b = Bucket(cfg)
    obj = _head(b, name)
    if obj.sha256 is None:
        raise BackupCorrupt(f"{b.where(name)} carries no sha256 metadata: it cannot be checked")
    size, sha = _stream_object(b, name, None)
    problems = mismatches(obj.size, obj.sha256, size, sha)
    if problems:
        raise BackupCorrupt(f"{b.where(name)} does not match its checksum", details=problems)
    return obj


# ---------------------------------------------------------------- upload and verification


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


def _put_file(b: Bucket, name: str, path: str, d: Digests, meta: Dict[str, str]) -> None:
    """Upload ``path``: one PUT, or a multipart upload that is aborted on any failure.

    Each request carries the digest from the first pass, so the server rejects a part whose
    bytes changed in transit or on disk since.
    """
    key = b.key(name)
    checksum = b.section.verify == "checksum"

    def integrity(md5: bytes, sha: bytes) -> Dict[str, str]:
        return {"ChecksumSHA256": b64(sha)} if checksum else {"ContentMD5": b64(md5)}

    if not d.multipart:
        extra = {"ChecksumAlgorithm": "SHA256"} if checksum else {}
        with open_regular(path) as fh, b.errors(f"cannot upload {b.where(name)}"):
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
        with open_regular(path) as fh:
            for number, (md5, sha) in enumerate(d.parts, start=1):
                data = fh.read(d.part_size)  # one part in memory at a time
                with b.errors(f"cannot upload part {number}/{len(d.parts)} of {b.where(name)}"):
                    resp = b.client.upload_part(
                        Bucket=b.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data,
                        **integrity(md5, sha),
                    )
                part = {"PartNumber": number, "ETag": resp["ETag"]}
                if checksum:
                    part["ChecksumSHA256"] = b64(sha)
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


def _verify_upload(b: Bucket, name: str, d: Digests) -> RemoteObject:
    """Check the fresh copy (size, our sha256 metadata, then checksum / ETag / full read); delete it if bad."""
    mode = b.section.verify
    obj, checksum = _head_raw(b, name, checksum_mode=mode == "checksum")
    problems = mismatches(d.size, d.sha256, obj.size, obj.sha256 or "(none)", sha_what="sha256 metadata")
    if not problems:
        if mode == "checksum" and checksum:
            if not same_checksum(checksum, d):
                problems.append(f"x-amz-checksum-sha256 {checksum} != expected {d.checksum_sha256()}")
        elif mode == "etag" and MD5_ETAG_RE.match(obj.etag):
            if obj.etag.lower() != d.md5_etag():
                problems.append(f"ETag {obj.etag} != expected {d.md5_etag()}")
        else:
            # no usable server checksum (not supported, SSE-KMS ETag, or asked for): read it back
            log.debug("verifying %s by reading it back", b.where(name))
            size, sha = _stream_object(b, name, None)
            problems = mismatches(d.size, d.sha256, size, sha)
    if problems:
        try:
            with b.errors(f"cannot delete the bad copy {b.where(name)}"):
                b.client.delete_object(Bucket=b.bucket, Key=b.key(name))
            gone = "deleted"
        except BackupError as exc:
            gone = f"NOT deleted ({exc.message})"
        raise BackupCorrupt(f"the copy at {b.where(name)} did not verify and was {gone}", details=problems)
    return obj


def _head(b: Bucket, name: str) -> RemoteObject:
    return _head_raw(b, name, checksum_mode=False)[0]


def _head_raw(b: Bucket, name: str, *, checksum_mode: bool) -> Tuple[RemoteObject, Optional[str]]:
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


def _stream_object(b: Bucket, name: str, out: Any) -> Tuple[int, str]:
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
