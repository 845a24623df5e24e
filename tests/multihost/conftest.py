"""Fixtures for the multihost tier: network-namespace hosts with their own IP and sshd."""
from __future__ import annotations

import os
from typing import Callable, Iterator, List

import pytest

from etcd_agent.config import SshSection
from tests.harness import bedlock, xdistbeds
from tests.harness.netns import NetnsBed
from tests.harness.restorebed import ETC_DIR
from tests.harness.rgw import RgwBed, session_bed

# this tier's own bed; other suites use other prefixes and subnets so beds can coexist
BED_PREFIX = "ea"
BED_SUBNET = "10.213.1"
CONNECT_TIMEOUT = 2.0


# The tier runs on two xdist workers (Makefile; tests/harness/xdistbeds.py): its tests mostly wait
# (timeouts, elections, shaped links). A file is a unit of work, but for SHARED: the files on the
# session bed ("ea": netns_bed, and rgw_bridge on its bridge) and the two whose beds use prefix
# "et" and 10.213.3, one of which uses the session bed too. Every other file has its own prefix
# and subnet.
SHARED = "session-bed"
SHARED_FIXTURES = ("netns_bed", "rgw_bridge")
SHARED_FILES = ("test_bucket_disaster_ssh.py", "test_cluster_tls.py", "test_netns_bed.py", "test_rgw_bridge.py",
                "test_ssh_host.py", "test_ssh_stream.py")
# the longest units (--durations), dealt first
LONG = ("test_backup_storm_ssh.py", SHARED, "test_restore_concurrent_ssh.py", "test_ship_ssh.py",
        "test_restore_ssh.py", "test_restore_runbook_ssh.py")


def unit_of(file: str) -> str:
    return SHARED if file in SHARED_FILES else file


def pytest_configure(config: pytest.Config) -> None:
    xdistbeds.register(config, __file__, unit_of, LONG)
    # `ip netns exec` binds /etc/netns/<ns>/etcd-agent only over an existing /etc/etcd-agent, which
    # a bed makes when there is none and then removes at its end: under two workers' beds at once.
    # Made here for the run when the workers share it, the beds find it and leave it.
    if bedlock.is_xdist_controller(config) and os.geteuid() == 0 and not os.path.exists(ETC_DIR):
        os.makedirs(ETC_DIR, mode=0o755)
        config.add_cleanup(lambda: _rmdir(ETC_DIR))


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    # a file on the session bed outside SHARED would bring up a second "ea" bed on the other worker
    strays = sorted({os.path.basename(str(it.path)) for it in items
                     if any(f in getattr(it, "fixturenames", ()) for f in SHARED_FIXTURES)} - set(SHARED_FILES))
    if strays:
        raise pytest.UsageError(f"tests/multihost/conftest.py: add {', '.join(strays)} to SHARED_FILES "
                                "(they use the session bed)")


@pytest.fixture(scope="session", autouse=True)
def testbed_lock(pytestconfig: pytest.Config) -> Iterator[None]:
    """This tier's fixed prefixes and subnets: one heavy bed per machine (tests/harness/bedlock.py)."""
    yield from bedlock.hold_for_session(pytestconfig)


@pytest.fixture(scope="session")
def netns_bed() -> Iterator[NetnsBed]:
    """Three hosts ea1..ea3 (10.213.1.11-13), each with sshd on :22; torn down at the end."""
    if os.geteuid() != 0:
        pytest.skip("multihost tests need root (network namespaces, sshd)")
    bed = NetnsBed(3, prefix=BED_PREFIX, subnet=BED_SUBNET)
    try:
        bed.up()
        bed.start_sshd()
        yield bed
    finally:
        bed.down()


@pytest.fixture(scope="session")
def rgw_bridge(netns_bed: NetnsBed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RgwBed]:
    """A real S3 server the namespace hosts reach: an RGW bed serving on the bridge address
    (``netns_bed.gateway``; its mon and OSD stay on loopback). The same interface as `rgw`."""
    yield from session_bed(tmp_path_factory, "rgw-bridge", netns_bed.gateway)


@pytest.fixture
def ssh_cfg(netns_bed: NetnsBed) -> SshSection:
    """SSH settings that reach the bed: its client key and known_hosts, short connect timeout."""
    return SshSection(
        user="root",
        identity_file=netns_bed.client_key,
        known_hosts=netns_bed.known_hosts,
        connect_timeout=CONNECT_TIMEOUT,
        command_timeout=30.0,
    )


@pytest.fixture
def open_ssh(ssh_cfg: SshSection) -> Iterator[Callable[..., object]]:
    """Factory for SshHost objects that are all closed after the test."""
    from etcd_agent.hosts.ssh import SshHost

    opened: List[SshHost] = []

    def make(name: str, address: str, cfg: SshSection = ssh_cfg) -> SshHost:
        h = SshHost(name, address, cfg)
        opened.append(h)
        return h

    yield make
    for h in opened:
        h.close()
