"""`restore --from-bucket` under bad input and faults (issue 33 item 6), on the real RGW: the store
unreachable before and during a download, the agent killed mid-download, bytes that do not match
their sha256 metadata or carry none, hostile object names and a claimed 10 GiB, a chain in the
bucket with a missing, extra, swapped or forged segment, and the wrong --identity.

Each is refused in one sentence (the one ``etcd-agent: error:`` line, only its details after it)
before the member is touched (its data dir stays absent), with nothing outside the staging dir
(``<backup dir>/.fetch/``) and no credential in any output or in any file of the bed; a fault
keeps the staged part and the same command continues it.

One bed for the module (a one-member cluster whose daemon copied a ~3 MiB full backup and its
chain of >= 3 segments, then lost with its backup dir: ``world``); each test puts the bucket, the
config and the member back as they were (``fresh``) and breaks one thing. The agent reaches the
shared RGW through a test-side TCP proxy (``tests/harness/cutproxy.py``) that cuts, holds or
rewrites one header on demand: the shared radosgw itself is never stopped."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Tuple

import psutil
import pytest

from etcd_agent.bucket import client as remotebucket
from etcd_agent.bucket.digests import READ_CHUNK
from etcd_agent.chain import chains
from etcd_agent.chain.segments import Txn, parse_name
from tests.harness.cutproxy import CutProxy
from tests.harness.rgw import RgwBed, remote_table
from tests.integration.continuous import (
    agent,
    beds,
    dump,
    full_backups,
    put,
    rpc,
    segment_files,
    start_all,
    wait_durable,
    wait_for,
    wait_watching,
)
from tests.integration.test_bucket_queue import landed
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_restore import AGENT
from tests.integration.test_restore_from_bucket import _disaster, _tree, _written

pytestmark = pytest.mark.integration

BIG_KEYS = 24  # x 128 KiB of random bytes: a full backup of ~3.5 MiB, over 3 of the fetch's 1 MiB chunks
CUT = READ_CHUNK + READ_CHUNK // 2  # a fault 1.5 MiB into the full backup: one whole chunk staged before it
PLAIN = ("restore", "--from-bucket", "latest", "--yes")


@dataclass
class Lost:
    """A one-member cluster lost with its backup dir (``_disaster``) and the RGW its copies are in."""

    c: Any
    rgw: RgwBed

    @property
    def directory(self) -> str:
        return str(self.c.cfg.backup.dir)

    @property
    def data_dir(self) -> str:
        return str(self.c.cfg.data_dir(self.c.cfg.members[0].name))


@dataclass
class World(Lost):
    bucket: str
    prefix: str  # the expanded key prefix ("p/")
    proxy: CutProxy
    text: str  # the config as written (through the proxy)
    key: str  # the manifest key, kept off-host
    objects: Dict[str, Tuple[bytes, Dict[str, str]]]  # every object under the prefix: body, metadata
    full: str  # the newest full backup's file name (the one `latest` restores)
    chain: str  # its chain's key
    segs: List[str]  # its chain's segments, names under the prefix, in revision order
    big: Dict[str, bytes]  # what the full backup holds

    def name_of(self, file: str) -> str:
        return f"chains/{self.chain}/{file}"

    def put(self, name: str, body: bytes, meta: Dict[str, str]) -> None:
        self.rgw.client().put_object(Bucket=self.bucket, Key=self.prefix + name, Body=body, Metadata=meta)

    def span(self, seg: str) -> Tuple[int, int]:
        rng = parse_name(seg.rsplit("/", 1)[-1])
        assert rng is not None, seg
        return rng

    def end(self, seg: str) -> int:
        return self.span(seg)[1]


@pytest.fixture(scope="module")
def world(rgw: RgwBed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("faults")
    proxy = CutProxy(("127.0.0.1", rgw.port))
    bucket = rgw.new_bucket()  # before any test begins: kept for the module
    try:
        with beds(str(tmp), 1) as make:
            d = make(tables=remote_table(rgw, bucket, prefix="p/", keep_last=10, connect_timeout=2, read_timeout=20).replace(rgw.endpoint, proxy.endpoint))
            c = d.c
            start_all(d)
            first = wait_watching(c)
            r = rpc(c)
            big = {f"/big/{i:02d}": os.urandom(128 * 1024) for i in range(BIG_KEYS)}
            for k, v in big.items():
                put(r, k, v)
            made = agent(c, "backup")  # the full backup `latest` names; the daemon's chain moves onto it
            assert made.returncode == 0, made.stdout + made.stderr
            full = full_backups(c)[-1]
            # the batches below go into the new chain only once the watch moved onto it: written
            # before, the old watch closes a segment with them and the new chain's first segment
            # holds two batches (CI 45: two segments where three were asked)
            wait_for(lambda: chains.active_base(c.cfg.backup.dir) not in (None, first), 60, "the watch on the new chain")
            for batch in range(3):  # three closed segments at least
                wait_durable(c, _written(c, 4, f"/b{batch}/"))
            want = full_backups(c) + [os.path.basename(s) for s in segment_files(c)]
            wait_for(lambda: landed(rgw, bucket, want), 120, f"the {len(want)} files copied")
            key = _disaster(d, c, str(tmp / "offsite"))
            prefix = remotebucket.expand_prefix("p/", c.cfg.cluster.name)
            objects = _snapshot(rgw, bucket, prefix)
            chain = next(n.split("/")[1] for n in objects if n.endswith("/" + full))
            segs = sorted((n for n in objects if n.startswith(f"chains/{chain}/") and n.endswith(".seg")),
                          key=lambda n: parse_name(n.rsplit("/", 1)[-1]) or (0, 0))
            assert len(segs) >= 3, sorted(objects)
            with open(c.config_path) as fh:
                text = fh.read()
            yield World(c, rgw, bucket, prefix, proxy, text, key, objects, full, chain, segs, big)
    finally:
        proxy.close()


def _snapshot(rgw: RgwBed, bucket: str, prefix: str) -> Dict[str, Tuple[bytes, Dict[str, str]]]:
    s3 = rgw.client()
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            got = s3.get_object(Bucket=bucket, Key=o["Key"])
            out[o["Key"][len(prefix):]] = (got["Body"].read(), dict(got.get("Metadata") or {}))
    return out


def fresh(w: World) -> None:
    """The disaster as the module's bed left it: the bucket as the daemon copied it, the config as
    written, the proxy forwarding, no etcd, no data dir, no backup dir, no manifest key here."""
    from etcd_agent.backup.keys import key_path

    w.proxy.reset()
    with open(w.c.config_path, "w") as fh:
        fh.write(w.text)
    for lm in w.c.members:
        pid = lm.backend.pid()
        if pid and psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda p=pid: _gone(p), 30, f"etcd {pid} gone")
    shutil.rmtree(w.data_dir, ignore_errors=True)
    shutil.rmtree(w.directory, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(key_path(w.c.cfg))
    s3 = w.rgw.client()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=w.bucket, Prefix=w.prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=w.bucket, Delete={"Objects": keys, "Quiet": True})
    for name, (body, meta) in w.objects.items():
        w.put(name, body, meta)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def error_line(stderr: str) -> str:
    """The refusal: exactly one ``etcd-agent: error:`` line, nothing after it but its details."""
    lines = stderr.rstrip("\n").splitlines()
    at = [i for i, ln in enumerate(lines) if ln.startswith("etcd-agent: error: ")]
    assert len(at) == 1, stderr
    assert all(ln.startswith("  - ") for ln in lines[at[0] + 1:]), stderr
    return lines[at[0]]


def untouched(w: Lost) -> None:
    """The member not touched, and nothing in the backup dir but the (hidden) staging dir."""
    assert not os.path.exists(w.data_dir), "the member was touched"
    left = [n for n in (_tree(w.directory) if os.path.isdir(w.directory) else []) if not n.startswith(".")]
    assert not left, f"written outside the staging dir: {left}"


def no_credential(w: Lost, *outputs: str) -> None:
    """Neither half of the credentials in what the agent printed, nor in any file of the bed but
    the config that holds them (logs, state, journals, the backup dir, the data dir)."""
    secrets = [s for s in (w.rgw.secret_key, w.rgw.access_key) if s]
    for out in outputs:
        for s in secrets:
            assert s not in out, "a credential in the output"
    for root, _dirs, files in os.walk(w.c.dir):
        for n in files:
            path = os.path.join(root, n)
            if path == w.c.config_path or not os.path.isfile(path) or os.path.getsize(path) > 64 << 20:
                continue
            with open(path, "rb") as fh:
                data = fh.read()
            for s in secrets:
                assert s.encode() not in data, f"a credential in {path}"


def refused(w: Lost, res: "subprocess.CompletedProcess[str]", says: str, rc: int) -> str:
    assert res.returncode == rc, res.stdout + res.stderr
    line = error_line(res.stderr)
    assert says in line, res.stderr
    assert ".;" not in line, line  # one sentence, not a botocore sentence with ours glued on
    untouched(w)
    no_credential(w, res.stdout, res.stderr)
    print(f"\nrefused (exit {rc}): {line}")
    return line


def staged(w: Lost, file: str) -> str:
    return os.path.join(w.directory, ".fetch", file + ".part")


def restored(w: World, res: "subprocess.CompletedProcess[str]") -> None:
    """The restore ran and the member serves exactly what the full backup holds."""
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(w.c.cfg, 1, 60)
    got = {k: v[0] for k, v in dump(rpc(w.c), "/big/").items()}
    assert got == w.big, sorted(got)
    assert not os.path.exists(os.path.join(w.directory, ".fetch")), _tree(w.directory)
    no_credential(w, res.stdout, res.stderr)


def continued(w: World, kept: int) -> None:
    """The same command again: it continues the part at the bytes kept, and restores."""
    again = agent(w.c, *PLAIN, timeout=300)
    assert f"continued at byte {kept}" in again.stderr, again.stderr
    restored(w, again)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- the store lost, before and during


def test_the_store_unreachable_before_the_download_then_the_same_command_restores(world: World) -> None:
    w = world
    fresh(w)
    with open(w.c.config_path, "w") as fh:  # nothing listens there
        fh.write(w.text.replace(w.proxy.endpoint, f"http://127.0.0.1:{_free_port()}"))
    res = agent(w.c, *PLAIN, timeout=300)
    line = refused(w, res, "cannot list", rc=1)
    assert "nothing restored" in line or "Could not connect" in line, line
    with open(w.c.config_path, "w") as fh:
        fh.write(w.text)
    restored(w, agent(w.c, *PLAIN, timeout=300))


def test_a_connection_cut_mid_object_is_continued_by_the_same_command(world: World) -> None:
    w = world
    fresh(w)
    w.proxy.cut_after(CUT)
    res = agent(w.c, *PLAIN, timeout=300)
    assert w.proxy.fired.is_set(), "the proxy never cut: the full backup is smaller than the cut"
    line = refused(w, res, "the same command continues the fetch where it stopped", rc=1)
    assert f"s3://{w.bucket}/{w.prefix}{w.name_of(w.full)}" in line, line
    kept = os.path.getsize(staged(w, w.full))
    assert 0 < kept < CUT, kept
    continued(w, kept)


def test_the_agent_killed_mid_download_is_continued_by_the_same_command(world: World) -> None:
    w = world
    fresh(w)
    w.proxy.hold_after(CUT)  # the full backup's bytes stop 1.5 MiB in: the agent is downloading
    part = staged(w, w.full)
    p = subprocess.Popen([AGENT, "-c", w.c.config_path, *PLAIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        wait_for(lambda: w.proxy.fired.is_set() and os.path.exists(part) and os.path.getsize(part) >= READ_CHUNK,
                 120, "a part of the full backup staged")
        p.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        w.proxy.reset()
    assert p.returncode == -signal.SIGKILL
    untouched(w)
    no_credential(w, out, err)
    kept = os.path.getsize(part)
    continued(w, kept)


# ---------------------------------------------------------------- objects that cannot be trusted


def test_bytes_that_do_not_match_their_sha256_metadata_or_carry_none_are_refused(world: World) -> None:
    w = world
    fresh(w)
    body, meta = w.objects[w.name_of(w.full)]
    w.put(w.name_of(w.full), body, {**meta, "sha256": hashlib.sha256(b"other bytes").hexdigest()})
    refused(w, agent(w.c, *PLAIN), "failed its checksum on fetch: nothing of it kept", rc=1)
    assert not os.path.exists(staged(w, w.full)), "bytes that failed their checksum kept to be continued"

    fresh(w)
    seg = w.segs[-1]
    w.put(seg, w.objects[seg][0], {})
    line = refused(w, agent(w.c, "restore", "--from-bucket", "latest", "--to", "newest", "--key-file", w.key,
                            "--yes"), "carries no sha256 metadata: it cannot be checked", rc=1)
    assert seg in line and "nothing restored" in line, line


@pytest.mark.parametrize("hostile", ["{chain}/../etcd-delta-1-2-20260301T100000Z.seg",
                                     "{chain}//tmp/etcd-delta-1-2-20260301T100000Z.seg",
                                     "{chain}/checkpoints/../../../etcd-2026-03-01-10-00-00.tar"])
def test_a_hostile_object_name_refuses_the_restore_before_a_byte_is_fetched(world: World, hostile: str) -> None:
    w = world
    fresh(w)
    w.put("chains/" + hostile.format(chain=w.chain), b"x", {"sha256": hashlib.sha256(b"x").hexdigest()})
    res = agent(w.c, "restore", "--from-bucket", "latest", "--to", "newest", "--key-file", w.key, "--yes")
    refused(w, res, "is not a backup, a checkpoint or a segment of ours", rc=1)
    assert not os.path.isdir(w.directory) or not _tree(w.directory), _tree(w.directory)


def test_a_claimed_10_gib_object_is_refused(world: World) -> None:
    w = world
    fresh(w)
    claim = 10 * 1024 ** 3
    w.proxy.claim_size(w.name_of(w.full), claim)  # what HEAD says; the body is the real one
    dry = agent(w.c, "--json", "restore", "--from-bucket", "latest", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert json.loads(dry.stdout)["bucket"]["objects"][0]["size"] == claim, dry.stdout
    res = agent(w.c, *PLAIN, timeout=300)
    line = refused(w, res, w.name_of(w.full), rc=1)
    assert re.search(r"failed its checksum on fetch: nothing of it kept|more than the \d+ free|shorter than the \d+ bytes it "
                     r"claims; nothing of it kept", line), line
    assert str(claim) in res.stderr, res.stderr
    assert not os.path.exists(staged(w, w.full)), "bytes of a refused object kept"


# ---------------------------------------------------------------- a chain that is not what it was


def _pitr(w: World, *to: str) -> "subprocess.CompletedProcess[str]":
    return agent(w.c, "restore", "--from-bucket", "latest", *to, "--key-file", w.key, "--yes", timeout=300)


def test_a_missing_segment_refuses_a_target_beyond_the_gap(world: World) -> None:
    w = world
    fresh(w)
    w.rgw.client().delete_object(Bucket=w.bucket, Key=w.prefix + w.segs[1])
    refused(w, _pitr(w, "--to-revision", str(w.end(w.segs[-1]))), "cannot be reached from", rc=3)


@pytest.mark.parametrize("pair", [0, -2], ids=["first-two", "last-two"])
def test_two_segments_swapped_are_refused(world: World, pair: int) -> None:
    """Each segment under the other's name, with its own (right) sha256: the first two (the chain's
    idle first segment and the next share a start revision, so the walk by content still links them)
    or the last two (the walk stops where a name lies)."""
    w = world
    fresh(w)
    a, b = w.segs[pair], w.segs[pair + 1]
    for name, other in ((a, b), (b, a)):
        w.put(name, w.objects[other][0], w.objects[other][1])
    refused(w, _pitr(w, "--to-revision", str(w.end(w.segs[-1]))), "renamed, or swapped with another segment", rc=3)
    assert not os.path.exists(os.path.join(w.directory, ".fetch", a.rsplit("/", 1)[-1] + ".part")), \
        "segments refused for their content kept to be continued"


def _segment(w: World, tmp: str, name: str) -> Any:
    from etcd_agent.chain.reader import read_segment

    path = os.path.join(tmp, name.rsplit("/", 1)[-1])
    with open(path, "wb") as fh:
        fh.write(w.objects[name][0])
    return read_segment(path)


def _holding(w: World) -> str:
    """The newest segment of the chain that holds revisions (an idle one holds none)."""
    held = [n for n in w.segs if w.span(n)[1] >= w.span(n)[0]]
    assert held, w.segs
    return held[-1]


def _write(tmp: str, header: Any, txns: Any, footer: Any, sign_key: bytes) -> bytes:
    """A segment written by the product's own writer (its digest and sha256 right), its bytes."""
    from etcd_agent.chain.writer import SegmentWriter

    out = tempfile.mkdtemp(dir=tmp)
    sw = SegmentWriter(out, header, sign_key=sign_key)
    for t in txns:
        sw.add_txn(t)
    info = sw.close(footer.end_time_ms, confirmed=footer.confirmed, checkpoints=footer.checkpoints)
    with open(info.path, "rb") as fh:
        return fh.read()


