"""Archive bombs an attacker (or a broken tool) can leave in a backup dir: tiny files that
declare gigabytes. Built here once for the unit tier (the reader) and the integration tier (the
commands an operator types)."""
from __future__ import annotations

import gzip
import os
import subprocess
import tarfile


def sparse_bomb(work: str, fmt: str, declared: int = 8 << 30) -> str:
    """A ``tar --sparse`` archive (gzip inside) of an ``etcd_snapshot.db`` that is ``declared``
    bytes of holes: a few KB on disk. ``fmt`` is tar's --format (gnu or posix)."""
    os.makedirs(work, exist_ok=True)
    big = os.path.join(work, "etcd_snapshot.db")
    with open(big, "wb") as fh:
        fh.truncate(declared)
    out = os.path.join(work, f"sparse-{fmt}.tar.gz")
    subprocess.run(["tar", "--sparse", f"--format={fmt}", "-czf", out, "etcd_snapshot.db"], cwd=work, check=True,
                   timeout=300)
    os.unlink(big)
    return out


def gzip_bomb(path: str, declared: int) -> None:
    """A gzip of a tar whose etcd_snapshot.db is ``declared`` bytes of zeros: one member for the
    header, then the same 16 MiB-of-zeros gzip member repeated (gzip allows concatenation)."""
    ti = tarfile.TarInfo("etcd_snapshot.db")
    ti.size = declared
    header = ti.tobuf(format=tarfile.GNU_FORMAT)
    chunk = 16 << 20
    zero_member = gzip.compress(bytes(chunk), compresslevel=9)
    with open(path, "wb") as fh:
        fh.write(gzip.compress(header))
        for _ in range(declared // chunk):
            fh.write(zero_member)
