"""etcd/snapdb against real etcd snapshots: 3.4.23 (/usr/bin), 3.5.16 and 3.5.30 (/opt/etcd/<v>).

Every etcd runs on 127.0.0.1 with ports drawn at random by tests/harness/loopback.py (below the kernel's
ephemeral range, so no outgoing connection takes them between the pick and etcd's bind) and is
stopped by PID at the end of its test.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import pytest

from etcd_agent.etcd import bbolt, proto, snapdb
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.etcd.snapdb import SnapshotFormatError, SnapshotIdentity
from tests.harness.loopback import free_port_pairs

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- etcd releases -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Release:
    version: str
    etcd: str
    etcdctl: str
    etcdutl: Optional[str]  # 3.4 has none: etcdctl does snapshot status/restore

    @property
    def minor(self) -> Tuple[int, int]:
        a, b, _ = self.version.split(".")
        return int(a), int(b)

    @property
    def patch(self) -> Tuple[int, int, int]:
        a, b, c = self.version.split(".")
        return int(a), int(b), int(c)

    @property
    def backend_updates_members(self) -> bool:
        """Whether a member's backend entry is rewritten on attribute publish / promotion.
        3.5.1-3.5.19 refuse to overwrite an existing key (store.go unsafeSaveMemberToBackend,
        fixed by "overwrite the member if already exist", first in 3.5.20)."""
        return self.minor == (3, 4) or self.patch >= (3, 5, 20)


RELEASES = [
    Release("3.4.23", "/usr/bin/etcd", "/usr/bin/etcdctl", None),
    Release("3.5.16", "/opt/etcd/3.5.16/etcd", "/opt/etcd/3.5.16/etcdctl", "/opt/etcd/3.5.16/etcdutl"),
    Release("3.5.30", "/opt/etcd/3.5.30/etcd", "/opt/etcd/3.5.30/etcdctl", "/opt/etcd/3.5.30/etcdutl"),
]
ALL = [
    pytest.param(r, id=r.version, marks=pytest.mark.skipif(not os.access(r.etcd, os.X_OK), reason=f"no {r.etcd}"))
    for r in RELEASES
]
NEWEST = RELEASES[-1]


# --- ports and processes -------------------------------------------------------------------------
_taken: Set[int] = set()


def port_pair() -> Tuple[int, int]:
    """A (client, peer) pair free right now and not handed out before in this run."""
    while True:
        (c, p), = free_port_pairs(1)
        if c not in _taken:
            _taken.update((c, p))
            return c, p


class Node:
    """One etcd process."""

    def __init__(self, rel: Release, base: str, name: str) -> None:
        self.rel, self.name = rel, name
        self.client_port, self.peer_port = port_pair()
        self.client_url = f"http://127.0.0.1:{self.client_port}"
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.data_dir = os.path.join(base, f"{name}.etcd")
        self.log_path = os.path.join(base, f"{name}.log")
        self.proc: Optional["subprocess.Popen[bytes]"] = None

    def start(self, initial_cluster: str, token: str, state: str = "new") -> None:
        args = [
            self.rel.etcd,
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-token", token,
            "--initial-cluster-state", state,
            # membership changes at once: strict, etcd refuses each one until every peer has been
            # connected 5 s (~10 s of retries per release in the membership test); what the db
            # holds after a change is the same either way
            "--strict-reconfig-check=false",
        ]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def wait_up(self, timeout: float = 40.0, healthy: bool = True) -> None:
        """Until /health says true (or, for a learner, /version answers)."""
        deadline = time.monotonic() + timeout
        path = "/health" if healthy else "/version"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"etcd {self.name} exited {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.client_url + path, timeout=2) as resp:
                    body = json.loads(resp.read())
                if not healthy or body.get("health") == "true":
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"etcd {self.name} not up after {timeout}s: {self.log_tail()}")

    def log_tail(self) -> str:
        with open(self.log_path, "rb") as fh:
            return fh.read()[-1500:].decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    @property
    def db(self) -> str:
        return os.path.join(self.data_dir, "member", "snap", "db")

    # client calls
    def ctl(self, *args: str, check: bool = True) -> str:
        env = dict(os.environ, ETCDCTL_API="3")
        out = subprocess.run(
            [self.rel.etcdctl, "--endpoints", self.client_url, "--command-timeout=15s", *args],
            capture_output=True, text=True, env=env, timeout=60,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"etcdctl {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    def ctl_retry(self, *args: str, timeout: float = 40.0) -> str:
        """A membership change: etcd refuses them ("unhealthy cluster", "not in sync") until the
        peers have been connected a few seconds, so retry."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.ctl(*args)
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def ctl_json(self, *args: str) -> Any:
        return json.loads(self.ctl(*args, "-w", "json"))

    def put_many(self, items: Sequence[Tuple[bytes, bytes]], batch: int = 100) -> None:
        """Multi-put transactions over gRPC (the JSON gateway took base64 and an HTTP request each)."""
        with EtcdRpc(self.client_url, timeout=30.0) as r:
            for i in range(0, len(items), batch):
                r.txn([proto.op_put(k, v) for k, v in items[i : i + batch]])

    def snapshot(self, path: str) -> str:
        self.ctl("snapshot", "save", path)
        return path

    def status(self) -> Dict[str, Any]:
        st = self.ctl_json("endpoint", "status")[0]["Status"]
        assert isinstance(st, dict)
        return st


