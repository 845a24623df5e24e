"""What a correct off-host copy shows: the local file's digests, and S3's checksum and ETag of it.

The upload's one pass over the archive (``transfer.UploadParts``) gives its size and SHA-256 and
each part's MD5 and SHA-256: what every upload request carries, so the server refuses a part whose
bytes changed, and what the finished object must report - ``x-amz-checksum-sha256`` (plain, or
composite for a multipart upload) or the MD5 ETag. Pure but for ``file_sha256``.
"""
from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from typing import List, Tuple

from etcd_agent.config import RemoteSection
from etcd_agent.fs import open_regular

MiB = 1024 * 1024
MAX_PARTS = 10000  # the S3 limit on parts per multipart upload
READ_CHUNK = MiB
MD5_ETAG_RE = re.compile(r"^[0-9a-fA-F]{32}(?:-\d+)?$")


@dataclass(frozen=True)
class Digests:
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
            return b64(self.parts[0][1])
        return f"{b64(hashlib.sha256(b''.join(s for _, s in self.parts)).digest())}-{len(self.parts)}"

    def md5_etag(self) -> str:
        """The ETag S3 computes without SSE-KMS/SSE-C: MD5, or MD5 of the part MD5s plus "-N"."""
        if not self.multipart:
            return self.parts[0][0].hex()
        return f"{hashlib.md5(b''.join(m for m, _ in self.parts)).hexdigest()}-{len(self.parts)}"


def part_size_for(r: RemoteSection, size: int) -> int:
    """The configured part size, raised when needed to stay within S3's 10,000 parts."""
    part = r.part_size_mb * MiB
    return max(part, -(-size // MAX_PARTS))


def file_sha256(path: str) -> str:
    """The SHA-256 of a local file, in one streamed pass."""
    whole = hashlib.sha256()
    with open_regular(path) as fh:
        for chunk in iter(lambda: fh.read(READ_CHUNK), b""):
            whole.update(chunk)
    return whole.hexdigest()


def same_checksum(server: str, d: Digests) -> bool:
    """Compare the server's checksum; servers differ on whether a composite one ends in "-N"."""
    want, _, count = d.checksum_sha256().partition("-")
    got, _, got_count = server.partition("-")
    return got == want and (not got_count or got_count == count)


def mismatches(want_size: int, want_sha: str, size: int, sha: str, *, sha_what: str = "sha256") -> List[str]:
    out = []
    if size != want_size:
        out.append(f"size {size} != expected {want_size}")
    if sha != want_sha:
        out.append(f"{sha_what} {sha} != expected {want_sha}")
    return out


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")
