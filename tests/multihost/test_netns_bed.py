"""The namespace harness itself: leftovers are cleaned, beds coexist, down() leaves nothing."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.harness.netns import NetnsBed

pytestmark = pytest.mark.multihost


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


def test_leftovers_cleaned_beds_coexist_and_down_is_complete(netns_bed: NetnsBed) -> None:
    crashed = NetnsBed(2, prefix="et", subnet="10.213.3")
    crashed.up()
    sleeper = crashed.popen(crashed.hosts[0], ["sleep", "60"])  # a process the "crash" left running
    # a new bed with the same prefix removes all of it first (no down() of the crashed one)
    with NetnsBed(1, prefix="et", subnet="10.213.3") as bed:
        assert sleeper.wait(timeout=10) is not None
        assert "et2" not in _netns() and "veth-et2" not in _links()
        assert not os.path.exists("/etc/netns/et2")
        h = bed.hosts[0]
        assert (h.name, h.netns, h.ip, h.etc_dir) == ("et1", "et1", "10.213.3.11", "/etc/netns/et1")
        # /etc/netns/<ns> files are seen as /etc inside the namespace
        assert bed.run(h, ["cat", "/etc/hostname"]).stdout == "et1\n"
        # coexists with the session bed (other prefix and subnet), which keeps working
        assert bed.run(netns_bed.hosts[0], ["ip", "-4", "-o", "addr", "show", "eth0"]).returncode == 0
        with pytest.raises(RuntimeError, match="already used"):
            NetnsBed(1, prefix="eu", subnet="10.213.3").up()
        assert "eu1" not in _netns()
        bed.set_link(h, False)
        assert "state DOWN" in subprocess.run(
            ["ip", "link", "show", "veth-et1"], capture_output=True, text=True
        ).stdout
        bed.set_link(h, True)
    assert "et1" not in _netns() and "veth-et" not in _links() and "br-et" not in _links()
    assert not os.path.exists("/etc/netns/et1") and not os.path.exists(bed.workdir)
    bed.down()  # idempotent