def test_an_extra_segment_of_another_cluster_is_not_replayed(world: World, tmp_path: Any) -> None:
    w = world
    fresh(w)
    last = _segment(w, str(tmp_path), w.segs[-1])
    h, f = last.info.header, last.info.footer
    ev = _segment(w, str(tmp_path), _holding(w)).txns[-1].events[0]
    # another cluster's chain, signed with its own key, named to continue this one's
    header = dataclasses.replace(h, chain_id="f" * len(h.chain_id), seq=h.seq + 1, start_revision=f.end_revision + 1,
                                 prev_sha256=last.info.sha256, start_time_ms=f.end_time_ms)
    txn = Txn(revision=f.end_revision + 1, time_ms=f.end_time_ms + 1, events=(
        dataclasses.replace(ev, key=b"/extra", value=b"not this cluster's", mod_revision=f.end_revision + 1),))
    footer = dataclasses.replace(f, end_revision=f.end_revision + 1, end_time_ms=f.end_time_ms + 1, checkpoints=())
    body = _write(str(tmp_path), header, [txn], footer, os.urandom(32))
    from etcd_agent.chain.segments import segment_name

    name = w.name_of(segment_name(f.end_revision + 1, f.end_revision + 1, f.end_time_ms + 1))
    w.put(name, body, {"sha256": hashlib.sha256(body).hexdigest()})
    for to in (("--to-revision", str(f.end_revision + 1)), ("--to", "newest")):
        line = refused(w, _pitr(w, *to), "cannot be reached from", rc=3)
        assert "a forged tail" in line, line


