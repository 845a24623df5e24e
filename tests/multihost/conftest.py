"""Fixtures for the multihost tier: network-namespace hosts with their own IP and sshd."""
from __future__ import annotations

import os
from typing import Callable, Iterator, List

import pytest

from etcd_agent.config import SshSection
from tests.harness import bedlock
from tests.harness.netns import NetnsBed
from tests.harness.rgw import RgwBed, session_bed

# this tier's own bed; other suites use other prefixes and subnets so beds can coexist
BED_PREFIX = "ea"
BED_SUBNET = "10.213.1"
CONNECT_TIMEOUT = 2.0


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
