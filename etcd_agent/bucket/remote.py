"""Off-host copies of backup archives in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, OSS).

Every copy is verified after upload, and a copy that does not verify is deleted at once: a bucket
holds only objects whose size and SHA-256 match the local archive. The SHA-256 of the whole
archive travels as object metadata (``x-amz-meta-sha256``) so ``download`` can check a copy
end to end. The upload itself is checked with what the store was found to enforce (``probe``,
once per endpoint: only a wrong value refused proves a check): ``x-amz-checksum-sha256`` part
by part and the checksum it returns, or ``Content-MD5`` part by part and the MD5 ETag, or, when
neither is proven, a read-back; the log line and ``RemoteObject.verified_by`` name the check.

Every request is bounded in time (``Bucket.within``: timeouts, attempts and a deadline per
object) and every read in size: a download writes no more than the object claims, a claim
beyond ``MAX_OBJECT_BYTES`` or the free space is refused before a byte is written, and a
listing stops at ``MAX_LISTED`` objects.

Uploads are streamed in parts of ``part_size_mb``: memory does not grow with the archive size.
An upload whose caller has no digest reads the archive once: the parts are hashed as they are
sent, and the ``sha256`` metadata (S3 takes metadata only when an upload begins) is set after
the check by a copy of the object onto itself (``_set_sha256``; on Ceph RGW it rewrites the
attributes only, docs/bucket-speed.md). Until then the object carries no sha256, so nothing takes
it as a copy: the queue copies it again, a fetch refuses it. Above ``MAX_SELF_COPY``, or on a
store that refused such a copy, the sha256 is computed first (two passes).
What a correct copy shows is ``remotedigests``'; the client, its credentials and its errors are
``remotebucket``'s (the only importer of the SDK).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from etcd_agent.backup.archive import parse_name
from etcd_agent.backup.retention import BackupRef, Decision, plan
from etcd_agent.bucket.client import CHECKS, Bucket, Refused, choose_check
from etcd_agent.bucket.digests import (
    MD5_ETAG_RE,
    Digests,
    b64,
    file_sha256,
    mismatches,
    part_size_for,
    same_checksum,
)
from etcd_agent.bucket.transfer import Progress, UploadParts, stream_object
from etcd_agent.config import Config
from etcd_agent.errors import BackupCorrupt, BackupError
from etcd_agent.fs import fsync_dir, open_regular

log = logging.getLogger(__name__)

# manifest fields copied into object metadata so a bucket listing tells what a copy holds
MANIFEST_META = ("revision", "member", "created", "etcd_version", "host")
# the largest object read from the bucket: etcd's backend quota tops out at 8 GiB (its own
# warning) and an archive is that db plus a few small files; a claim far above is not a copy of
# ours, and is refused before a byte is written
MAX_OBJECT_BYTES = 64 * 1024 * 1024 * 1024
# a listing stops here: ~3 years of hourly backups, or of segments of one chain (at most
# max_chain_segments, 1000 by default); more under one prefix is not this agent's layout
MAX_LISTED = 100_000
# the largest object one CopyObject takes (AWS's limit): above it the sha256 is computed first
MAX_SELF_COPY = 5 * 1024 * 1024 * 1024
# what a store that does not copy an object onto itself answers (400 InvalidRequest, 403 a policy
# without copies, 405, 501 NotImplemented); a 5xx, a timeout or a 412 is a failure, not a refusal
COPY_REFUSED = frozenset({400, 403, 405, 501})
# stores (Bucket.store) that refused such a copy: this process's uploads there take two passes
_NO_SELF_COPY: Set[Tuple[str, str, str]] = set()


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
    verified_by: str = ""  # after an upload: the check that ran (CHECKS)
    chain: str = ""  # the chain's key under chains/ ("" a legacy copy at the top of the prefix)
    # the master's folder it was found in, when the prefix holds {host} and a restore on a new
    # host looks through every master's ("" this host's own prefix)
    folder: str = ""

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
            **({"verified_by": self.verified_by} if self.verified_by else {}),
        }


# ---------------------------------------------------------------- public entry points


def upload_and_verify(cfg: Config, path: str, manifest: Mapping[str, Any]) -> RemoteObject:
    """Upload a finished archive, verify the copy, return it; a bad copy is deleted, BackupError raised."""
    name = os.path.basename(path)
    if parse_name(name) is None:
        raise BackupError(f"{name!r} is not a backup archive name (etcd-YYYY-MM-DD-HH-MM-SS.tar)")
    return upload_file(cfg, path, name, lambda sha: _metadata(sha, manifest))


def upload_file(cfg: Config, path: str, name: str,
                metadata: Callable[[str], Dict[str, str]] = lambda sha: {"sha256": sha}, *,
                sha256: Optional[str] = None, progress: Optional[Progress] = None) -> RemoteObject:
    """Upload ``path`` as ``name`` under the prefix (``name`` may hold one "/": delta segments go
    under ``delta-<revision>/``), verified as every copy is; ``metadata(sha256)`` names the object's
    metadata (it must keep ``sha256``). ``sha256``: the file's, when the caller hashed it already
    (the upload checks the bytes it sends against it); else the upload reads the file once and
    sets the sha256 afterwards (``_set_sha256``), or, where that cannot be, one hashing pass comes
    first. ``progress(done, total)`` after each part."""
    b = Bucket(cfg)
    started = time.monotonic()
    check = choose_check(b)
    one_pass = False
    try:
        size = os.path.getsize(path)
        part_size = part_size_for(b.section, size)
        with b.within(size):
            if size <= part_size:
                digests = _put_single(b, name, path, part_size, metadata, check, sha256)
            elif sha256 is None and not _two_passes(b, name, size):
                one_pass = True  # every field but the sha256 now, the sha256 once the bytes are checked
                fields = {k: v for k, v in metadata("").items() if k != "sha256"}
                digests = _put_file(b, name, path, size, part_size, None, fields, check, progress)
            else:
                want = sha256 or file_sha256(path)
                digests = _put_file(b, name, path, size, part_size, want, metadata(want), check, progress)
    except OSError as exc:
        raise BackupError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with b.within(size if check == "read-back" else 0):
        obj = _verify_upload(b, name, digests, check, sha_set=not one_pass)
    if one_pass:
        try:
            with b.within(size):  # a copy of the data on AWS; of the attributes only on Ceph RGW
                obj = _set_sha256(b, name, digests, obj, metadata(digests.sha256))
        except Refused as exc:
            _NO_SELF_COPY.add(b.store)
            log.warning("%s refused to set the sha256 metadata of %s by a copy onto itself (%s): sending it again "
                        "with it; later uploads there take two passes (the sha256 first, then the parts)",
                        b.endpoint_name(), b.where(name), exc)
            return upload_file(cfg, path, name, metadata, sha256=digests.sha256, progress=progress)
    log.info(
        "copied %s to %s (%d bytes in %d part%s, %.1fs, verified by %s%s)",
        name, b.where(name), digests.size, len(digests.parts), "s" if digests.multipart else "",
        time.monotonic() - started, CHECKS[obj.verified_by], "; sha256 set by a copy onto itself" if one_pass else "",
    )
    return obj


def list_names(cfg: Config, under: str) -> List[str]:
    """Object names (relative to the prefix) that start with ``under``."""
    b = Bucket(cfg)
    return [item["Key"][len(b.prefix):] for item in _pages(b, under, delimiter=False)]


def _pages(b: Bucket, under: str, *, delimiter: bool) -> List[Dict[str, Any]]:
    """The listed objects under the prefix: within one object's deadline, at most MAX_LISTED."""
    where = f"s3://{b.bucket}/{b.prefix}{under}"
    out: List[Dict[str, Any]] = []
    extra = {"Delimiter": "/"} if delimiter else {}
    with b.within(), b.errors(f"cannot list {where}"):
        for page in b.client.get_paginator("list_objects_v2").paginate(Bucket=b.bucket, Prefix=b.prefix + under,
                                                                        **extra):
            out += page.get("Contents", [])
            if len(out) > MAX_LISTED:
                raise BackupError(f"cannot list {where}: more than {MAX_LISTED} objects under it; "
                                  "is the prefix shared with something else?")
    return out