def test_a_forged_segment_refuses_to_newest(world: World, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from etcd_agent.chain import sign as segsign

    w = world
    fresh(w)
    name = _holding(w)
    last = _segment(w, str(tmp_path), name)
    h, f = last.info.header, last.info.footer
    assert f.signature is not None, "the daemon signs its segments"
    t = last.txns[-1]
    forged = [*last.txns[:-1], dataclasses.replace(t, events=(dataclasses.replace(t.events[0], value=b"forged"),
                                                                *t.events[1:]))]
    # the bytes changed, the digest and sha256 recomputed by the writer, the signature copied
    monkeypatch.setattr(segsign, "sign", lambda footer, key, before: footer.with_signature(f.signature))
    body = _write(str(tmp_path), h, forged, f, b"k" * 32)
    monkeypatch.undo()
    assert body != w.objects[name][0]
    w.put(name, body, {**w.objects[name][1], "sha256": hashlib.sha256(body).hexdigest()})
    line = refused(w, _pitr(w, "--to", "newest"), "newest cannot be reached from", rc=3)
    assert "its footer does not match its signature" in line, line  # never cut off silently


# ---------------------------------------------------------------- the wrong identity


def test_the_wrong_identity_is_refused_and_the_staged_backup_kept(rgw: RgwBed, tmp_path: Any) -> None:
    from tests.integration.test_backup_age import keypair

    right, recipient = keypair(tmp_path, "right.txt")
    wrong, _ = keypair(tmp_path, "wrong.txt")
    bucket = rgw.new_bucket()
    with beds(str(tmp_path / "enc"), 1) as make:
        d = make(backup=f'encrypt_to = ["{recipient}"]\n', tables=remote_table(rgw, bucket, prefix="p/", keep_last=10, connect_timeout=2, read_timeout=20))
        c = d.c
        c.start_static()
        made = agent(c, "backup")
        assert made.returncode == 0, made.stdout + made.stderr
        name = full_backups(c)[-1]
        assert landed(rgw, bucket, [name])
        _disaster(d, c, str(tmp_path / "offsite"))
        w = Lost(c, rgw)
        res = agent(c, "restore", "--from-bucket", "latest", "--identity", wrong, "--yes", timeout=300)
        line = refused(w, res, f"identity file {wrong} opens it", rc=3)
        assert "the same command with the right --identity does not fetch them again" in line, line
        assert line.startswith(f"etcd-agent: error: {name}: ") and "/checked/" not in line, line  # no path that is gone
        part = staged(w, name)
        size = os.path.getsize(part)
        assert size == rgw.client().head_object(Bucket=bucket, Key=f"p/chains/{_chain_of(rgw, bucket, name)}/{name}"
                                                )["ContentLength"], "the staged backup was not kept whole"
        again = agent(c, "--json", "restore", "--from-bucket", "latest", "--identity", right, "--yes", timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        fetched = json.loads(again.stdout)["bucket"]
        assert fetched["bytes_read"] == 0 and [o["how"] for o in fetched["objects"]] == ["resumed"], fetched
        wait_healthy(c.cfg, 1, 60)
        no_credential(w, again.stdout, again.stderr)


def _chain_of(rgw: RgwBed, bucket: str, name: str) -> str:
    for o in rgw.client().list_objects_v2(Bucket=bucket, Prefix="p/chains/")["Contents"]:
        if o["Key"].endswith("/" + name):
            return str(o["Key"].split("/")[2])
    raise AssertionError(f"{name} not in the bucket")
