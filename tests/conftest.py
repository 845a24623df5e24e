"""Shared test setup: the repo root on sys.path so `tests.harness` imports; the real S3 server
(Ceph's RADOS Gateway, tests/harness/rgw.py) that the integration and multihost tiers share."""
import os
import sys
from typing import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.harness.rgw import RgwBed, session_bed  # noqa: E402  (needs ROOT on sys.path)


@pytest.fixture(scope="session")
def rgw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RgwBed]:
    """One RGW bed on 127.0.0.1 per pytest process (per xdist worker), started the first time a
    test asks for it (~6 s), stopped at the session's end. Tests take a bucket of their own
    with ``rgw.new_bucket()``."""
    yield from session_bed(tmp_path_factory, "rgw", "127.0.0.1")


@pytest.fixture(autouse=True)
def _rgw_heal(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used a bed, its gateway serves again (a test may pause or stop it and
    fail before it resumes): the next test must not inherit a hung or stopped gateway."""
    yield
    for name in ("rgw", "rgw_bridge"):
        if name in request.fixturenames:
            request.getfixturevalue(name).heal()