class Cluster:
    def __init__(self, rel: Release, base: str, names: Sequence[str], token: str) -> None:
        self.rel, self.base, self.token = rel, base, token
        self.nodes = [Node(rel, base, n) for n in names]

    def initial(self, nodes: Optional[Sequence[Node]] = None) -> str:
        return ",".join(f"{n.name}={n.peer_url}" for n in (nodes if nodes is not None else self.nodes))

    def start(self) -> None:
        ic = self.initial()
        for n in self.nodes:
            n.start(ic, self.token)
        for n in self.nodes:
            n.wait_up()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


@contextmanager
def cluster(rel: Release, base: str, n: int = 1, token: str = "tok-a", start: bool = True) -> Iterator[Cluster]:
    c = Cluster(rel, base, [f"m{i + 1}" for i in range(n)], token)
    try:
        if start:
            c.start()
        yield c
    finally:
        c.stop()


def snapshot_status(rel: Release, path: str) -> Dict[str, Any]:
    """``snapshot status -w json`` by the release's own tool, on a copy (3.4 and 3.5.16 open the
    file read-write)."""
    cp = path + ".status-copy"
    shutil.copyfile(path, cp)
    try:
        tool = [rel.etcdutl] if rel.etcdutl else [rel.etcdctl]
        out = subprocess.run([*tool, "snapshot", "status", cp, "-w", "json"], capture_output=True, text=True,
                             env=dict(os.environ, ETCDCTL_API="3"), timeout=120)
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        assert isinstance(st, dict)
        return st
    finally:
        os.unlink(cp)


def restore(rel: Release, snap: str, node: Node, initial_cluster: str, token: str) -> None:
    tool = [rel.etcdutl] if rel.etcdutl else [rel.etcdctl]
    out = subprocess.run(
        [*tool, "snapshot", "restore", snap, "--name", node.name, "--data-dir", node.data_dir,
         "--initial-cluster", initial_cluster, "--initial-cluster-token", token,
         "--initial-advertise-peer-urls", node.peer_url],
        capture_output=True, text=True, env=dict(os.environ, ETCDCTL_API="3"), timeout=120,
    )
    assert out.returncode == 0, out.stderr


