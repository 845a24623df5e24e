"""The daemon and its bucket, one member on etcd 3.5.16 with copies to Ceph RGW (the ``rgw``
fixture): SIGHUP that enables, disables or changes [backup.remote] takes effect at once and its
log says so (issue 39 item 4); a hung gateway never holds up the segments (item 2)."""
from __future__ import annotations

import os
import signal
from typing import Any, Dict, Iterator, List

import pytest

from tests.harness.rgw import TomlValue, remote_table
from tests.integration.continuous import put, rpc, segment_files, start_all, wait_durable, wait_for, wait_watching

pytestmark = pytest.mark.integration


BED_MEMBERS = 1  # the conftest's `bed` fixture: one-member daemon beds


def _reload(d: Any, name: str, old: str, new: str) -> None:
    with open(d.c.config_path) as fh:
        text = fh.read()
    assert old in text
    with open(d.c.config_path, "w") as fh:
        fh.write(text.replace(old, new))
    os.kill(d.procs[name].pid, signal.SIGHUP)


class Bed:
    """A one-member daemon bed whose [backup.remote] points at a fresh bucket of ``rgw``."""

    def __init__(self, make: Any, rgw: Any, **remote: TomlValue) -> None:
        self.bucket = rgw.new_bucket()
        self.raw = rgw.client()
        self.d = make(tables=remote_table(rgw, self.bucket, prefix="p/", **remote))
        self.c = self.d.c
        self.name = self.c.cfg.members[0].name
        start_all(self.d)
        self.first = wait_watching(self.c)
        self.rpc = rpc(self.c)

    def write(self, prefix: str) -> None:
        """Ten puts, until a closed segment holds them: the daemon's local work goes on."""
        rev = 0
        for i in range(10):
            rev = put(self.rpc, f"{prefix}{i:02d}", b"x" * 100)
        wait_durable(self.c, rev)

    def copied(self, prefix: str = "p/") -> Iterator[str]:
        """The files copied under ``prefix`` (chains/<key>/...: full backups, segments, checkpoints)."""
        for o in self.raw.list_objects_v2(Bucket=self.bucket, Prefix=f"{prefix}chains/").get("Contents", []):
            yield o["Key"].rsplit("/", 1)[1]

    def local(self) -> List[str]:
        return [os.path.basename(s) for s in segment_files(self.c)]

    def log(self) -> str:
        return str(self.d.log(self.name))


def test_a_reload_enables_changes_and_disables_the_copies_at_once(bed: Any, rgw: Any) -> None:
    b = Bed(bed, rgw, enabled=False)
    d, name, bucket, raw = b.d, b.name, b.bucket, b.raw
    write, copied, local = b.write, b.copied, b.local

    write("/a/")
    assert list(copied("p/")) == []  # disabled: nothing copied

    _reload(d, name, "enabled = false\n", "enabled = true\n")
    write("/b/")
    # every segment of the running chain, those closed before the reload too
    wait_for(lambda: set(copied("p/")) >= set(local()), 60, "the chain copied after the reload enabled it")
    assert "[backup.remote] enabled by the reloaded config: every full backup, checkpoint and segment here is " \
           f"copied to s3://{bucket}/p/" in d.log(name)

    _reload(d, name, 'prefix = "p/"\n', 'prefix = "q/"\n')
    write("/c/")
    wait_for(lambda: set(copied("q/")) >= set(local()), 60, "the chain copied to the new prefix")
    assert f"[backup.remote] changed by the reloaded config: copies go to s3://{bucket}/q/" in d.log(name)

    _reload(d, name, "enabled = true\n", "enabled = false\n")
    wait_for(lambda: "[backup.remote] disabled by the reloaded config" in d.log(name), 30, "the disable logged")
    keys = [o["Key"] for o in raw.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert len({k.split("/")[2] for k in keys}) == 1, ("copies only of this chain", keys)
    assert "off-host copy failed" not in d.log(name)  # no copy failed or was retried on the way


def test_a_hung_gateway_never_holds_up_the_segments(bed: Any, rgw: Any) -> None:
    """Segments close while radosgw is stopped (SIGSTOP: it accepts, never answers); the uploader's
    waits end (small timeouts here; the defaults' bound is a unit test) and it catches up after."""
    b = Bed(bed, rgw, connect_timeout=1, read_timeout=1, max_attempts=1, deadline=2)
    b.write("/a/")
    wait_for(lambda: set(b.copied()) >= set(b.local()), 60, "the first segments copied")
    rgw.pause()
    try:
        for round in range(3):
            b.write(f"/hung{round}/")  # each waits for a closed segment: local work goes on
        wait_for(lambda: "did not answer within 1 s, 1 attempt(s)" in b.log(), 60, "the hung gateway named")
    finally:
        rgw.resume()
    wait_for(lambda: set(b.copied()) >= set(b.local()), 90, "every segment copied once the gateway answers")
    # the textfile names the check that verified them: on RGW, Content-MD5 and the ETag
    wait_for(lambda: uploads(b.c).get("etag", 0) >= len(b.local()), 30, "the uploads counted by check")
    assert uploads(b.c).get("checksum") == 0 and uploads(b.c).get("read-back") == 0


def uploads(c: Any) -> Dict[str, float]:
    from etcd_agent.daemon.metrics import samples

    path = os.path.join(os.path.dirname(c.cfg.backup.metrics_file or ""), "etcd_agent_delta.prom")
    with open(path) as fh:
        return {labels["check"]: v for name, labels, v in samples(fh.read())
                if name == "etcd_agent_delta_uploads_total"}
