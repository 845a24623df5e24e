"""Faults of continuous backup on real etcd 3.5.16 and real processes (issue 35 item 11): the
daemon killed (-9) while a segment is open, a point-in-time restore killed (-9) mid-replay, and
the backup dir's disk full while segments are written. Each: nothing lost, nothing half-written
taken for a segment, and the next run goes on (or breaks loudly and takes a full backup)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from typing import Any, Dict, List, Tuple

import psutil
import pytest

from etcd_agent.chain import chains
from etcd_agent.chain.segments import TEMP_PREFIX, parse_name
from tests.harness.procs import agent_run
from tests.integration.continuous import (
    agent,
    breaks,
    dump,
    full_backups,
    logs,
    put,
    rpc,
    segment_files,
    start_all,
    textfile,
    wait_durable,
    wait_for,
    wait_watching,
)
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_restore import AGENT

pytestmark = pytest.mark.integration

CLOSE = 1.0  # close_seconds of the bed (continuous.FAST)
SLACK = 3.0  # batch_seconds (1 s) + a close's fsync + scheduling on a busy machine


class Writer:
    """Puts ``/w/<n>`` on its own thread until stopped; records each acknowledged write (key,
    revision, when acknowledged). Failures (etcd down with its daemon) are counted, not raised."""

    def __init__(self, c: Any, size: int = 2000) -> None:
        self.c, self.size = c, size
        self.acked: List[Tuple[str, int, float]] = []
        self.failed = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                r = rpc(self.c)
                try:
                    while not self._stop.is_set():
                        key = f"/w/{n:06d}"
                        rev = put(r, key, b"x" * self.size)
                        self.acked.append((key, rev, time.time()))
                        n += 1
                finally:
                    r.close()
            except Exception:  # etcd killed with its daemon: go on once it is back
                self.failed += 1
                n += 1  # that key may or may not have been applied: never reused
                self._stop.wait(0.2)

    def __enter__(self) -> "Writer":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(30)


def _temps(directory: str) -> List[str]:
    try:
        return [n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX)]
    except FileNotFoundError:
        return []


def _reached(out: str) -> int:
    m = re.search(r"reached revision (\d+)", out)
    assert m, out
    return int(m.group(1))


def test_daemon_killed_while_a_segment_is_open(bed) -> None:  # type: ignore[no-untyped-def]
    d = bed(n=1)
    c = d.c
    name = c.members[0].member.name
    start_all(d)
    wait_watching(c)
    backup_dir = c.cfg.backup.dir
    fulls_before = set(full_backups(c))
    assert fulls_before
    with Writer(c, size=20000) as w:
        # an open segment with bytes in it (past the writer's 1 MiB buffer): the daemon is killed
        # while it writes it
        # a closed segment first: the next start has a chain to resume
        wait_for(lambda: segment_files(c), 60, "a closed segment")

        def open_segment() -> Any:
            return [n for n in _temps(backup_dir) if not n.endswith("-00000000.tmp")
                    and os.path.getsize(os.path.join(backup_dir, n)) > 0]

        partial = wait_for(open_segment, 60, "an open segment with bytes on disk", interval=0.02)
        closed = segment_files(c)
        breaks_before = breaks(c)
        d.procs[name].send_signal(signal.SIGKILL)
        d.procs[name].wait(10)
        assert set(_temps(backup_dir)) & set(partial), "the open segment vanished with the kill"
        left = _temps(backup_dir)
        assert not [s for s in segment_files(c) if os.path.basename(s) in left]
        listing = agent(c, "backup", "list")
        assert listing.returncode == 0, listing.stderr
        assert not [n for n in left if n in listing.stdout], listing.stdout
        # and a restore replays the closed segments, never the partial one
        dry = agent(c, "restore", "--from", "latest", "--to", "newest", "--dry-run")
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert not [n for n in left if n in dry.stdout + dry.stderr], dry.stdout
        reached_down = _reached(dry.stdout)
        closed_end = max((parse_name(os.path.basename(s)) or (0, 0))[1] for s in closed)
        assert reached_down >= closed_end, (reached_down, closed_end)
        acked_before_kill = len(w.acked)
        d.start(name)
        wait_healthy(c.cfg, 1, 60)
        wait_for(lambda: len(w.acked) > acked_before_kill + 50, 60, "writes flowing again after the restart")
    last = w.acked[-1][1]
    wait_durable(c, last)
    log = logs(d)
    assert set(fulls_before) <= set(full_backups(c)), "a full backup was lost"
    assert not set(left) & set(_temps(backup_dir)), "the killed daemon's open segment is still there"
    assert "unfinished segment(s) of an earlier watcher" in log, log[-3000:]
    if breaks(c) > breaks_before:  # a break: loud, and a new full backup started the next chain
        assert "CHAIN BROKEN" in log and len(full_backups(c)) > len(fulls_before), log[-3000:]
        said = "; ".join(ln.split(": ", 1)[-1] for ln in log.splitlines() if "BROKEN" in ln)
        how = f"broke loudly ({breaks_before} break(s) before the kill; {said})"
    else:  # continued: the one chain of the full backup links without a gap up to the last write
        assert "resuming delta chain" in log, log[-3000:]
        assert set(closed) <= set(segment_files(c)), "a closed segment was lost"
        how = "continued"
    dry = agent(c, "restore", "--from", "latest", "--to", "newest", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    reached = _reached(dry.stdout)
    old_enough = [rev for _k, rev, t in w.acked if t < time.time() - CLOSE - SLACK]
    assert reached >= max(old_enough), (reached, max(old_enough))
    if how.startswith("continued"):
        found = [x for x in chains.scan(backup_dir).chains if x.usable]
        assert found and max(x.end_revision for x in found) >= last
    print(f"\nFIGURE delta kill -9: daemon killed with open segment {partial[0]} "
          f"after {len(closed)} closed ({len(w.acked)} writes acked, {w.failed} failed while down); next start removed it and the chain {how}; "
          f"restore --to newest reaches revision {reached} >= last acked {last} (with the daemon down: {reached_down}, "
          f"the closed segments' end {closed_end})")


def _scratch_etcds(tops: List[str]) -> List[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cwd", "name"]):
        try:
            cwd = p.info["cwd"] or ""
        except psutil.Error:
            continue
        if (p.info["name"] or "").startswith("etcd") and any(cwd.startswith(t) for t in tops):
            found.append(p)
    return found


def _live(c: Any) -> Dict[str, Any]:
    """What a restore that did not run must leave as it was: members, cluster id, a key, data dirs."""
    r = rpc(c)
    try:
        members = sorted((m.name, m.id) for m in c.client().members())
        hdr = r.header()
        return {"members": members, "cluster": hdr.cluster_id, "key": dump(r, "/before/"),
                "dirs": {lm.member.name: sorted(os.listdir(os.path.join(lm.data_dir, "member")))
                         for lm in c.members}}
    finally:
        r.close()


def test_point_in_time_restore_killed_mid_replay(bed) -> None:  # type: ignore[no-untyped-def]
    d = bed()
    c = d.c
    start_all(d)
    wait_watching(c)
    r = rpc(c)
    put(r, "/before/key", b"kept")
    for i in range(3000):
        put(r, f"/k/{i:05d}", b"v" * 200)
    top = put(r, "/k/top", b"v")
    r.close()
    wait_durable(c, top)
    before = _live(c)
    backup_dir = c.cfg.backup.dir
    tops = [backup_dir, c.cfg.daemon.state_dir]
    argv = [AGENT, "-c", c.config_path, "restore", "--from", "latest", "--to", "newest", "--yes"]
    with agent_run(argv) as proc:
        deadline = time.monotonic() + 120
        while not _scratch_etcds(tops):  # mid-replay: its throwaway etcd serves
            assert proc.poll() is None, "the restore ended before its replay could be killed"
            assert time.monotonic() < deadline, "no replay started"
            time.sleep(0.02)
        etcds = _scratch_etcds(tops)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    _, alive = psutil.wait_procs(etcds, timeout=15)
    assert not alive, f"throwaway etcd(s) {[p.pid for p in alive]} outlived the restore killed with -9"
    wait_healthy(c.cfg, 3, 30)
    assert _live(c) == before, "the killed restore changed the live cluster"
    t = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t
    assert res.returncode == 0, res.stdout + res.stderr
    wait_healthy(c.cfg, 3, 60)
    r = rpc(c)
    got = dump(r)
    r.close()
    assert got.get("/before/key", (b"",))[0] == b"kept"
    assert len([k for k in got if k.startswith("/k/")]) == 3001, len(got)
    assert not _scratch_etcds(tops), "a throwaway etcd is still running"
    pitr = os.path.join(backup_dir, ".pitr")
    left = [n for n in os.listdir(pitr) if n != ".lock"] if os.path.isdir(pitr) else []
    assert not left, left
    st = agent(c, "--json", "status")
    assert json.loads(st.stdout)["leftovers"] == [], st.stdout
    reused = "reused from an interrupted run" in res.stdout
    print(f"\nFIGURE pitr kill -9 mid-replay: live cluster unchanged (members, cluster id, key, data dirs); the next "
          f"run {'reused the interrupted replay' if reused else 'replayed again'} and restored 3002 keys in "
          f"{wall:.1f}s; no throwaway etcd or replay dir left")


def _df_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path: str) -> str:
    """Fill the file system of ``path`` to the last byte: a filler file written until ENOSPC."""
    filler = os.path.join(path, "filler")
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    try:  # the last partial write: one page at a time
        with open(filler, "ab") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
    except OSError:
        pass
    return filler


def test_backup_dir_disk_full_while_a_segment_is_written(bed, tmp_path) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = bed(n=1)
    c = d.c
    backup_dir = c.cfg.backup.dir
    os.makedirs(backup_dir, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=0700", "tmpfs", backup_dir], check=True)
    try:
        _disk_full(d, c, backup_dir)
    finally:
        d.stop()
        subprocess.run(["umount", "-l", backup_dir], check=False)


def _disk_full(d: Any, c: Any, backup_dir: str) -> None:
    start_all(d)
    wait_watching(c)
    fulls = {n: os.path.getsize(os.path.join(backup_dir, n)) for n in full_backups(c)}
    assert fulls
    r = rpc(c)
    put(r, "/pre/key", b"v")
    wait_durable(c, put(r, "/pre/last", b"v"))
    segs_before = set(segment_files(c))
    filler = _fill(backup_dir)
    assert _df_free(backup_dir) < 8192
    t_full = time.monotonic()
    revs = [put(r, f"/full/{i:04d}", b"y" * 2000) for i in range(300)]
    log = wait_for(lambda: (lambda text: text if "No space left" in text else None)(logs(d)), 60,
                   "the daemon saying the disk is full")
    # a segment too big for the writer's buffer: the disk is found full as it is written, not
    # only as it is closed
    revs += [put(r, f"/big/{i:04d}", b"z" * 20000) for i in range(100)]
    def said_twice() -> Any:  # the watch tried again (after RETRY_AFTER) and met the full disk again
        found = [ln for ln in logs(d).splitlines() if "No space left" in ln and "WARNING" in ln]
        return found if len(found) >= 2 else None

    said = wait_for(said_twice, 40, "the daemon meeting the full disk twice")
    # and the metrics say so: the RPO grows from the last closed segment
    rpo = wait_for(lambda: (lambda v: v if v > 8 else None)(textfile(c).get("etcd_agent_delta_rpo_seconds", 0.0)), 30,
                   "etcd_agent_delta_rpo_seconds growing on the full disk")
    log = logs(d)
    assert any(backup_dir in ln and "delta watch" in ln for ln in said), log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert d.procs[c.members[0].member.name].poll() is None, "the daemon died of the full disk"
    proc = psutil.Process(d.procs[c.members[0].member.name].pid)
    cpu = proc.cpu_times()
    time.sleep(5)
    busy = sum(proc.cpu_times()[:2]) - sum(cpu[:2])
    assert busy < 2.5, f"the daemon spins on the full disk: {busy:.1f}s of CPU in 5s"
    # what a listing or a restore reads: every file named as a segment is whole and signed
    from etcd_agent.backup import keys
    from etcd_agent.chain.check import verified

    key = keys.local_key(c.cfg).key
    for s in segment_files(c):
        assert verified(s, key).signature == "valid", s
    listing = agent(c, "backup", "list")
    assert listing.returncode == 0, listing.stderr
    assert not [n for n in _temps(backup_dir) if n in listing.stdout], listing.stdout
    assert segs_before <= set(segment_files(c)), "a segment closed before the disk filled was lost"
    for n, size in fulls.items():
        assert os.path.getsize(os.path.join(backup_dir, n)) == size, f"full backup {n} changed"
    # space back: the chain resumes (or breaks loudly and a full backup starts the next)
    os.unlink(filler)
    last = put(r, "/after/last", b"v")
    wait_durable(c, last, timeout=60)
    r.close()
    log = logs(d)
    dry = agent(c, "restore", "--from", "latest", "--to", "newest", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert _reached(dry.stdout) >= last
    if breaks(c):
        assert "CHAIN BROKEN" in log
    print("\n" + "\n".join(ln.replace(backup_dir, "<dir>") for ln in said))
    print(f"FIGURE delta disk full: {len(said)} log line(s) naming 'No space left' in {backup_dir} "
          f"({time.monotonic() - t_full:.0f}s on the full disk, daemon alive, {busy:.2f}s CPU in 5s); space back: "
          f"{'a break and a full backup' if breaks(c) else 'the chain resumed'}, restore --to newest reaches "
          f"revision {_reached(dry.stdout)} >= {last} (writes {revs[0]}..{revs[-1]} on the full disk; rpo_seconds reached {rpo:.0f})")