def list_objects(cfg: Config, under: str) -> List[Tuple[str, int, str]]:
    """(name relative to the prefix, size, ETag) of every object that starts with ``under``: one
    paginated listing, no metadata (the copy queue's view of the bucket)."""
    b = Bucket(cfg)
    return [(item["Key"][len(b.prefix):], int(item.get("Size", 0)), str(item.get("ETag", "")).strip('"'))
            for item in _pages(b, under, delimiter=False)]


def list_folders(cfg: Config, above: str) -> List[str]:
    """The folder names one level below ``above`` (a key prefix of the bucket, not of ours):
    one delimited listing, bounded like every listing."""
    b = Bucket(cfg)
    where = f"s3://{b.bucket}/{above}"
    out: List[str] = []
    with b.within(), b.errors(f"cannot list {where}"):
        for page in b.client.get_paginator("list_objects_v2").paginate(Bucket=b.bucket, Prefix=above, Delimiter="/"):
            out += [str(p.get("Prefix", ""))[len(above):].rstrip("/") for p in page.get("CommonPrefixes", [])]
            if len(out) > MAX_LISTED:
                raise BackupError(f"cannot list {where}: more than {MAX_LISTED} folders under it")
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
        with b.within(), b.errors(f"cannot delete {b.where(name)}"):
            b.client.delete_object(Bucket=b.bucket, Key=b.key(name))


