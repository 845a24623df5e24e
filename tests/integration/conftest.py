import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # as the CLI sets it (cli/main.py), before grpc loads

import shutil

import pytest

from tests.harness.loopback import LoopbackCluster


@pytest.fixture
def cluster_factory(tmp_path):
    """Make LoopbackClusters; every etcd started is stopped afterwards, pass or fail."""
    made = []

    def make(n: int = 3, **kw) -> LoopbackCluster:
        c = LoopbackCluster(str(tmp_path / f"c{len(made)}"), n, **kw)
        made.append(c)
        return c

    if not shutil.which("etcd"):
        pytest.fail("etcd is not installed (apt-get install etcd-server etcd-client)")
    yield make
    for c in made:
        c.stop()