# --- common checks -------------------------------------------------------------------------------
def check_against_etcd(rel: Release, ident: SnapshotIdentity, snap: str, node: Node) -> None:
    """What etcd's own tools say of the same snapshot and cluster."""
    st = snapshot_status(rel, snap)
    assert ident.revision == st["revision"]
    assert ident.total_entries == st["totalKey"]
    assert ident.high_water * ident.page_size == st["totalSize"]
    assert ident.has_trailer
    assert snapdb.read_identity(snap, verify_trailer=True).trailer_verified
    assert ident.cluster_version == f"{rel.minor[0]}.{rel.minor[1]}.0"
    listed = node.ctl_json("member", "list")
    by_id = {m["ID"]: m for m in listed["members"]}
    assert set(ident.member_ids) == set(by_id)
    for m in ident.members:
        want = by_id[m.id]
        assert list(m.peer_urls) == want["peerURLs"]
        if rel.backend_updates_members:
            assert m.name == want.get("name", "")
            assert list(m.client_urls) == want.get("clientURLs", [])
            assert m.is_learner == want.get("isLearner", False)
        else:
            # 3.5.1-3.5.19: the entry keeps what AddMember wrote (attributes never land)
            assert m.client_urls == ()
    if rel.minor >= (3, 5):
        assert ident.term is not None and ident.term >= 1
        assert ident.conf_state is not None
        voters = {m.id for m in ident.members if not m.is_learner}
        assert set(ident.conf_state.voters) | set(ident.conf_state.learners) == set(ident.member_ids)
        if rel.backend_updates_members:
            assert set(ident.conf_state.voters) == voters
    else:
        assert ident.term is None and ident.conf_state is None  # 3.4 stores neither
    if rel.minor >= (3, 5) or ident.revision:
        assert ident.consistent_index is not None and ident.consistent_index > 0
    else:
        # 3.4 writes consistent_index with the first MVCC txn: a fresh member's meta is empty
        assert ident.consistent_index is None


def cluster_id_of(node: Node) -> int:
    return int(node.status()["header"]["cluster_id"])


def member_id_of(node: Node) -> int:
    return int(node.status()["header"]["member_id"])


# --- tests: real snapshots -----------------------------------------------------------------------
@pytest.mark.parametrize("rel", ALL)
def test_single_member(rel: Release, tmp_path: Any) -> None:
    with cluster(rel, str(tmp_path), 1, token="tok-single") as c:
        n = c.nodes[0]
        n.put_many([(b"k%d" % i, b"v%d" % i) for i in range(50)])
        snap = n.snapshot(str(tmp_path / "s.db"))
        ident = snapdb.read_identity(snap, count_entries=True, verify_trailer=True)
        check_against_etcd(rel, ident, snap, n)
        (m,) = ident.members
        assert m.name == "m1" and m.peer_urls == (n.peer_url,)
        # bootstrap id = sha1(peer URLs + token); cluster id = sha1(member ids)
        assert m.id == member_id_of(n) == snapdb.member_id_from([n.peer_url], "tok-single")
        assert m.is_bootstrap_member_of("tok-single") and not m.is_bootstrap_member_of("tok-other")
        assert ident.computed_cluster_id == cluster_id_of(n)
        assert ident.removed_member_ids == ()
        # one txn of 50 puts: revision 2, sub-revisions 0..49
        assert ident.key_revisions == 50 and ident.last_revision == snapdb.Revision(2, 49)
        assert ident.first_revision == snapdb.Revision(2, 0)
        assert ident.compact_revision == 0 and ident.finished_compact_revision is None
        # the same bytes through the in-memory entry point
        with open(snap, "rb") as fh:
            assert snapdb.identity_from_bytes(fh.read(), count_entries=True, verify_trailer=True) == ident


@pytest.mark.parametrize("rel", ALL)
def test_empty_keyspace(rel: Release, tmp_path: Any) -> None:
    with cluster(rel, str(tmp_path), 1) as c:
        snap = c.nodes[0].snapshot(str(tmp_path / "empty.db"))
        ident = snapdb.read_identity(snap, count_entries=True)
        check_against_etcd(rel, ident, snap, c.nodes[0])
        assert ident.last_revision is None and ident.first_revision is None
        assert ident.revision == 0 and ident.key_revisions == 0


@pytest.mark.parametrize("rel", ALL)
def test_static_three_members(rel: Release, tmp_path: Any) -> None:
    with cluster(rel, str(tmp_path), 3, token="tok-three") as c:
        c.nodes[0].put_many([(b"a/%05d" % i, b"x" * 300) for i in range(3000)])  # a few branch pages
        c.nodes[1].ctl("put", "last", "one")
        snap = c.nodes[2].snapshot(str(tmp_path / "s3.db"))
        ident = snapdb.read_identity(snap, count_entries=True, verify_trailer=True)
        check_against_etcd(rel, ident, snap, c.nodes[0])
        for n in c.nodes:
            assert snapdb.member_id_from([n.peer_url], "tok-three") in ident.member_ids
        assert ident.computed_cluster_id == cluster_id_of(c.nodes[0])
        assert ident.key_revisions == 3001 and ident.revision == 32  # 30 txns of 100, one put
        # the three members' own db files (stopped) agree on who they are
        c.stop()
        for n in c.nodes:
            own = snapdb.read_identity(n.db)
            assert not own.has_trailer and own.member_ids == ident.member_ids
            assert own.revision == ident.revision


