"""The copier's lag while the bucket cannot be listed (wrong credentials on the real RGW; the
shared gateway keeps serving other tests): said as unreachable, with what is surely not copied
as a lower bound (the files pending at the last listing and those that appeared since), and as
unknown when the bucket was never listed since the daemon started; in ``status`` and in the
metrics (``etcd_agent_bucket_up``, ``_last_listing_timestamp_seconds``)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, List

import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.bucket import copier
from etcd_agent.config import Config
from tests.harness.rgw import RgwBed, remote_table

pytestmark = pytest.mark.integration


def _wrong(cfg: Config) -> Config:
    r = dataclasses.replace(cfg.backup.remote, secret_key="not-the-secret")
    return dataclasses.replace(cfg, backup=dataclasses.replace(cfg.backup, remote=r))


def test_the_lag_while_the_bucket_cannot_be_listed_is_a_lower_bound_or_unknown(cluster_factory: Any,
                                                                                 rgw: RgwBed) -> None:
    bucket = rgw.new_bucket()
    c = cluster_factory(1, extra=remote_table(rgw, bucket, prefix="p/"))
    c.start_static()
    good, me = c.cfg, c.cfg.members[0]
    current: List[Config] = [good]
    cp = copier.Copier(lambda: (current[0], me))

    first = take_backup(good, member=me.name, origin="daemon")
    assert cp._pass(good) is False
    st = cp.status()
    assert (st.pending, st.unreachable_since) == (0, None) and st.listed_at is not None
    assert copier.metric_values(st)["up"] == 1.0
    listed_at = st.listed_at

    time.sleep(1.1)  # backup names have one-second resolution
    current[0] = _wrong(good)
    second = take_backup(good, member=me.name, origin="daemon")  # the bucket cannot have it: nothing copied since
    assert cp._pass(current[0]) is True
    st = cp.status()
    assert st.unreachable_since is not None and st.listed_at == listed_at
    assert st.pending == 1 and st.oldest_pending_since is not None and st.oldest_pending_since > listed_at, st
    now = time.time()
    line = st.describe(now)
    assert "FAILING since " in line and "bucket unreachable since " in line and "lag at least " in line, line
    assert "1 object(s) (last listed" in line, line
    assert f"last listed {max(0.0, now - listed_at):.0f}s ago" in line, line
    values = copier.metric_values(st)
    assert values["up"] == 0.0 and values["last_listing_timestamp_seconds"] == listed_at
    assert values["pending_objects"] == 1.0 and values["oldest_pending_seconds"] > 0

    again = copier.Copier(lambda: (current[0], me))  # a daemon started while the bucket cannot be listed
    assert again._pass(current[0]) is True
    st = again.status()
    assert "lag unknown (the bucket has not been listed since the daemon started)" in st.describe(time.time())
    values = copier.metric_values(st)
    assert values["up"] == 0.0 and values["last_listing_timestamp_seconds"] == 0.0

    current[0] = good  # fixed: the copy lands, the bucket is up again
    assert cp._pass(good) is False
    st = cp.status()
    assert (st.pending, st.unreachable_since) == (0, None) and st.listed_at is not None and st.listed_at > listed_at
    assert copier.metric_values(st)["up"] == 1.0 and "unreachable" not in st.describe(time.time())
    names = [o["Key"].rsplit("/", 1)[1] for o in rgw.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert sorted(names) == sorted(p.rsplit("/", 1)[1] for p in (first.path, second.path))
