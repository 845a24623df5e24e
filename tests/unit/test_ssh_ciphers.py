"""hosts/ssh cipher order: AES-GCM first when both ends have it, nothing added (pure)."""
from __future__ import annotations

import paramiko

from etcd_agent.hosts.ssh import preferred_ciphers


def test_gcm_moves_to_the_front_and_nothing_else_changes() -> None:
    offered = ("aes128-ctr", "aes256-ctr", "aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
    assert preferred_ciphers(offered) == ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "aes128-ctr",
                                          "aes256-ctr")
    assert preferred_ciphers(("aes128-ctr", "aes256-ctr")) == ("aes128-ctr", "aes256-ctr")  # never added
    assert preferred_ciphers(()) == ()


def test_paramikos_own_list_gets_gcm_first() -> None:
    theirs = paramiko.Transport._preferred_ciphers
    mine = preferred_ciphers(theirs)
    assert mine[0] == "aes128-gcm@openssh.com" and sorted(mine) == sorted(theirs)