@pytest.mark.parametrize("rel", ALL)
def test_compaction(rel: Release, tmp_path: Any) -> None:
    with cluster(rel, str(tmp_path), 1) as c:
        n = c.nodes[0]
        for round_ in range(5):  # one revision per put: 2..201
            n.put_many([(b"same/%d" % i, b"r%d" % round_) for i in range(40)], batch=1)
        rev = int(n.status()["header"]["revision"])
        assert rev == 201
        n.ctl("compact", str(rev - 10), "--physical")
        snap = n.snapshot(str(tmp_path / "c.db"))
        ident = snapdb.read_identity(snap, count_entries=True)
        check_against_etcd(rel, ident, snap, n)
        assert ident.finished_compact_revision == rev - 10
        assert ident.scheduled_compact_revision == rev - 10
        assert ident.compact_revision == rev - 10
        assert ident.revision == rev
        # compaction keeps each key's newest revision <= 191 (40 entries) and all after (10):
        # the oldest kept is key 30's put of round 4 (revisions 122..161)
        assert ident.key_revisions == 50
        assert ident.first_revision == snapdb.Revision(152, 0)


@pytest.mark.parametrize("rel", ALL)
def test_member_removed_added_and_learner(rel: Release, tmp_path: Any) -> None:
    base = str(tmp_path)
    with cluster(rel, base, 3, token="tok-change") as c:
        m1, m2, m3 = c.nodes
        original_cid = cluster_id_of(m1)
        m1.ctl("put", "before", "change")
        gone = member_id_of(m3)
        m1.ctl_retry("member", "remove", format(gone, "x"))
        m3.stop()
        m1.wait_up()  # /health: true once a leader is back (m3 may have been it)
        # a runtime-added member: id = sha1(peer URLs + "" + unix seconds of the add)
        m4 = Node(rel, base, "m4")
        c.nodes.append(m4)
        t0 = int(time.time())
        m1.ctl_retry("member", "add", "m4", f"--peer-urls={m4.peer_url}")
        t1 = int(time.time())
        m4.start(c.initial([m1, m2, m4]), "tok-change", state="existing")
        m4.wait_up()
        # a learner
        m5 = Node(rel, base, "m5")
        c.nodes.append(m5)
        m1.ctl_retry("member", "add", "m5", f"--peer-urls={m5.peer_url}", "--learner")
        m5.start(c.initial([m1, m2, m4, m5]), "tok-change", state="existing")
        m5.wait_up(healthy=False)
        deadline = time.monotonic() + 30
        while not any(m.get("name") == "m5" for m in m1.ctl_json("member", "list")["members"]):
            assert time.monotonic() < deadline, "learner never published its name"
            time.sleep(0.3)
        m1.ctl_retry("put", "after", "change")

        snap = m1.snapshot(os.path.join(base, "changed.db"))
        ident = snapdb.read_identity(snap, count_entries=True, verify_trailer=True)
        check_against_etcd(rel, ident, snap, m1)
        assert ident.removed_member_ids == (gone,)
        assert gone not in ident.member_ids
        by_name = {m.peer_urls[0]: m for m in ident.members}
        new, learner = by_name[m4.peer_url], by_name[m5.peer_url]
        assert learner.is_learner and not new.is_learner
        if rel.minor >= (3, 5):
            assert ident.conf_state is not None and ident.conf_state.learners == (learner.id,)
        assert not new.is_bootstrap_member_of("tok-change")
        assert any(snapdb.member_id_from([m4.peer_url], "", t) == new.id for t in range(t0 - 1, t1 + 2))
        for old in (m1, m2):
            assert by_name[old.peer_url].is_bootstrap_member_of("tok-change")
        # the cluster id no longer follows from the members: only the WAL knows it
        assert cluster_id_of(m1) == original_cid != ident.computed_cluster_id

        # promotion: the raft conf state follows; the members bucket only where entries are rewritten
        m1.ctl_retry("member", "promote", format(learner.id, "x"))
        m1.ctl("put", "after", "promote")
        snap2 = m1.snapshot(os.path.join(base, "promoted.db"))
        ident2 = snapdb.read_identity(snap2, count_entries=True)
        after = {m.id: m for m in ident2.members}[learner.id]
        assert after.is_learner is (not rel.backend_updates_members)
        if rel.minor >= (3, 5):
            assert ident2.conf_state is not None and ident2.conf_state.learners == ()
            assert learner.id in ident2.conf_state.voters
        assert ident2.revision == ident.revision + 1


