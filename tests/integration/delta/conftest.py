"""The watcher, replay and throwaway etcd against real etcd 3.5.16 on loopback (the pure tests
of segments, chains and plans are in tests/unit: test_chain_*, test_pitr_*).

Every etcd started here is a ``scratch`` member (random loopback ports 10000-21998, a private
dir) and is stopped by the fixture that started it.
"""
import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before anything imports grpc (see rpc.py)

import pytest  # noqa: E402

from etcd_agent.scratch.member import EtcdBinaries, ScratchOptions, start_scratch  # noqa: E402

LIVE_OPTIONS = ScratchOptions(unsafe_no_fsync=False, max_request_bytes=1572864, max_txn_ops=128)
HAVE_ETCD = all(os.access(p, os.X_OK) for p in (EtcdBinaries().etcd, EtcdBinaries().etcdutl, EtcdBinaries().etcdctl))


@pytest.fixture
def live():
    """A fresh single-member etcd standing in for the live member: etcd's production defaults
    (fsync on, 1.5 MiB --max-request-bytes, 128 --max-txn-ops), not the replay scratch's."""
    if not HAVE_ETCD:
        pytest.fail("etcd 3.5.16 binaries not installed under /opt/etcd/3.5.16 (packaging/install-deps.sh test)")
    s = start_scratch(None, LIVE_OPTIONS, name="live")
    try:
        yield s
    finally:
        s.stop()
