"""What operators bring into a backup dir holding a partial chain (the segments from a checkpoint's
lease census on, as a restore from the bucket with the key leaves it): files named like segments
that are not regular files, files dated in the future, a hand-made runbook tarball under the
checkpoint's name. `backup list` (and `--json`), `restore --from latest --to newest --dry-run`,
`backup prune --dry-run` and the daemon never hang, never print a traceback, name the file in one
sentence or pass over it, and never pick or delete wrongly. One real daemon on etcd 3.5.16 with
checkpoints makes the chain (shared by the module; each test puts back what it changed); the
chain is made partial by removing the segments before the newest checkpoint's lease census."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
import time
from typing import Any, Dict, Iterator, List, NamedTuple, Tuple

import pytest

from etcd_agent.backup import keys
from etcd_agent.chain import chains
from etcd_agent.chain.reader import read_segment
from etcd_agent.chain.segments import name_time_ms, parse_name, segment_name
from etcd_agent.chain.writer import SegmentWriter
from tests.integration.continuous import (
    agent,
    beds,
    full_backups,
    logs,
    rpc,
    start_all,
    wait_for,
    wait_watching,
)
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_pitr_checkpoints import CHECKPOINTS
from tests.integration.test_pitr_latest_partial import past_a_checkpoint

pytestmark = pytest.mark.integration

ETCDCTL = "/opt/etcd/3.5.16/etcdctl"
ETCDCTL = "/opt/etcd/3.5.16/etcdctl"
YEAR_S = 366 * 86400


class Bed(NamedTuple):
    d: Any
    c: Any
    directory: str
    full: str  # the full backup the partial chain continues
    checkpoint: str  # the newest checkpoint the chain vouches for (the replay's start)
    end: int  # the chain's last revision
    run: List[str]  # the partial chain's segment files (basenames, in order)


@pytest.fixture(scope="module")
def partial(tmp_path_factory: Any) -> Iterator[Bed]:
    with beds(str(tmp_path_factory.mktemp("hostile")), 1) as make:
        d = make(n=1, delta=CHECKPOINTS)
        start_all(d)
        wait_watching(d.c)
        c, directory = d.c, d.c.cfg.backup.dir
        r = rpc(c)
        lease = r.lease_grant(900)[0]
        (full,) = full_backups(c)
        end = past_a_checkpoint(c, r, lease)
        d.stop()  # nothing writes into the dir while its chain is cut
        c.members[0].backend.start()
        c.members[0].wait_healthy(30)
        (chain,) = [ch for ch in chains.scan(directory).chains if ch.checkpoints]
        cp = max(chain.checkpoints, key=lambda x: x.revision)
        for p in chain.paths:
            rng = parse_name(os.path.basename(p))
            assert rng is not None
            if rng[1] < cp.leases_from:
                os.unlink(p)
        (part,) = [ch for ch in chains.scan(directory).chains if ch.checkpoints]
        assert part.begins_at and part.end_revision >= end, part
        yield Bed(d, c, directory, full, cp.name, part.end_revision, [os.path.basename(p) for p in part.paths])


def _cli(b: Bed, *args: str) -> Tuple[int, str]:
    """The CLI, bounded: a hang is a TimeoutExpired, the test's failure."""
    res = agent(b.c, *args, timeout=90)
    out = res.stdout + res.stderr
    assert "Traceback" not in out, (args, out)
    return res.returncode, out


def _twin(name: str, *, ms: int = 1, first: int = 0) -> str:
    """A segment name beside ``name``: its end time ``ms`` later, or starting at ``first`` (idle)."""
    rng, at = parse_name(name), name_time_ms(name)
    assert rng is not None and at is not None, name
    return segment_name(first, first - 1, at + ms) if first else segment_name(rng[0], rng[1], at + ms)


def _keeps(out: str) -> Dict[str, str]:
    """``backup prune --dry-run``'s decisions: file -> its line."""
    got: Dict[str, str] = {}
    for ln in out.splitlines():
        words = ln.split()
        if len(words) >= 2 and words[0] in ("keep", "delete", "would"):
            got[(words[2] if words[0] == "would" else words[1]).rstrip(":")] = ln.strip()
    return got


