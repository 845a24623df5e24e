"""SIGHUP that enables, disables or changes [backup.remote] takes effect in the running daemon at
once, and its log says so (issue 39 item 4): one member and its daemon on etcd 3.5.16, copies to
Ceph RGW (the ``rgw`` fixture)."""
from __future__ import annotations

import os
import signal
from typing import Any, Iterator, List

import pytest

from tests.integration.continuous import beds, put, rpc, segment_files, start_all, wait_durable, wait_for, wait_watching

pytestmark = pytest.mark.integration


@pytest.fixture
def bed(tmp_path):  # type: ignore[no-untyped-def]
    with beds(str(tmp_path), 1) as make:
        yield make


def _reload(d: Any, name: str, old: str, new: str) -> None:
    with open(d.c.config_path) as fh:
        text = fh.read()
    assert old in text
    with open(d.c.config_path, "w") as fh:
        fh.write(text.replace(old, new))
    os.kill(d.procs[name].pid, signal.SIGHUP)


def test_a_reload_enables_changes_and_disables_the_copies_at_once(bed: Any, rgw: Any) -> None:
    bucket = rgw.new_bucket()
    raw = rgw.client()
    remote = (f'[backup.remote]\nenabled = false\nendpoint = "{rgw.endpoint}"\nbucket = "{bucket}"\n'
              f'access_key = "{rgw.access_key}"\nsecret_key = "{rgw.secret_key}"\n'
              'addressing_style = "path"\nprefix = "p/"\n')
    d = bed(tables=remote)
    c = d.c
    name = c.cfg.members[0].name
    start_all(d)
    first = wait_watching(c)
    r = rpc(c)

    def write(prefix: str) -> None:
        rev = 0
        for i in range(10):
            rev = put(r, f"{prefix}{i:02d}", b"x" * 100)
        wait_durable(c, rev)

    def copied(prefix: str) -> Iterator[str]:
        for o in raw.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}delta-").get("Contents", []):
            yield o["Key"].rsplit("/", 1)[1]

    def local() -> List[str]:
        return [os.path.basename(s) for s in segment_files(c)]

    write("/a/")
    assert list(copied("p/")) == []  # disabled: nothing copied

    _reload(d, name, "enabled = false\n", "enabled = true\n")
    write("/b/")
    # every segment of the running chain, those closed before the reload too
    wait_for(lambda: set(copied("p/")) >= set(local()), 60, "the chain copied after the reload enabled it")
    assert "[backup.remote] enabled by the reloaded config: segments are copied to " \
           f"s3://{bucket}/p/ from now on, the running chain's too" in d.log(name)

    _reload(d, name, 'prefix = "p/"\n', 'prefix = "q/"\n')
    write("/c/")
    wait_for(lambda: set(copied("q/")) >= set(local()), 60, "the chain copied to the new prefix")
    assert f"[backup.remote] changed by the reloaded config: segments are copied to s3://{bucket}/q/" in d.log(name)

    _reload(d, name, "enabled = true\n", "enabled = false\n")
    wait_for(lambda: "[backup.remote] disabled by the reloaded config" in d.log(name), 30, "the disable logged")
    assert all(f"delta-{first:016d}" in k for k in [o["Key"] for o in raw.list_objects_v2(Bucket=bucket)
                                                     .get("Contents", [])]), "copies only of this chain"
    assert "off-host copy of" not in d.log(name)  # no upload failed or was retried on the way
