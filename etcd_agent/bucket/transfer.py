"""The bytes of one object to and from the bucket, several requests at once, memory bounded.

An upload reads the archive once, in order: each part is hashed into the whole file's SHA-256
as it is read, then a worker computes the part's MD5 (and SHA-256 when the store checks it) and
sends it with those digests, while the next parts are read. The SHA-256 is what the object's
``sha256`` metadata names; a caller that passes the one it expects (named when the upload began)
has the bytes sent checked against it, or the upload is aborted before it completes. Either way
no object is made whose metadata was not computed from the very bytes it holds, and each part's
Content-MD5 (signed, checked by the store) ties what arrived to what was hashed. A file written
while it is read (its size, mtime or ctime moved) is refused too: its bytes would be a mix.

A download of a large object is split into ranges fetched at once (each If-Match the ETag the
HEAD gave, each exactly as long as asked); they are written and hashed strictly in order (a range
hashed by one thread while another writes it), so the output is always a prefix of the object (a
run killed halfway leaves a part that ``fetch`` can continue) and the hash is of the bytes as written.

An upload sends ``WORKERS`` parts at once and holds at most ``WORKERS`` + 1 in memory
(``buffer_parts``: 40 MiB with the default 8 MiB parts), a download ``RANGE_WORKERS`` ranges
(32 MiB), whatever the object's size.
``bench/bucket_bench.py`` measures both against boto3 and curl on the same server.
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Tuple

from etcd_agent.bucket.client import Bucket
from etcd_agent.bucket.digests import READ_CHUNK, Digests, b64
from etcd_agent.errors import BackupCorrupt, BackupError
from etcd_agent.fs import open_regular, start_writeback

if TYPE_CHECKING:  # pragma: no cover
    import http.client

    from etcd_agent.bucket.remote import RemoteObject

WORKERS = 4  # requests at once: enough to hide one request's latency on a 2-core master
BUFFER_BYTES = 64 * 1024 * 1024  # parts in flight at once fit in this (two at least, a large part_size_mb)
RANGE_BYTES = 8 * 1024 * 1024  # a ranged GET's length: boto3's own
# ranged GETs at once, 32 MiB in flight: a GET costs botocore ~2 ms of CPU whatever its length
# (0.56 CPU s a GiB in 4 MiB ranges), and on a 2-core machine shared with the store CPU is time;
# 4 x 8 MiB measured 0.3 CPU s a GiB less than 6 x 4 MiB at ~100 MB peak RSS (docs/bucket-speed.md)
RANGE_WORKERS = 4
# a download's writes: 16 KiB (curl's size) cost the kernel 0.4-1.2 CPU s a GiB of fresh page cache on
# the bench's VM, 1-4 MiB writes 1.5-2.3 s (its larger folios come from memory the host takes back)
WRITE_PIECE = 16 * 1024
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


def buffer_parts(part_size: int) -> int:
    """How many parts are sent at once: as many as fit the buffer, two at least, WORKERS at most."""
    return max(2, min(WORKERS, BUFFER_BYTES // max(part_size, 1)))


class _Stop(Exception):
    """Another request failed: this one gives up without a request of its own."""


class UploadParts:
    """One multipart upload's parts: read in order, sent ``buffer_parts`` at once."""

    def __init__(self, b: Bucket, name: str, upload_id: str, *, checksum: bool,
                 progress: Optional[Progress]) -> None:
        self.b, self.name, self.upload_id, self.checksum = b, name, upload_id, checksum
        self.progress = progress
        self.stop = threading.Event()
        self._mu = threading.Lock()
        self._sent = 0
        self._total = 0

    def send(self, path: str, size: int, part_size: int,
             sha256: Optional[str]) -> Tuple[Digests, List[Dict[str, Any]]]:
        """Every part of ``path`` sent; its Digests and the parts list CompleteMultipartUpload takes.
        BackupCorrupt when the bytes read are not ``size`` bytes (hashing to ``sha256``, if given),
        or the file was written while it was read.

        The parts are read into ``width`` + 1 buffers made once and reused (a part's buffer is
        free again once its request ended): fresh 16 MiB objects per part would leave glibc's
        heap holding freed ones, ~40 MB more at the peak than the buffers themselves."""
        count = max(1, -(-size // part_size))
        self._total = size
        whole = hashlib.sha256()
        sent: Dict[int, Tuple[bytes, bytes, str]] = {}  # part number -> its (md5, sha256, ETag)
        width = buffer_parts(part_size)
        free: Deque[bytearray] = collections.deque(bytearray(min(part_size, size)) for _ in range(width + 1))
        inflight: Dict["concurrent.futures.Future[Tuple[bytes, bytes, str]]", Tuple[int, bytearray]] = {}

        def settle() -> None:
            """Whichever requests ended: their buffers free, the first failure raised here. Not
            the oldest first: a request that ends late (a loaded gateway) would hold back the
            reading of the next part and leave the store fewer parts in flight."""
            done, _ = concurrent.futures.wait(inflight, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                number, buf = inflight.pop(future)
                sent[number] = future.result()
                free.append(buf)

        with concurrent.futures.ThreadPoolExecutor(width, thread_name_prefix="upload") as pool, \
                open_regular(path) as fh:
            try:
                before = _stamp(fh.fileno())
                for number in range(1, count + 1):
                    want = min(part_size, size - (number - 1) * part_size)
                    while not free:
                        settle()
                    buf = free.popleft()
                    body = buf if want == len(buf) else bytearray(want)  # the last part: shorter
                    got = fh.readinto(body)  # type: ignore[attr-defined]  # a BufferedReader
                    if got != want:
                        raise BackupCorrupt(f"{path} shrank while it was copied (part {number} of {count} is "
                                            f"{got} bytes, not {want}): the upload is aborted")
                    whole.update(body)
                    inflight[pool.submit(self._part, number, count, body)] = (number, buf)
                if fh.read(1):
                    raise BackupCorrupt(f"{path} grew while it was copied: the upload is aborted")
                if _stamp(fh.fileno()) != before:  # written meanwhile: what was read may be a mix
                    raise BackupCorrupt(f"{path} changed while it was copied (its size, mtime or ctime moved while "
                                        "it was read): the upload is aborted")
                while inflight:
                    settle()
            except BaseException:
                self.stop.set()
                raise
        got_sha = whole.hexdigest()
        if sha256 is not None and got_sha != sha256:
            raise BackupCorrupt(f"{path} changed while it was copied: its bytes hash to {got_sha}, not to the "
                                f"{sha256} it was named by; the upload is aborted")
        done: List[Dict[str, Any]] = []
        for number, (_md5, sha, etag) in sorted(sent.items()):
            part: Dict[str, Any] = {"PartNumber": number, "ETag": etag}
            if self.checksum:
                part["ChecksumSHA256"] = b64(sha)
            done.append(part)
        parts = tuple(sent[number][:2] for number in sorted(sent))
        return Digests(size=size, sha256=got_sha, part_size=part_size, parts=parts), done

    def _part(self, number: int, count: int, data: bytearray) -> Tuple[bytes, bytes, str]:
        if self.stop.is_set():
            raise _Stop()
        md5 = hashlib.md5(data).digest()
        sha = hashlib.sha256(data).digest() if self.checksum else b""
        b = self.b
        extra = {"ChecksumSHA256": b64(sha)} if self.checksum else {}
        with b.errors(f"cannot upload part {number}/{count} of {b.where(self.name)}"):
            resp = b.client.upload_part(Bucket=b.bucket, Key=b.key(self.name), UploadId=self.upload_id,
                                        PartNumber=number, Body=data, ContentMD5=b64(md5), **extra)
        with self._mu:  # parts end in any order: the count and its report only grow
            self._sent += len(data)
            if self.progress is not None:
                self.progress(self._sent, self._total)
        return md5, sha, str(resp["ETag"])


def _stamp(fd: int) -> Tuple[int, int, int]:
    """What a write to the file moves: its size, mtime and ctime (ctime cannot be set back)."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def get_ranges(b: Bucket, obj: Any, out: Any, offset: int, sha: "hashlib._Hash",
               progress: Optional[Progress]) -> int:
    """Bytes ``offset``..end of ``obj`` (a RemoteObject) by ranged GETs at once, written to ``out``
    (if given) and hashed into ``sha`` in order; returns the size reached (``obj.size``).

    Each range is read straight into one of ``RANGE_WORKERS`` buffers made once and reused (a
    buffer is free again once its range is both hashed and written), then written from it by
    this thread, to a file by ``os.pwrite`` behind ``out``'s buffer (no bytes object per chunk, no
    copy into a BufferedWriter), while one more thread hashes it: both let go of the GIL, so on
    two cores a range costs the longer of the two, not their sum. The next range is neither
    hashed nor written before both ended, so the order holds, and a failure of either fails the
    download after both ended (no thread left, no buffer still read). On a 2-core machine shared
    with the store the client's CPU is its time, and every copy of a GiB is ~0.1-0.3 CPU s
    (docs/bucket-speed.md)."""
    stop = threading.Event()
    what = f"cannot read {b.where(obj.name)}"

    def fetch(start: int, end: int, buf: bytearray) -> memoryview:
        if stop.is_set():
            raise _Stop()
        want = end - start
        view = memoryview(buf)[:want]
        extra = {"IfMatch": f'"{obj.etag}"'} if obj.etag else {}

        def tick() -> None:  # between two reads: another range failed, or the deadline passed
            if stop.is_set():
                raise _Stop()
            b.check_deadline(what)

        with b.errors(what):
            resp = b.client.get_object(Bucket=b.bucket, Key=obj.key, Range=f"bytes={start}-{end - 1}", **extra)
            body = resp["Body"]
            try:
                got = _read_into(body, view, tick)
            finally:
                body.close()
        if got > want:
            raise BackupCorrupt(f"{b.where(obj.name)} sent more than the {want} bytes asked from byte {start}")
        if got != want and resp.get("ContentLength") == want:
            # the answer promised every byte asked, and its connection ended first: a cut (a
            # gateway stopped, a link lost), not a shorter object; what was written stays a
            # prefix to continue
            raise BackupError(f"{b.where(obj.name)}: the connection ended after {got} of the {want} bytes "
                              f"asked from byte {start}")
        if got != want:  # a body that ended cleanly, short: the object is not the size HEAD claimed
            raise BackupCorrupt(f"{b.where(obj.name)} sent {got} bytes for the {want} asked from byte {start}: it is "
                                f"shorter than the {obj.size} bytes it claims; nothing of it kept")
        return view

    fd = _fileno(out)
    at = 0
    if fd is not None:
        out.flush()  # what the caller wrote through ``out`` lands before the ranges written behind it
        at = out.tell()
    size = offset
    free: Deque[bytearray] = collections.deque(
        bytearray(RANGE_BYTES) for _ in range(min(RANGE_WORKERS, -(-(obj.size - offset) // RANGE_BYTES))))
    inflight: Deque[Tuple["concurrent.futures.Future[memoryview]", bytearray]] = collections.deque()

    def settle(hasher: concurrent.futures.Executor) -> None:  # the oldest range hashed and written, its buffer free
        nonlocal size, at
        future, buf = inflight.popleft()
        view = future.result()
        if out is None:
            sha.update(view)  # nothing to write beside it
        else:
            hashed = hasher.submit(sha.update, view)
            try:
                if fd is not None:
                    _pwrite_all(fd, view, at)
                    start_writeback(fd, at, len(view))  # the caller's fsync has little left to wait for
                    at += len(view)
                else:
                    out.write(view)
            finally:  # a failed write leaves too: neither the buffer nor ``sha`` is touched while it hashes
                concurrent.futures.wait((hashed,))
            hashed.result()
        size += len(view)
        view.release()
        free.append(buf)
        if progress is not None:
            progress(size, obj.size)

    with concurrent.futures.ThreadPoolExecutor(RANGE_WORKERS, thread_name_prefix="download") as pool, \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="download-hash") as hasher:
        try:
            for start in range(offset, obj.size, RANGE_BYTES):
                while not free:
                    settle(hasher)
                buf = free.popleft()
                inflight.append((pool.submit(fetch, start, min(start + RANGE_BYTES, obj.size), buf), buf))
            while inflight:
                settle(hasher)
        except BaseException:
            stop.set()
            raise
        finally:
            if fd is not None:
                out.seek(at)  # ``out`` stands where the bytes written behind it end
    return size


def _pwrite_all(fd: int, view: memoryview, at: int) -> None:
    """``view`` written at ``at`` in pieces of ``WRITE_PIECE`` bytes."""
    done, end = 0, len(view)
    while done < end:
        done += os.pwrite(fd, view[done:done + WRITE_PIECE], at + done)


def _read_into(body: Any, view: memoryview, tick: Callable[[], None]) -> int:
    """Bytes of a GET's ``body`` (a botocore StreamingBody) read into ``view``; how many came,
    ``len(view)`` + 1 when the body runs on past it. ``tick`` runs before every read.

    The bytes come straight from the socket into ``view`` (``http.client``'s ``readinto``, under
    botocore's and urllib3's wrappers, which would hand out a fresh bytes object per read); the
    wrappers' failures are raised as they would have raised them (a read timeout as botocore's
    ReadTimeoutError, a cut connection as its ResponseStreamingError), and the connection goes
    back to urllib3's pool only after a body read to its clean end. A body the wrappers would
    change (a checksum checked on the way) or a wrapper of another shape is read through them."""
    import http.client

    from botocore.exceptions import ReadTimeoutError, ResponseStreamingError

    direct = _direct(body)
    if direct is None:
        return _read_through(body, view, tick)
    raw, fp = direct
    got, want = 0, len(view)
    try:
        while got < want:
            tick()
            n = fp.readinto(view[got:got + READ_CHUNK])
            if not n:
                return got  # short: the caller says so
            got += n
        if fp.readinto(bytearray(1)):
            return want + 1
    except TimeoutError as exc:
        raise ReadTimeoutError(endpoint_url=str(getattr(raw, "geturl", lambda: "")() or ""), error=exc) from exc
    except (http.client.HTTPException, OSError) as exc:
        raise ResponseStreamingError(error=exc) from exc
    raw.release_conn()  # read to its end: the connection serves the next range
    return got


def _direct(body: Any) -> Optional[Tuple[Any, "http.client.HTTPResponse"]]:
    """The urllib3 response under a botocore ``body`` and the ``http.client`` response under it,
    when nothing of it was read yet and nothing checks it on the way; None otherwise."""
    import http.client

    from botocore.response import StreamingBody

    if type(body) is not StreamingBody:  # a subclass checks a checksum as it reads
        return None
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse) or not hasattr(raw, "release_conn") or \
            getattr(raw, "_fp_bytes_read", None) != 0:
        return None
    return raw, fp


def _read_through(body: Any, view: memoryview, tick: Callable[[], None]) -> int:
    got, want = 0, len(view)
    for chunk in body.iter_chunks(READ_CHUNK):
        tick()
        if got + len(chunk) > want:
            return want + 1
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    return got


def _fileno(out: Any) -> Optional[int]:
    """The descriptor of a file ``out`` writes to (None: no output, or one in memory)."""
    try:
        return int(out.fileno()) if out is not None else None
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError
        return None


def stream_object(b: Bucket, obj: "RemoteObject", out: Any, *, offset: int = 0,
                  sha: "Optional[hashlib._Hash]" = None, progress: Optional[Progress] = None) -> Tuple[int, str]:
    """GET the object HEAD found (If-Match its ETag), hashing (and writing to ``out`` if given) in
    order, within its deadline; returns (size, sha256). Never more than the size HEAD gave is
    taken: a body that runs on is refused at the first byte too many. ``offset`` > 0 continues
    a partial copy (Range GETs from there), ``sha`` holding the digest of its first bytes. A large
    object comes as ranges fetched at once (``transfer.get_ranges``); ``progress(done, total)``."""
    sha = sha if sha is not None else hashlib.sha256()
    size = offset
    if offset >= obj.size:
        return size, sha.hexdigest()
    what = f"cannot read {b.where(obj.name)}"
    with b.within(obj.size - offset):
        if obj.size - offset >= 2 * RANGE_BYTES:
            return get_ranges(b, obj, out, offset, sha, progress), sha.hexdigest()
        with b.errors(what):
            extra = {"IfMatch": f'"{obj.etag}"'} if obj.etag else {}
            if offset:
                extra["Range"] = f"bytes={offset}-"
            body = b.client.get_object(Bucket=b.bucket, Key=obj.key, **extra)["Body"]
            try:
                for chunk in body.iter_chunks(READ_CHUNK):
                    size += len(chunk)
                    if size > obj.size:
                        raise BackupCorrupt(f"{b.where(obj.name)} sent more than the {obj.size} bytes it claims")
                    b.check_deadline(what)
                    sha.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    if progress is not None:
                        progress(size, obj.size)
            finally:
                body.close()
    return size, sha.hexdigest()
