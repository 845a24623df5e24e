import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # as the CLI sets it (cli/main.py), before grpc loads

import pytest

from tests.harness.loopback import LoopbackCluster
from tests.harness.releases import DEFAULT, release


@pytest.fixture
def cluster_factory(tmp_path):
    """Make LoopbackClusters; every etcd started is stopped afterwards, pass or fail."""
    made = []

    def make(n: int = 3, **kw) -> LoopbackCluster:
        c = LoopbackCluster(str(tmp_path / f"c{len(made)}"), n, **kw)
        made.append(c)
        return c

    release(DEFAULT)  # installed by `packaging/install-deps.sh test`, or the test fails saying so
    yield make
    for c in made:
        c.stop()