@pytest.mark.parametrize("rel", ALL)
def test_restore_rewrites_membership(rel: Release, tmp_path: Any) -> None:
    """What ``snapshot restore --name X --initial-cluster ... --initial-cluster-token T`` leaves in
    the db, before and after etcd starts on it."""
    base = str(tmp_path)
    with cluster(rel, base, 3, token="tok-orig") as c:
        c.nodes[0].put_many([(b"r/%d" % i, b"v") for i in range(20)])
        gone = member_id_of(c.nodes[2])
        c.nodes[0].ctl_retry("member", "remove", format(gone, "x"))
        c.nodes[2].stop()
        c.nodes[0].wait_up()  # a new leader may be being elected
        c.nodes[0].ctl_retry("put", "r/last", "v")
        snap = c.nodes[0].snapshot(os.path.join(base, "orig.db"))
        orig = snapdb.read_identity(snap)
        orig_cid = cluster_id_of(c.nodes[0])
    assert orig.removed_member_ids == (gone,) and len(orig.members) == 2

    # restore into a new 2-member cluster with another token and other peer URLs
    x, y = Node(rel, base, "x"), Node(rel, base, "y")
    ic = f"x={x.peer_url},y={y.peer_url}"
    restore(rel, snap, x, ic, "tok-new")
    restore(rel, snap, y, ic, "tok-new")
    want_ids = sorted(snapdb.member_id_from([n.peer_url], "tok-new") for n in (x, y))
    fresh = snapdb.read_identity(x.db, count_entries=True)
    assert not fresh.has_trailer
    assert fresh.revision == orig.revision  # the keyspace is kept as it was
    assert fresh.cluster_version == orig.cluster_version  # the cluster bucket is kept too
    if rel.minor >= (3, 5):
        # etcdutl: TrimMembershipFromBackend, then AddMember of the new members (name, peer URLs)
        assert list(fresh.member_ids) == want_ids
        assert {m.name for m in fresh.members} == {"x", "y"}
        assert all(m.client_urls == () for m in fresh.members)
        assert fresh.removed_member_ids == ()
        # consistent index = number of members (the WAL's conf-change entries), term 1
        assert fresh.consistent_index == 2 and fresh.term == 1
        # the conf state is NOT rewritten: still the snapshot's
        assert fresh.conf_state == orig.conf_state
    else:
        # etcdctl 3.4 "deletes" the members through an MVCC DeleteRange of their ids in the
        # keyspace: the members bucket is left as it was in the snapshot
        assert fresh.member_ids == orig.member_ids
        assert fresh.removed_member_ids == orig.removed_member_ids
        assert fresh.consistent_index == 2

    try:
        x.start(ic, "tok-new")
        y.start(ic, "tok-new")
        x.wait_up()
        y.wait_up()
        x.ctl("put", "r/after-restore", "v")
        cid = cluster_id_of(x)
        assert cid == snapdb.cluster_id_from(want_ids) != orig_cid
        assert member_id_of(x) in want_ids
    finally:
        x.stop()
        y.stop()
    started = snapdb.read_identity(x.db, count_entries=True)
    assert started.revision == orig.revision + 1
    new_members = {m.id: m for m in started.members if m.id in want_ids}
    assert sorted(new_members) == want_ids
    if rel.minor >= (3, 5):
        assert list(started.member_ids) == want_ids
        assert started.computed_cluster_id == cid
        assert started.removed_member_ids == ()
        for m in new_members.values():
            assert m.client_urls == (() if not rel.backend_updates_members else
                                     ((x.client_url,) if m.name == "x" else (y.client_url,)))
        # the conf state stays the OLD cluster's: the restored member starts from a raft snapshot
        # at index 2, so no conf change is applied and meta/confState is not rewritten until the
        # next membership change
        assert started.conf_state == orig.conf_state
        assert orig.conf_state is not None and not set(orig.conf_state.voters) & set(want_ids)
    else:
        # 3.4: the snapshot's members stay beside the new ones, which appear once they publish
        assert set(started.member_ids) == set(orig.member_ids) | set(want_ids)
        assert started.removed_member_ids == orig.removed_member_ids
        assert {m.client_urls for m in new_members.values()} == {(x.client_url,), (y.client_url,)}


