"""A restore's snapshot through the OpenSSH client (``SshHost.spawn_stream``), under the same
trust as paramiko's connections: the configured known_hosts only (``StrictHostKeyChecking=yes``,
nothing written back, no ssh_config), the configured identity only (no agent), never a prompt.
The ciphers then run in C in a process of their own instead of in the agent under the GIL.
"""
from __future__ import annotations

import math
import re
import shutil
from typing import List, Optional

from etcd_agent.config import SshSection
from etcd_agent.errors import HostUnreachable

# Bulk ciphers first when the server has them: AES-GCM authenticates as it encrypts, where
# paramiko's default (aes128-ctr with an HMAC) costs about one CPU-second more per GiB shipped.
# Only the order changes: nothing is added, the server still has to offer it.
FAST_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
# The OpenSSH client's, for a restore's snapshot (``spawn_stream``): AES-GCM first (AES-NI), then
# the rest of what every OpenSSH since 6.5 speaks; never CBC or arcfour.
STREAM_CIPHERS = FAST_CIPHERS + ("chacha20-poly1305@openssh.com", "aes128-ctr", "aes192-ctr", "aes256-ctr")
# A path handed to the OpenSSH client in a ``-o`` option is split on blanks and has its ``%``
# and ``~`` expanded: one with anything else keeps the stream on paramiko.
OPENSSH_SAFE_PATH = re.compile(r"^/[A-Za-z0-9_./@+-]*$")


def client_argv(c: SshSection, address: str, where: str, keys: List[str], command: str) -> Optional[List[str]]:
    """The OpenSSH client's command line running ``command`` (quoted already) on the host at
    ``address`` (``where``, for messages) with the identity files ``keys``, or None when the
    stream stays on paramiko: ``ssh.stream = "paramiko"``, no client installed ("auto"), or a
    configured path the client would read differently."""
    client = None if c.stream == "paramiko" else shutil.which("ssh")
    if client is None:
        if c.stream == "openssh":
            raise HostUnreachable(f"{where}: ssh.stream is \"openssh\" but no ssh client is installed "
                                  "(install openssh-clients, or set ssh.stream = \"auto\")")
        return None
    paths = [c.known_hosts, *keys]
    if not keys or not all(OPENSSH_SAFE_PATH.match(p) for p in paths):
        if c.stream == "openssh":
            raise HostUnreachable(f"{where}: ssh.stream is \"openssh\" but the OpenSSH client cannot be given "
                                  f"{', '.join(paths) or 'an identity'} (set ssh.stream = \"auto\")")
        return None
    opts = {
        "BatchMode": "yes",
        "StrictHostKeyChecking": "yes",
        "UserKnownHostsFile": c.known_hosts,
        "GlobalKnownHostsFile": "/dev/null",
        "UpdateHostKeys": "no",
        "CheckHostIP": "no",
        "IdentitiesOnly": "yes",
        "IdentityAgent": "none",
        "PreferredAuthentications": "publickey",
        "ConnectTimeout": str(max(1, math.ceil(c.connect_timeout))),
        "Ciphers": ",".join(STREAM_CIPHERS),
        "ForwardAgent": "no",
        "ForwardX11": "no",
        "ClearAllForwardings": "yes",
        "LogLevel": "ERROR",
    }
    words = [client, "-F", "/dev/null", "-T", "-e", "none", "-p", str(c.port), "-l", c.user]
    for key in keys:
        words += ["-i", key]
    for name, value in opts.items():
        words += ["-o", f"{name}={value}"]
    return words + ["--", address, command]
