import fcntl
import os
import tempfile
import time

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # as the CLI sets it (cli/main.py), before grpc loads

import pytest

from tests.harness.loopback import LoopbackCluster
from tests.harness.releases import DEFAULT, release

# The tier's files with few tests but long ones (its --durations), dealt to the xdist workers
# first. With --dist loadfile a file is one unit of work, and pytest-xdist's default order (most
# tests first) dealt these last: a 77 s file taken at the end kept one worker busy while the other
# had nothing left (a one-test file of 144 s dealt last did the same). Longest first, the tail is
# the short files. Not demo ports: test_demo and test_readme_rehearsal hold them one at a time, so
# only one of them is here.
LONG_FILES = ("test_orphans.py", "test_restore_from_bucket_partial.py", "test_pitr_checkpoints.py",
              "test_pitr_disaster.py", "test_readme_rehearsal.py", "test_delta_faults.py", "test_restore_daemon.py",
              "test_daemon.py", "test_bucket_partial_chain_rgw.py")


def pytest_collection_modifyitems(config: pytest.Config, items: "list[pytest.Item]") -> None:
    """This tier's files: LONG_FILES first, then the others by their number of tests (xdist's
    own order, which the Makefile's --no-loadscope-reorder hands over to this one); each file's
    tests keep their order, and other tiers' tests keep their places."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    slots = [i for i, it in enumerate(items) if str(it.path).startswith(here)]
    mine = [items[i] for i in slots]
    per_file: "dict[str, int]" = {}
    for it in mine:
        per_file[str(it.path)] = per_file.get(str(it.path), 0) + 1

    def rank(it: pytest.Item) -> "tuple[int, int]":
        name = os.path.basename(str(it.path))
        return (0, LONG_FILES.index(name)) if name in LONG_FILES else (1, -per_file[str(it.path)])

    for i, it in zip(slots, sorted(mine, key=rank)):  # stable: a file's tests together, in order
        items[i] = it


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