@pytest.mark.parametrize("rel", ALL)
def test_restore_same_urls_and_token_keeps_ids(rel: Release, tmp_path: Any) -> None:
    """Restoring with the original name, peer URL and token gives the original member id and
    cluster id: by content the restored cluster cannot be told from the original by ids alone."""
    base = str(tmp_path)
    with cluster(rel, base, 1, token="tok-same") as c:
        n = c.nodes[0]
        n.ctl("put", "k", "v")
        orig_cid, orig_mid = cluster_id_of(n), member_id_of(n)
        snap = n.snapshot(os.path.join(base, "same.db"))
        orig = snapdb.read_identity(snap)
    shutil.move(n.data_dir, n.data_dir + ".old")
    restore(rel, snap, n, f"m1={n.peer_url}", "tok-same")
    fresh = snapdb.read_identity(n.db)
    assert fresh.member_ids == orig.member_ids == (orig_mid,)
    assert fresh.consistent_index == 1  # reset: one conf-change entry
    if rel.minor >= (3, 5):
        assert fresh.term == 1
    assert orig.consistent_index is not None and orig.consistent_index > 1
    try:
        n.start(f"m1={n.peer_url}", "tok-same")
        n.wait_up()
        assert cluster_id_of(n) == orig_cid and member_id_of(n) == orig_mid
    finally:
        n.stop()


def test_large_db_is_cheap(tmp_path: Any) -> None:
    """~100 MB snapshot (small keys in many pages plus 64 KiB values on overflow pages): identity
    in milliseconds, full entry count and sha256 in seconds, memory flat."""
    rel = NEWEST
    if not os.access(rel.etcd, os.X_OK):
        pytest.skip(f"no {rel.etcd}")
    with cluster(rel, str(tmp_path), 1) as c:
        n = c.nodes[0]
        big = os.urandom(64 * 1024)
        n.put_many([(b"big/%05d" % i, big) for i in range(1000)], batch=16)
        n.put_many([(b"small/%07d" % i, b"v" * 300) for i in range(80000)], batch=100)
        rev = int(n.status()["header"]["revision"])
        snap = n.snapshot(str(tmp_path / "big.db"))
    size = os.path.getsize(snap)
    assert size > 90 * 1024 * 1024, size
    # VmHWM, not ru_maxrss: the latter keeps the forking pytest's peak across exec
    code = (
        "import json, sys, time; sys.path.insert(0, sys.argv[2]); from etcd_agent.etcd import snapdb\n"
        "def hwm():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmHWM:'):\n"
        "            return int(line.split()[1])\n"
        "base = hwm()\n"
        "t = time.monotonic(); i = snapdb.read_identity(sys.argv[1]); quick = time.monotonic() - t\n"
        "t = time.monotonic(); f = snapdb.read_identity(sys.argv[1], count_entries=True, verify_trailer=True)\n"
        "full = time.monotonic() - t\n"
        "print(json.dumps({'quick': quick, 'full': full, 'base_kb': base, "
        "'peak_kb': hwm(), 'rev': i.revision, "
        "'entries': f.total_entries, 'keys': f.key_revisions, 'ok': f.trailer_verified}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, snap, REPO],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    print(f"\n100MB case: {size / 2**20:.1f} MiB, identity {res['quick'] * 1000:.1f} ms, "
          f"count+sha256 {res['full']:.2f} s, RSS {res['base_kb'] / 1024:.1f} -> {res['peak_kb'] / 1024:.1f} MiB")
    assert res["rev"] == rev
    assert res["keys"] == 81000 and res["ok"]
    st = snapshot_status(rel, snap)
    assert res["entries"] == st["totalKey"] and res["rev"] == st["revision"]
    assert res["quick"] < 0.5
    assert res["full"] < 30
    assert res["peak_kb"] - res["base_kb"] < 16 * 1024  # a 1 MiB hash buffer, a 1.6 KiB bitmap


