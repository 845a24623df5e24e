"""What this machine offers a scratch member: a free pair of loopback ports (never the kubelet's),
the flags its etcd binary knows, and the user it runs as (with the dirs that user must reach)."""
from __future__ import annotations

import functools
import logging
import os
import pwd
import random
import re
import socket
from typing import FrozenSet, Optional, Tuple

from etcd_agent.chain.errors import ScratchError
from etcd_agent.errors import CommandError
from etcd_agent.hosts.local import LocalHost

log = logging.getLogger(__name__)

PORT_RANGE = (10000, 21998)


# What a Kubernetes master listens on inside that range (kubelet 10248/10250/10255, kube-proxy
# 10249/10256, controller-manager 10257, scheduler 10259): free while that component restarts, and
# a throwaway etcd holding one then would keep it from coming back for the length of a drill.
KUBERNETES_PORTS = frozenset(range(10248, 10260))


def etcd_flags(binary: str) -> FrozenSet[str]:
    """The ``--flags`` that ``binary --help`` lists (empty when it cannot be run: the flags only
    some releases know are then left out, and a binary that does not run fails at its start)."""
    try:
        st = os.stat(binary)
    except OSError:
        return frozenset()
    return _flags_of(binary, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _flags_of(binary: str, _mtime_ns: int, _size: int) -> FrozenSet[str]:
    try:
        out = LocalHost().run([binary, "--help"], timeout=30, check=False,
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    except CommandError as exc:  # it could not start, or did not end
        log.info("cannot list the flags of %s: %s", binary, exc)
        return frozenset()
    return frozenset(re.findall(r"(?m)^\s*(--[a-z0-9][a-z0-9-]*)", out.stdout + out.stderr))


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def pick_ports(rng: Optional[random.Random] = None) -> Tuple[int, int]:
    """A (client, peer) pair of adjacent loopback ports, both free right now."""
    rng = rng or random.Random()
    for _ in range(1000):
        c = rng.randrange(PORT_RANGE[0], PORT_RANGE[1], 2)
        if c not in KUBERNETES_PORTS and c + 1 not in KUBERNETES_PORTS and _free(c) and _free(c + 1):
            return c, c + 1
    raise ScratchError(f"no free port pair in {PORT_RANGE[0]}-{PORT_RANGE[1]} after 1000 tries")


def run_as(user: Optional[str]) -> Optional[Tuple[int, int]]:
    """(uid, gid) to run as: only when we are root and the user exists."""
    if not user or os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        log.info("user %s does not exist; the scratch etcd runs as root", user)
        return None
    return pw.pw_uid, pw.pw_gid


def unreachable_by(path: str, uid: int, gid: int) -> Optional[str]:
    """The first directory from / down to ``path`` that ``uid``/``gid`` may not traverse."""
    p = os.path.abspath(path)
    parts = [p]
    while p != os.path.dirname(p):
        p = os.path.dirname(p)
        parts.append(p)
    for d in reversed(parts):
        st = os.stat(d)
        if st.st_uid == uid:
            ok = st.st_mode & 0o100
        elif st.st_gid == gid:
            ok = st.st_mode & 0o010
        else:
            ok = st.st_mode & 0o001
        if not ok:
            return d
    return None


def chown_tree(top: str, uid: int, gid: int) -> None:
    os.chown(top, uid, gid, follow_symlinks=False)
    for root, dirs, files in os.walk(top):
        for n in dirs + files:
            os.chown(os.path.join(root, n), uid, gid, follow_symlinks=False)
