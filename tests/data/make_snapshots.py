"""How tests/data/*.db were made: real etcd snapshots of tiny loopback clusters (run by hand).

    python tests/data/make_snapshots.py [/opt/etcd/3.5.16]

- snap-a.db         cluster "a": members m1..m3, peer URLs 127.0.0.1:17380/17382/17384, token tok-a
- snap-a-reboot.db  the same names and peer URLs re-bootstrapped by hand with token tok-a2 (other ids)
- snap-b.db         another cluster: members x1..x3 on 127.0.0.1:17390/17392/17394, token tok-b
- snap-a-34.db      cluster "a" again, made by etcd 3.4.23 (/usr/bin/etcd)
- snap-a-r12.db     cluster "a" (the ids of snap-a.db), 9 more puts: revision 12, another revision
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def make(etcd_dir: str, names, peers, token: str, out: str, more: int = 0) -> None:
    etcd = os.path.join(etcd_dir, "etcd")
    ctl = os.path.join(etcd_dir, "etcdctl")
    base = tempfile.mkdtemp()
    ic = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(names, peers))
    procs = []
    try:
        for n, p in zip(names, peers):
            c = p + 1000
            procs.append(subprocess.Popen(
                [etcd, "--name", n, "--data-dir", f"{base}/{n}", "--listen-client-urls", f"http://127.0.0.1:{c}",
                 "--advertise-client-urls", f"http://127.0.0.1:{c}", "--listen-peer-urls", f"http://127.0.0.1:{p}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}", "--initial-cluster", ic,
                 "--initial-cluster-token", token, "--initial-cluster-state", "new"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        ep = f"http://127.0.0.1:{peers[0] + 1000}"
        env = dict(os.environ, ETCDCTL_API="3")
        for _ in range(100):
            if subprocess.run([ctl, "--endpoints", ep, "put", "k", "v"], env=env, capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        subprocess.run([ctl, "--endpoints", ep, "put", "/registry/secrets/default/s", "x" * 100], env=env, check=True,
                       capture_output=True)
        for i in range(more):
            subprocess.run([ctl, "--endpoints", ep, "put", f"/registry/more/{i}", "y" * 10], env=env, check=True,
                           capture_output=True)
        subprocess.run([ctl, "--endpoints", ep, "snapshot", "save", out], env=env, check=True, capture_output=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    d = sys.argv[1] if len(sys.argv) > 1 else "/opt/etcd/3.5.16"
    a = ([f"m{i}" for i in (1, 2, 3)], [17380, 17382, 17384])
    make(d, *a, "tok-a", os.path.join(HERE, "snap-a.db"))
    make(d, *a, "tok-a2", os.path.join(HERE, "snap-a-reboot.db"))
    make(d, [f"x{i}" for i in (1, 2, 3)], [17390, 17392, 17394], "tok-b", os.path.join(HERE, "snap-b.db"))
    make("/usr/bin", *a, "tok-a", os.path.join(HERE, "snap-a-34.db"))
    make(d, *a, "tok-a", os.path.join(HERE, "snap-a-r12.db"), more=9)