# --- fuzz ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rich_snapshot(tmp_path_factory: Any) -> bytes:
    """A 3.5.30 snapshot with branch pages in several buckets, a removed member, a compaction."""
    rel = NEWEST
    if not os.access(rel.etcd, os.X_OK):
        pytest.skip(f"no {rel.etcd}")
    base = str(tmp_path_factory.mktemp("fuzz"))
    with cluster(rel, base, 3, token="tok-fuzz") as c:
        m1 = c.nodes[0]
        m1.put_many([(b"f/%05d" % i, b"y" * 120) for i in range(1500)], batch=10)  # revisions 2..151
        m1.ctl("put", "big", "z" * 9000)  # a value on overflow pages
        m1.ctl_retry("member", "remove", format(member_id_of(c.nodes[2]), "x"))
        c.nodes[2].stop()
        m1.wait_up()
        m1.ctl("compact", "100", "--physical")
        path = m1.snapshot(os.path.join(base, "fuzz.db"))
    with open(path, "rb") as fh:
        return fh.read()


def _resign_meta(buf: bytearray, offset: int) -> None:
    """Recompute a meta page's FNV-64a so a mutation of its fields gets past the checksum."""
    body = bytes(buf[offset + 16 : offset + 16 + 56])
    struct.pack_into("<Q", buf, offset + 16 + 56, bbolt._fnv64a(body))


def _mutate(data: bytes, rng: random.Random, ps: int) -> bytes:
    buf = bytearray(data)
    npages = (len(data) - 32) // ps
    kind = rng.randrange(9)
    if kind == 0:  # flip random bytes anywhere
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncate
        del buf[rng.randrange(len(buf)) :]
    elif kind == 2:  # copy one page over another
        a, b = rng.randrange(npages), rng.randrange(npages)
        buf[a * ps : (a + 1) * ps] = data[b * ps : (b + 1) * ps]
    elif kind == 3:  # zero a page
        a = rng.randrange(npages)
        buf[a * ps : (a + 1) * ps] = bytes(ps)
    elif kind == 4:  # corrupt a page header (id, flags, count, overflow)
        a = rng.randrange(2, npages)
        field = rng.choice([(0, "<Q"), (8, "<H"), (10, "<H"), (12, "<I")])
        val = rng.choice([0, 1, 2, 3, 4, 0x10, 0xFF, 0xFFFF, npages, npages - 1, 2**32 - 1, rng.randrange(2**16)])
        struct.pack_into(field[1], buf, a * ps + field[0], val % (1 << (8 * struct.calcsize(field[1]))))
    elif kind == 5:  # corrupt element headers of a page (pos, ksize, vsize, child pgid)
        a = rng.randrange(2, npages)
        at = a * ps + 16 + 16 * rng.randrange(8) + 4 * rng.randrange(4)
        struct.pack_into("<I", buf, at, rng.choice([0, 1, 17, 2**31, 2**32 - 1, rng.randrange(ps * 2), npages]))
    elif kind == 6:  # a meta field changed and re-signed: root, freelist, hwm, txid, page size
        off = rng.choice([0, ps])
        at = rng.choice([8, 16, 32, 40, 48])
        if at == 8:
            struct.pack_into("<I", buf, off + 16 + at, rng.choice([512, 1024, 2048, 8192, 65536, 3, 0]))
        else:
            struct.pack_into("<Q", buf, off + 16 + at, rng.choice([0, 1, 2, 3, npages - 1, npages, npages + 1,
                                                                   2**64 - 1, rng.randrange(npages)]))
        _resign_meta(buf, off)
    elif kind == 7:  # many random bytes inside one data page
        a = rng.randrange(2, npages)
        for _ in range(rng.randint(1, 64)):
            buf[a * ps + rng.randrange(ps)] = rng.randrange(256)
    else:  # append or drop bytes, trailer rules change
        if rng.random() < 0.5:
            buf += os.urandom(rng.choice([1, 32, 480, 512, ps]))
        else:
            del buf[-rng.choice([1, 32, 33, 512]) :]
    return bytes(buf)