def list_remote(cfg: Config) -> List[RemoteObject]:
    """The backup copies under the prefix, newest first (objects not named like backups are ignored)."""
    return _list(Bucket(cfg))


def list_remote_and_names(cfg: Config) -> Tuple[List[RemoteObject], List[str]]:
    """The backup copies (as ``list_remote``) and every object name under the prefix (their
    chains: ``offsite.chains_of``), from one listing."""
    return _listing(Bucket(cfg))


def _listing(b: Bucket) -> Tuple[List[RemoteObject], List[str]]:
    items = _pages(b, "", delimiter=False)
    return _list(b, items), [item["Key"][len(b.prefix):] for item in items]


def _list(b: Bucket, items: Optional[List[Dict[str, Any]]] = None) -> List[RemoteObject]:
    """Full backup copies: ``chains/<key>/<name>`` (``bucket.layout``) and the legacy ones at the
    top of the prefix; ``name`` is the backup's file name, ``chain`` its chain's key ("" legacy).
    One HEAD each: the sha256 and the manifest's fields (the revision) are the object's metadata,
    which a listing does not return. ``items``: the prefix's listing, when the caller made it."""
    from etcd_agent.bucket import layout

    out: List[RemoteObject] = []
    for item in _pages(b, "", delimiter=False) if items is None else items:
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
    objects, listed = _listing(b)  # one listing for the copies and their chains
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
                    with b.within(), b.errors(f"cannot delete {where}"):
                        b.client.delete_object(Bucket=b.bucket, Key=o.key)
                    log.info("deleted %s: %s", where, d.reason)
                except BackupError as exc:
                    failed.append(exc.message)
    from etcd_agent.bucket import offsite  # a copy and the delta chain that continues it go together

    keep = {d.name for d in decisions if d.keep}
    kept = [o for o in objects if o.name in keep]
    kept_revisions = {int(o.metadata["revision"]) for o in kept if str(o.metadata.get("revision", "")).isdigit()}
    try:
        decisions = decisions + offsite.prune_remote_chains(cfg, {o.chain for o in kept if o.chain}, kept_revisions,
                                                            dry_run=dry_run, listed=listed)
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
    obj = checkable(b, name)
    target = os.path.join(dest, name) if os.path.isdir(dest) else dest
    directory = os.path.dirname(os.path.abspath(target))
    try:
        free = shutil.disk_usage(directory).free
        if obj.size > free:  # said before a byte is written, not as ENOSPC halfway
            raise BackupError(f"{b.where(name)} holds {obj.size} bytes, more than the {free} free in {directory}")
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".part", dir=directory)
    except OSError as exc:
        raise BackupError(f"cannot write into {directory}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            size, sha = stream_object(b, obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        problems = mismatches(obj.size, obj.sha256 or "", size, sha)
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
    obj = checkable(b, name)
    size, sha = stream_object(b, obj, None)
    problems = mismatches(obj.size, obj.sha256 or "", size, sha)
    if problems:
        raise BackupCorrupt(f"{b.where(name)} does not match its checksum", details=problems)
    return obj


def checkable(b: Bucket, name: str) -> RemoteObject:
    """HEAD a copy about to be read: it carries its sha256, and claims a size we would read."""
    obj = _head(b, name)
    if obj.sha256 is None:
        raise BackupCorrupt(f"{b.where(name)} carries no sha256 metadata: it cannot be checked")
    if obj.size > MAX_OBJECT_BYTES:
        raise BackupCorrupt(f"{b.where(name)} claims {obj.size} bytes, more than any backup "
                            f"({MAX_OBJECT_BYTES} bytes): it is not read")
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


def _put_single(b: Bucket, name: str, path: str, part_size: int, metadata: Callable[[str], Dict[str, str]],
                check: str, sha256: Optional[str]) -> Digests:
    """A file of one part: read into memory once, hashed, sent in one PUT with its digests."""
    with open_regular(path) as fh:
        data = fh.read(part_size + 1)
    if len(data) > part_size:
        raise BackupCorrupt(f"{path} grew while it was copied: nothing was uploaded")
    whole = hashlib.sha256(data).hexdigest()
    if sha256 is not None and whole != sha256:
        raise BackupCorrupt(f"{path} changed while it was copied: its bytes hash to {whole}, not to the {sha256} "
                            "it was named by; nothing was uploaded")
    d = Digests(size=len(data), sha256=whole, part_size=part_size,
                parts=((hashlib.md5(data).digest(), hashlib.sha256(data).digest()),))
    checksum = check == "checksum"
    extra = {"ChecksumAlgorithm": "SHA256", "ChecksumSHA256": b64(d.parts[0][1])} if checksum else {}
    with b.errors(f"cannot upload {b.where(name)}"):
        # Content-MD5 always: cheap, and the one most stores enforce; the SHA-256 checksum when
        # the store was found to check it: the server refuses bytes changed in transit
        b.client.put_object(Bucket=b.bucket, Key=b.key(name), Body=data, ContentLength=d.size,
                            Metadata=metadata(whole), ContentMD5=b64(d.parts[0][0]), **extra)
    return d


def _two_passes(b: Bucket, name: str, size: int) -> bool:
    """True (and said) when the sha256 must be known before the upload: the object is larger than
    one copy takes, or the store refused a copy onto itself."""
    if size > MAX_SELF_COPY:
        why = f"it is {size} bytes, larger than the {MAX_SELF_COPY} bytes one server-side copy takes"
    elif b.store in _NO_SELF_COPY:
        why = f"{b.endpoint_name()} refused to copy an object onto itself"
    else:
        return False
    log.info("uploading %s in two passes (the sha256 first, then the parts): %s", b.where(name), why)
    return True


def _put_file(b: Bucket, name: str, path: str, size: int, part_size: int, sha256: Optional[str],
              meta: Dict[str, str], check: str, progress: Optional[Progress]) -> Digests:
    """A multipart upload, parts in parallel (``transfer.UploadParts``), aborted on any failure:
    each part carries its Content-MD5 (and its SHA-256 checksum when the store checks it), and
    the bytes sent must hash to ``sha256`` (the metadata), if given, or it never completes."""
    key = b.key(name)
    checksum = check == "checksum"
    extra = {"ChecksumAlgorithm": "SHA256"} if checksum else {}
    with b.errors(f"cannot start the upload of {b.where(name)}"):
        upload_id = b.client.create_multipart_upload(Bucket=b.bucket, Key=key, Metadata=meta, **extra)["UploadId"]
    try:
        sender = UploadParts(b, name, upload_id, checksum=checksum, progress=progress)
        d, done = sender.send(path, size, part_size, sha256)
        with b.errors(f"cannot complete the upload of {b.where(name)}"):
            b.client.complete_multipart_upload(
                Bucket=b.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
            )
    except BaseException:
        _abort(b, name, upload_id)
        raise
    return d


def _abort(b: Bucket, name: str, upload_id: str) -> None:
    """Leave no orphaned parts (they cost storage and never show in listings): best effort, and
    not tried against a gateway that just timed out (a second wait as long says nothing new)."""
    if b.hung:
        log.warning("the upload of %s was not aborted (the gateway did not answer); its parts stay until the "
                    "bucket's lifecycle rule for incomplete multipart uploads removes them", b.where(name))
        return
    try:
        with b.within():
            b.client.abort_multipart_upload(Bucket=b.bucket, Key=b.key(name), UploadId=upload_id)
    except Exception as exc:  # the original error matters more
        log.warning("could not abort the upload of %s: %s", b.where(name), b.scrub(str(exc)))


def _verify_upload(b: Bucket, name: str, d: Digests, check: str, *, sha_set: bool = True) -> RemoteObject:
    """Check the fresh copy (size, our sha256 metadata unless ``sha_set`` is False: it is set
    after this check, then the ``check``); delete it if bad. The returned object's
    ``verified_by`` names the check that ran: an ETag that is not an MD5 (SSE-KMS, SSE-C) falls
    back to a read-back, and is named so."""
    obj, checksum = _head_raw(b, name, checksum_mode=check == "checksum")
    problems = mismatches(d.size, d.sha256 if sha_set else "", obj.size,
                          (obj.sha256 or "(none)") if sha_set else "", sha_what="sha256 metadata")
    if not problems and check == "checksum":
        if checksum is None:
            problems.append("the store returned no x-amz-checksum-sha256, though it did when probed")
        elif not same_checksum(checksum, d):
            problems.append(f"x-amz-checksum-sha256 {checksum} != expected {d.checksum_sha256()}")
    elif not problems and check == "etag" and MD5_ETAG_RE.match(obj.etag):
        if obj.etag.lower() != d.md5_etag():
            problems.append(f"ETag {obj.etag} != expected {d.md5_etag()}")
    elif not problems:
        if check != "read-back":
            log.info("the ETag of %s is not an MD5 (server-side encryption?): verifying it by reading it back",
                     b.where(name))
        check = "read-back"
        size, sha = stream_object(b, obj, None)
        problems = mismatches(d.size, d.sha256, size, sha)
    if problems:
        _refuse(b, name, problems)
    return replace(obj, verified_by=check)


def _refuse(b: Bucket, name: str, problems: List[str]) -> None:
    """A copy that did not verify: deleted at once, BackupCorrupt raised."""
    try:
        with b.within(), b.errors(f"cannot delete the bad copy {b.where(name)}"):
            b.client.delete_object(Bucket=b.bucket, Key=b.key(name))
        gone = "deleted"
    except BackupError as exc:
        gone = f"NOT deleted ({exc.message})"
    raise BackupCorrupt(f"the copy at {b.where(name)} did not verify and was {gone}", details=problems)


def _set_sha256(b: Bucket, name: str, d: Digests, obj: RemoteObject, meta: Dict[str, str]) -> RemoteObject:
    """The verified object ``obj`` given its full metadata ``meta`` (the sha256 of the bytes sent,
    and the fields it carries already) by a copy of it onto itself, If-Match the ETag verified:
    only those bytes get the sha256. Then HEAD: its size, the sha256 and the ETag the copy gave
    (on Ceph RGW the same ETag: only the attributes are rewritten) or it is deleted. A failure
    leaves the object without a sha256: not a copy to anything that reads the bucket; a refusal
    (``COPY_REFUSED``) raises ``Refused``."""
    key = b.key(name)
    with b.errors(f"cannot set the sha256 metadata of {b.where(name)} (a copy onto itself; without it the object "
                  "is not taken as a copy)"), b.refused_as(COPY_REFUSED):
        res = b.client.copy_object(Bucket=b.bucket, Key=key, CopySource={"Bucket": b.bucket, "Key": key},
                                   CopySourceIfMatch=f'"{obj.etag}"', MetadataDirective="REPLACE", Metadata=meta)
    etag = str(res.get("CopyObjectResult", {}).get("ETag", "")).strip('"')
    after = _head(b, name)
    problems = mismatches(d.size, d.sha256, after.size, after.sha256 or "(none)", sha_what="sha256 metadata")
    if after.etag != etag:
        problems.append(f"ETag {after.etag} != {etag}, the copy's that set the sha256")
    if problems:
        _refuse(b, name, problems)
    return replace(after, verified_by=obj.verified_by)


def _head(b: Bucket, name: str) -> RemoteObject:
    return _head_raw(b, name, checksum_mode=False)[0]


def _head_raw(b: Bucket, name: str, *, checksum_mode: bool) -> Tuple[RemoteObject, Optional[str]]:
    """HEAD one object: the RemoteObject and the server's x-amz-checksum-sha256, if any."""
    extra = {"ChecksumMode": "ENABLED"} if checksum_mode else {}
    with b.within(), b.errors(f"cannot read {b.where(name)}"):
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


def _name_time(name: str, fallback: Optional[datetime]) -> datetime:
    parsed = parse_name(name)
    if parsed is not None:
        return parsed[0]
    if fallback is not None:
        return fallback.astimezone(timezone.utc).replace(tzinfo=None)
    return datetime.fromtimestamp(0)
