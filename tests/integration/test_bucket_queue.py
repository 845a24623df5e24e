"""Every backup reaches the bucket (issue 39 item 1), on a real S3 server (Ceph RGW), with real
daemons: a full backup whose copy failed lands once the store is back, before the segments that
continue it; wrong credentials, then fixed; a daemon killed with copies pending, then restarted.

The invariant checked at every look at the bucket: no segment without the full backup its chain
continues (a chain's objects live under ``chains/<key>/`` beside their full backup)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from typing import Any, Dict, List, Tuple

import pytest

from tests.harness.rgw import RgwBed, remote_table
from tests.integration.continuous import (
    agent,
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

pytestmark = pytest.mark.integration


BED_MEMBERS = 1  # the conftest's `bed` fixture: one-member daemon beds


def names(rgw: RgwBed, bucket: str) -> List[str]:
    c = rgw.client()
    out: List[str] = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="p/"):
        out += [o["Key"][2:] for o in page.get("Contents", [])]
    return out


def orphans(rgw: RgwBed, bucket: str, listed: List[str]) -> List[str]:
    """Segments in the bucket whose chain's full backup is not there: beside it under chains/<key>/
    (or, the legacy layout, a full backup at the top whose revision names its delta-<revision>/)."""
    def is_full(n: str) -> bool:
        base = n.rsplit("/", 1)[-1]
        return base.startswith("etcd-") and ".tar" in base and not base.startswith("etcd-delta-")

    dirs = {n.rsplit("/", 1)[0] for n in listed if is_full(n) and "/" in n}
    c = rgw.client()
    for n in listed:
        if is_full(n) and "/" not in n:  # legacy
            rev = c.head_object(Bucket=bucket, Key="p/" + n)["Metadata"].get("revision", "")
            dirs.add(f"delta-{int(rev):016d}" if rev.isdigit() else "")
    return [n for n in listed if ".seg" in n and n.rsplit("/", 1)[0] not in dirs]


def landed(rgw: RgwBed, bucket: str, files: List[str]) -> bool:
    """Every file name copied (somewhere under the prefix), and no segment orphaned, at this look."""
    listed = names(rgw, bucket)
    lost = orphans(rgw, bucket, listed)
    assert not lost, f"segments in the bucket without their full backup: {lost}"
    there = {n.rsplit("/", 1)[-1] for n in listed}
    return all(f in there for f in files)


def status_json(c: Any) -> Dict[str, Any]:
    res = agent(c, "--json", "status")
    return dict(json.loads(res.stdout))


def started(bed: Any, rgw: RgwBed, secret: str = "", **kw: Any) -> Tuple[Any, Any, str]:
    """A one-member cluster and its daemon, copying to a new bucket, its chain started."""
    bucket = rgw.new_bucket()
    d = bed(tables=remote_table(rgw, bucket, secret_key=secret or rgw.secret_key, prefix="p/", keep_last=10,
                                connect_timeout=2, read_timeout=20), **kw)
    start_all(d)
    wait_watching(d.c)
    return d, d.c, bucket


def backup_and_segments(c: Any, prefix: str) -> None:
    """(The store is down) a CLI backup, whose copy fails, then segments closed on the chain the
    daemon moves onto it."""
    res = agent(c, "backup")
    assert res.returncode != 0, res.stdout
    assert "written, but the off-host copy failed" in res.stderr and "the daemon" in res.stderr, res.stderr
    r = rpc(c)
    rev = 0
    for i in range(20):
        rev = put(r, f"{prefix}{i:03d}", b"x" * 100)
    wait_durable(c, rev)


def test_a_full_backup_whose_copy_failed_lands_before_its_segments(bed, rgw: RgwBed) -> None:  # type: ignore[no-untyped-def]
    d, c, bucket = started(bed, rgw)
    wait_for(lambda: landed(rgw, bucket, full_backups(c)), 60, "the daemon's first full backup copied")

    rgw.stop_gateway()
    try:
        backup_and_segments(c, "/outage/")
        cli_backup = full_backups(c)[-1]  # the newest: the daemon's chain moves onto it
        failing = wait_for(lambda: (status_json(c).get("copies") or {}).get("failing_since"), 60,
                           "the failure in `status --json`")
        wait_for(lambda: textfile(c).get("etcd_agent_bucket_failing_since_timestamp_seconds") == failing, 30,
                 "the failure in the textfile metrics")
        assert "FAILING since" in agent(c, "status").stdout
    finally:
        rgw.start_gateway()
    local = [os.path.basename(s) for s in segment_files(c)]
    wait_for(lambda: landed(rgw, bucket, [cli_backup, *local]), 120,
             f"{cli_backup} and {len(local)} segment(s) copied once the store is back")
    wait_for(lambda: "off-host copies resumed" in logs(d), 30, "the log line of copies resuming")
    st = wait_for(lambda: (lambda s: s if s.get("pending") == 0 and s.get("failing_since") is None else None)(
        status_json(c).get("copies") or {}), 60, "status: nothing pending, not failing")
    # a pass plans (pending 0) before it clears the failure: the textfile may show that moment
    tf = wait_for(lambda: (lambda t: t if t.get("etcd_agent_bucket_pending_objects") == 0
                           and t.get("etcd_agent_bucket_failing_since_timestamp_seconds") == 0 else None)(textfile(c)),
                  30, "the textfile: nothing pending, not failing")
    assert tf["etcd_agent_bucket_copies_total"] >= 1 and tf["etcd_agent_bucket_lag_revisions"] == 0
    listed = agent(c, "backup", "list", "--remote").stdout
    assert cli_backup in listed and "chains/" in listed, listed
    # each copy's chain as the bucket holds it: a point-in-time restore from the bucket gets that far
    assert "segment(s), 0 checkpoint(s) in the bucket; a point-in-time restore from the bucket reaches revision " \
        in listed, listed
    print(f"\nFIGURE bucket after the outage: {len(names(rgw, bucket))} objects, status copies {st}")


def test_wrong_credentials_then_fixed(bed, rgw: RgwBed) -> None:  # type: ignore[no-untyped-def]
    wrong = "WRONG" + uuid.uuid4().hex
    d, c, bucket = started(bed, rgw, secret=wrong)
    st = wait_for(lambda: (status_json(c).get("copies") or {}).get("failing_since") and status_json(c)["copies"],
                  60, "the failure in `status --json`")
    assert st["last_error"] and wrong not in json.dumps(st), st
    assert wrong not in agent(c, "status").stdout
    with open(c.config_path) as fh:
        text = fh.read()
    with open(c.config_path, "w") as fh:
        fh.write(text.replace(wrong, rgw.secret_key))
    d.procs[c.members[0].member.name].send_signal(signal.SIGHUP)
    want = full_backups(c) + [os.path.basename(s) for s in segment_files(c)]
    wait_for(lambda: landed(rgw, bucket, want), 60, f"the {len(want)} files here copied with the right credentials")
    # the copier reads the reloaded config on its own back-off and may land the copies first; the
    # supervisor's next tick (after any work of its own) says the change and resets the back-off
    wait_for(lambda: "failed copies are tried again now" in logs(d), 60, "the reload's line on the copy queue")
    assert wrong not in logs(d)


def test_a_daemon_killed_with_copies_pending_finishes_them_after_a_restart(bed, rgw: RgwBed) -> None:  # type: ignore[no-untyped-def]
    d, c, bucket = started(bed, rgw)
    name = c.members[0].member.name
    rgw.stop_gateway()
    try:
        backup_and_segments(c, "/killed/")
        pushed = agent(c, "backup", "push")  # by hand, while the store is down: one sentence, exit 1
        assert pushed.returncode == 1 and "backup push: nothing copied: cannot list" in pushed.stderr, pushed.stderr
        assert "the daemon retries" in pushed.stderr, pushed.stderr
        p: "subprocess.Popen[bytes]" = d.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        rgw.start_gateway()
    want = full_backups(c) + [os.path.basename(s) for s in segment_files(c)]
    d.start(name)
    wait_for(lambda: landed(rgw, bucket, want), 120, f"the {len(want)} files pending at the kill copied after a restart")
    # and `backup push` finds nothing left to do
    pushed = agent(c, "--json", "backup", "push")
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["pending"] == [], pushed.stdout
    dry = agent(c, "backup", "push", "--dry-run")
    # (an idle segment may close meanwhile: the daemon copies it within the second)
    assert dry.returncode == 0 and ("nothing pending" in dry.stdout or all(
        line.startswith("would copy") and ".seg" in line for line in dry.stdout.splitlines())), dry.stdout + dry.stderr


def test_a_checkpoint_lands_beside_its_chain(bed, rgw: RgwBed) -> None:  # type: ignore[no-untyped-def]
    from tests.integration.test_pitr_checkpoints import CHECKPOINTS, vouched

    d, c, bucket = started(bed, rgw, delta=CHECKPOINTS)
    r = rpc(c)
    rev = 0
    for i in range(100):  # 1.6 MB of events: past the checkpoint's growth
        rev = put(r, f"/cp/{i:03d}", os.urandom(8192).hex().encode())
    wait_durable(c, rev)
    name = wait_for(lambda: vouched(c.cfg.backup.dir), 120, "a checkpoint the chain vouches for")[0][0]

    def there() -> str:
        listed = names(rgw, bucket)
        assert not orphans(rgw, bucket, listed)
        return next((n for n in listed if n.endswith(f"/checkpoints/{name}")), "")

    where = wait_for(there, 60, f"checkpoint {name} copied")
    chain = where.split("/checkpoints/")[0]
    assert any(n.startswith(chain + "/") and n.endswith(".tar") and "/checkpoints/" not in n
               for n in names(rgw, bucket)), f"{chain}/ holds no full backup"