def _views(b: Bed) -> Tuple[str, Dict[str, Any], str, str]:
    """`backup list`, `backup list --json`, the `--from latest --to newest` plan, the prune plan."""
    rc, listing = _cli(b, "backup", "list")
    assert rc == 0, listing
    rc, js = _cli(b, "--json", "backup", "list")
    assert rc == 0, js
    rc, plan = _cli(b, "restore", "--from", "latest", "--to", "newest", "--dry-run")
    assert rc == 0, plan
    rc, prune = _cli(b, "backup", "prune", "--dry-run")
    assert rc == 0, prune
    return listing, json.loads(js[: js.rindex("}") + 1]), plan, prune


def _mentions(text: str, name: str) -> List[str]:
    return [ln.strip() for ln in text.splitlines() if name in ln]


def test_non_regular_files_named_like_segments_are_passed_over_or_named(partial: Bed) -> None:
    b = partial
    listing0, js0, plan0, prune0 = _views(b)
    assert f"reached revision {b.end}" in plan0 and b.full in plan0, plan0
    mid, last = b.run[len(b.run) // 2], b.run[-1]
    hostile = {"a FIFO": _twin(b.run[0]), "a directory": _twin(mid),
               "a symlink to /dev/zero": _twin(last, first=b.end + 1),
               "a character device": _twin(last, ms=5, first=b.end + 1),
               "a directory before the full backup": segment_name(1, 1, name_time_ms(b.run[0]) or 0)}
    paths = {k: os.path.join(b.directory, v) for k, v in hostile.items()}
    os.mkfifo(paths["a FIFO"], 0o600)
    os.mkdir(paths["a directory"], 0o700)
    os.mkdir(paths["a directory before the full backup"], 0o700)  # where retention deletes unreadable segments
    os.symlink("/dev/zero", paths["a symlink to /dev/zero"])
    os.mknod(paths["a character device"], 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's
    try:
        t0 = time.monotonic()
        listing, js, plan, prune = _views(b)
        took = time.monotonic() - t0
        rc, pruned = _cli(b, "backup", "prune")  # for real: what it deletes is no segment of any chain
        assert rc == 0, pruned
        # none of them is a segment: the chain's end is still its end, nothing is said lost
        assert "NOT COMPLETE" not in plan, [ln.strip() for ln in plan.splitlines() if "NOT COMPLETE" in ln]
        junk = "\n".join(json.dumps(x) for x in js["not_segments"] + js["damaged_segments"])
        assert sorted(os.path.basename(x["path"]) for x in js["not_segments"]) == sorted(hostile.values()), junk
        figures = []
        for what, name in hostile.items():
            for view, text in (("list", listing), ("list --json", junk), ("restore", plan),
                               ("prune", prune), ("pruned", pruned)):
                said = _mentions(text, name)
                assert len(said) <= 1, (what, view, said)  # one sentence, or passed over
                figures.append(f"{what}, {view}: " + (said[0][:200] if said else "passed over"))
            assert os.path.lexists(paths[what]), (what, pruned)  # nothing deletes what it does not know
        # the chain, the backup it continues and what `latest` takes are what they were
        assert f"reached revision {b.end}" in plan and b.full in plan, plan
        assert list(js["backups"]) == list(js0["backups"]), (js, js0)
        keeps = _keeps(prune)
        assert {k: v.split()[0] for k, v in keeps.items() if k in (b.full, b.checkpoint, *b.run)} == {
            k: v.split()[0] for k, v in _keeps(prune0).items() if k in (b.full, b.checkpoint, *b.run)}, (prune, prune0)
        print(f"\nFIGURE 4 views with a FIFO, a directory, a symlink and a device named as segments: {took:.1f} s\n  "
              + "\n  ".join(figures))
    finally:
        for p in paths.values():
            if os.path.isdir(p) and not os.path.islink(p):
                os.rmdir(p)
            elif os.path.lexists(p):
                os.unlink(p)


def _future_segment(b: Bed) -> str:
    """An idle segment after the chain's end, signed with the manifest key as the daemon would
    write it, whose clock had jumped a year ahead: header, footer and name dated then."""
    last = os.path.join(b.directory, b.run[-1])
    seg = read_segment(last)
    ahead = int(time.time() * 1000) + YEAR_S * 1000
    h = dataclasses.replace(seg.info.header, seq=seg.info.header.seq + 1, start_revision=b.end + 1,
                            prev_sha256=hashlib.sha256(open(last, "rb").read()).hexdigest(), start_time_ms=ahead)
    key = keys.read_key_file(keys.key_path(b.c.cfg)).key
    assert key
    w = SegmentWriter(b.directory, h, sign_key=key)
    return w.close(ahead + 1000, confirmed=True).path


def _dated(b: Bed, name: str, seconds: float) -> None:
    path = os.path.join(b.directory, name)
    at = os.stat(path).st_mtime + seconds
    os.utime(path, (at, at))


def test_files_dated_in_the_future_are_neither_picked_nor_deleted_wrongly(partial: Bed) -> None:
    """A clock that jumped a year ahead, step by step: a segment the daemon signed then (after the
    chain's end), then the mtimes of the last segment, the checkpoint and the full backup."""
    b = partial
    _l0, _j0, _p0, prune0 = _views(b)
    keeps0 = _keeps(prune0)
    future = _future_segment(b)
    steps = [("a signed segment dated +1 year after the end", ""), ("+ the last segment's mtime", b.run[-1]),
             ("+ the checkpoint's mtime", b.checkpoint), ("+ the full backup's mtime", b.full)]
    moved: List[str] = []
    figures = []
    try:
        for label, name in steps:
            if name:
                _dated(b, name, YEAR_S)
                moved.append(name)
            rc_l, listing = _cli(b, "backup", "list")
            rc_p, plan = _cli(b, "restore", "--from", "latest", "--to", "newest", "--dry-run")
            rc_r, prune = _cli(b, "backup", "prune", "--dry-run")
            assert rc_l == 0 and rc_r == 0, (listing, prune)
            keeps = _keeps(prune)
            for n in (b.full, b.checkpoint):  # never deleted: kept, or quarantined (never deleted either)
                assert keeps.get(n, "keep").startswith("keep") == keeps0[n].startswith("keep"), (label, n, keeps.get(n))
            said = [ln.strip() for ln in plan.splitlines() if "future" in ln or "error" in ln]
            if not name:  # the segment after the end is never replayed, and named
                assert rc_p == 0 and b.full in plan and f"reached revision {b.end} at" in plan, plan
                assert any(os.path.basename(future) in ln and "dated in the future" in ln for ln in said), said
            elif name == b.run[-1]:  # the chain stops before the segment modified in the future, and says so
                assert rc_p == 0 and b.full in plan and f"reached revision {b.end} at" not in plan, plan
                assert any(name in ln and "modified in the future" in ln for ln in said), said
            elif name == b.checkpoint:  # the partial chain's only checkpoint is quarantined: refused, and the
                # listing does not promise a restore from it
                assert rc_p == 3 and "a partial chain" in plan, plan
                cp_lines = [ln.strip() for ln in listing.splitlines() if f"checkpoint {b.checkpoint}" in ln]
                assert any("quarantined" in ln and "no restore starts from it" in ln for ln in cp_lines), cp_lines
            else:  # nothing good is left: refused, saying why
                assert rc_p == 2, plan
                assert "quarantined" in plan and f"{b.full}: modified in the future" in plan, plan
            said += [ln.strip() for ln in listing.splitlines() if f"checkpoint {b.checkpoint}" in ln
                     and "no restore starts" in ln]
            figures.append(f"{label}: restore rc {rc_p}: " + " | ".join(x[:300] for x in said))
    finally:
        os.unlink(future)
        for n in moved:
            _dated(b, n, -YEAR_S)
    print("\nFIGURE " + "\n  ".join(figures))


def _runbook(b: Bed, out: str, work: str) -> None:
    """What the manual runbook leaves: `etcdctl snapshot save` and a `tar czf` of etcd.conf,
    etcd.service and etcd_snapshot.db - no manifest."""
    os.makedirs(work, exist_ok=True)
    subprocess.run([ETCDCTL, "--endpoints", b.c.cfg.members[0].client_url, "snapshot", "save",
                    os.path.join(work, "etcd_snapshot.db")], check=True, capture_output=True, timeout=60,
                   env={**os.environ, "ETCDCTL_API": "3"})
    with open(os.path.join(work, "etcd.conf"), "w") as fh:
        fh.write("ETCD_NAME=m0\nETCD_DATA_DIR=/var/lib/etcd\n")
    with open(os.path.join(work, "etcd.service"), "w") as fh:
        fh.write("[Service]\nExecStart=/usr/bin/etcd\n")
    with tarfile.open(out, "w:gz") as tar:
        for n in ("etcd.conf", "etcd.service", "etcd_snapshot.db"):
            tar.add(os.path.join(work, n), arcname=n)


def test_a_runbook_tarball_under_the_checkpoint_s_name_is_never_the_checkpoint(partial: Bed, tmp_path: Any) -> None:
    b = partial
    cp = os.path.join(b.directory, b.checkpoint)
    aside = str(tmp_path / b.checkpoint)
    shutil.move(cp, aside)
    try:
        _runbook(b, cp, str(tmp_path / "runbook"))
        # the chain's footer names the checkpoint's snapshot sha256: the runbook's tarball is not
        # it, so no replay starts from it; the partial chain has nothing else to start from: refused
        rc, plan = _cli(b, "restore", "--from", "latest", "--to", "newest", "--dry-run")
        assert rc == 3, plan
        errors = [ln.strip() for ln in plan.splitlines() if "error:" in ln]
        assert len(errors) == 1 and "a partial chain" in errors[0], plan
        assert not any(f"point in time: checkpoint {b.checkpoint}" in ln for ln in plan.splitlines()), plan
        rc2, explicit = _cli(b, "restore", "--from", b.checkpoint, "--to", "newest", "--dry-run")
        assert rc2 != 0, explicit
        # and the listing does not promise a restore from it
        rc3, listing = _cli(b, "backup", "list")
        assert rc3 == 0, listing
        said = [ln.strip() for ln in listing.splitlines() if f"checkpoint {b.checkpoint}" in ln]
        assert any("is not it (a runbook backup" in ln and "no restore starts from it" in ln for ln in said), said
        rc4, js = _cli(b, "--json", "backup", "list")
        doc = next(x for x in json.loads(js[: js.rindex("}") + 1])["backups"] if x["name"] == b.full)
        assert len(doc["chain"]["checkpoints_not_here"]) == 1, doc["chain"]
        print(f"\nFIGURE a runbook tarball under {b.checkpoint}: --from latest --to newest: rc {rc}: {errors[0][:400]}"
              f"\n  --from {b.checkpoint}: rc {rc2}: " + explicit.strip().splitlines()[-1][:300]
              + "\n  list: " + " | ".join(said))
    finally:
        os.unlink(cp)
        shutil.move(aside, cp)


def test_the_daemon_lives_with_non_regular_segment_names(partial: Bed) -> None:
    """Last: the daemon starts a new full backup and chain (it never resumes a partial one)."""
    b = partial
    fifo = os.path.join(b.directory, _twin(b.run[0]))
    dev = os.path.join(b.directory, _twin(b.run[-1], first=b.end + 1))
    os.mkfifo(fifo, 0o600)
    os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    before = set(full_backups(b.c))
    b.d.start(b.c.members[0].member.name)
    wait_healthy(b.c.cfg, 1, 90)
    new = wait_for(lambda: set(full_backups(b.c)) - before, 120, "the daemon's new full backup")
    wait_watching(b.c)
    b.d.stop()
    text = logs(b.d)
    assert "Traceback" not in text, text[-3000:]
    assert os.path.exists(fifo) and os.path.exists(dev)
    assert os.path.exists(os.path.join(b.directory, b.full)) and all(
        os.path.exists(os.path.join(b.directory, n)) for n in b.run)
    print(f"\nFIGURE the daemon with a FIFO and a device named as segments: new full backup {sorted(new)}; log lines "
          "naming them:\n  " + "\n  ".join([ln[:200] for ln in text.splitlines()
                                           if os.path.basename(fifo) in ln or os.path.basename(dev) in ln][:4]))