def test_fuzz_only_format_errors(rich_snapshot: bytes) -> None:
    data = rich_snapshot
    good = snapdb.identity_from_bytes(data, count_entries=True, verify_trailer=True)
    assert len(good.members) == 2 and len(good.removed_member_ids) == 1 and good.compact_revision == 100
    ps = good.page_size
    rng = random.Random(20240501)
    outcomes = {"error": 0, "same": 0, "other": 0}
    messages = set()
    slowest = 0.0
    t_all = time.monotonic()
    for i in range(4000):
        bad = _mutate(data, rng, ps)
        count = i % 2 == 0
        t = time.monotonic()
        try:
            got = snapdb.identity_from_bytes(bad, count_entries=count)
        except SnapshotFormatError as exc:
            msg = str(exc)
            assert "\n" not in msg and msg and not msg.startswith("unexpected structure"), msg
            messages.add(re.sub(r"[0-9]+", "N", msg))
            outcomes["error"] += 1
        else:
            assert isinstance(got, SnapshotIdentity)
            want = good if count else replace(good, bucket_entries=None)
            want = replace(want, trailer_verified=None, size=got.size, has_trailer=got.has_trailer,
                           trailer_sha256=got.trailer_sha256)
            outcomes["same" if got == want else "other"] += 1
        slowest = max(slowest, time.monotonic() - t)
    total = time.monotonic() - t_all
    print(f"\nfuzz: 4000 mutations in {total:.1f} s, slowest {slowest * 1000:.1f} ms, {outcomes}, "
          f"{len(messages)} distinct messages (numbers aside)")
    assert slowest < 1.0
    assert outcomes["error"] > 1000


def test_fuzz_with_trailer_check(rich_snapshot: bytes) -> None:
    """With verify_trailer any change to the database bytes is caught by the sha256."""
    rng = random.Random(7)
    ps = snapdb.identity_from_bytes(rich_snapshot).page_size
    for _ in range(300):
        bad = _mutate(rich_snapshot, rng, ps)
        if bad == rich_snapshot:
            continue
        with pytest.raises(SnapshotFormatError):
            snapdb.identity_from_bytes(bad, verify_trailer=True)


# --- hand-made hostile inputs -----------------------------------------------------------------------
def test_hostile_constructions(rich_snapshot: bytes) -> None:
    data = rich_snapshot
    ps = snapdb.identity_from_bytes(data).page_size
    cases: List[Tuple[str, bytes]] = [
        ("empty", b""),
        ("trailer only", bytes(32)),
        ("zeros", bytes(8 * 4096 + 32)),
        ("text", b"hello world\n" * 1000),
        ("half a meta", data[:40]),
    ]
    # meta 0 bad -> meta 1 (txid - 1, same tree) is used, as bbolt does
    m0bad = bytearray(data)
    m0bad[20] ^= 0xFF
    assert snapdb.identity_from_bytes(bytes(m0bad)).members == snapdb.identity_from_bytes(data).members
    # both metas bad
    both = bytearray(m0bad)
    both[ps + 20] ^= 0xFF
    cases.append(("both metas bad", bytes(both)))
    # root pointing at a meta page; high water beyond the file
    # meta body: magic 0, version 4, page size 8, flags 12, root 16, sequence 24, freelist 32,
    # high water 40, txid 48, checksum 56
    for at, val in ((16, 0), (16, 1), (16, 10**6), (32, 1), (40, 10**9), (40, 3)):
        b = bytearray(data)
        for off in (0, ps):
            struct.pack_into("<Q", b, off + 16 + at, val)
            _resign_meta(b, off)
        cases.append((f"meta field {at}={val}", bytes(b)))
    for name, bad in cases:
        with pytest.raises(SnapshotFormatError) as ei:
            snapdb.identity_from_bytes(bad, count_entries=True)
        assert "\n" not in str(ei.value), name
