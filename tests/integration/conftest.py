import fcntl
import os
import tempfile
import time

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


@pytest.fixture
def bed(request, tmp_path):
    """``make(**kw)``: daemon beds under tmp_path (``continuous.beds``: a loopback cluster with one
    real ``etcd-agent run`` per member), every one stopped after the test; of the test module's
    ``BED_MEMBERS`` members, 3 unless it says."""
    from tests.integration.continuous import beds

    with beds(str(tmp_path), getattr(request.module, "BED_MEMBERS", 3)) as make:
        yield make


@pytest.fixture
def demo_ports():
    """The demo's fixed ports (2379/2380, 22379/22380, 32379/32380), held by one test at a time
    across pytest-xdist workers and other runs on this machine: a flock beside the temp root."""
    path = os.path.join(tempfile.gettempdir(), "etcd-agent-demo-ports.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the demo's ports stayed taken for 15 min ({path} held)", pytrace=False)
                time.sleep(0.5)
        yield
    finally:
        os.close(fd)
