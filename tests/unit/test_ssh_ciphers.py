"""hosts/ssh: the cipher order (AES-GCM first when both ends have it, nothing added) and what loading it imports."""
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


def test_loading_the_ssh_host_does_not_import_invoke() -> None:
    """paramiko would import invoke (~0.1 s of every restore's start) for ssh_config lines the
    agent never reads; a fresh interpreter shows it skipped and paramiko whole."""
    import subprocess
    import sys

    code = ("import sys, etcd_agent.hosts.ssh, paramiko; "
            "print(sys.modules.get('invoke') is None, paramiko.SSHClient.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "SSHClient"], out.stdout + out.stderr
