"""Archive bombs in the backup dir of a real cluster, met by the commands an operator types:
`restore --from X --dry-run`, `restore --from X --yes`, `backup verify X`, `backup list`,
`status`, a new `backup`. Each refuses in one line (or lists the file as one bad line) and writes
at most 1 MiB while it does - the reader refuses as it streams, before a byte is staged. The unit
tier proves the same on the reader alone (tests/unit/test_reader.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Callable, Dict, List, Tuple

import pytest

from etcd_agent.member.process import ProcessBackend
from tests.harness.bombs import gzip_bomb, sparse_bomb
from tests.harness.loopback import LoopbackCluster

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20

# the CLI in a fresh interpreter, with the bytes it hands to write(2) counted from /proc/self/io
# (stdout and stderr included: the count is an upper bound of what reached the disk)
_RUN = (
    "import json, sys\n"
    "def wchar():\n"
    "    for line in open('/proc/self/io'):\n"
    "        if line.startswith('wchar:'):\n"
    "            return int(line.split()[1])\n"
    "from etcd_agent.cli.main import main\n"
    "before = wchar()\n"
    "rc = main(sys.argv[1:])\n"
    "sys.stdout.flush(); sys.stderr.flush()\n"
    "sys.stderr.write('\\nWCHAR ' + json.dumps({'rc': rc, 'written': wchar() - before}) + '\\n')\n"
    "sys.exit(rc)\n"
)


def run(cfg_path: str, *args: str) -> Tuple[int, int, str, str]:
    """(exit code, bytes written, stdout, stderr without the count line)."""
    p = subprocess.run([sys.executable, "-c", _RUN, "-c", cfg_path, *args], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    head, sep, tail = p.stderr.rpartition("\nWCHAR ")
    assert sep and tail, f"no count line; exit {p.returncode}: {p.stderr[-2000:]}"
    res: Dict[str, Any] = json.loads(tail)
    assert res["rc"] == p.returncode
    return p.returncode, int(res["written"]), p.stdout, head.strip()


def data_state(c: LoopbackCluster) -> List[Tuple[str, int, int]]:
    """Each member's data dir and db inode, and its etcd's pid: what a refused restore must keep."""
    out = []
    for m in c.cfg.members:
        d = c.cfg.data_dir(m.name)
        out.append((m.name, os.stat(d).st_ino, os.stat(os.path.join(d, "member", "snap", "db")).st_ino))
        out.append((f"pid {m.name}", ProcessBackend(c.cfg, m.name).pid() or 0, 0))
    return out


def test_bombs_in_the_backup_dir_cost_nothing(cluster_factory: Callable[..., LoopbackCluster], tmp_path: Any,
                                               capsys: Any) -> None:
    c = cluster_factory(3)
    c.start_static()
    with c.client() as cl:
        for i in range(200):
            cl.put(f"/k/{i:04d}", b"v")
    bdir = c.cfg.backup.dir
    os.makedirs(bdir, mode=0o700, exist_ok=True)
    # the runbook's names, gzip inside a .tar name as `tar czf` leaves it
    bombs = {"sparse (gnu)": os.path.join(bdir, "etcd-2019-08-05.tar"),
             "sparse (posix)": os.path.join(bdir, "etcd-2019-08-06.tar"),
             "gzip": os.path.join(bdir, "etcd-2019-08-07.tar")}
    os.rename(sparse_bomb(str(tmp_path / "gnu"), "gnu"), bombs["sparse (gnu)"])
    os.rename(sparse_bomb(str(tmp_path / "posix"), "posix"), bombs["sparse (posix)"])
    gzip_bomb(bombs["gzip"], (8 << 30) + 32)
    before = data_state(c)
    figures = []

    for label, path in bombs.items():
        size = os.path.getsize(path)
        for args in (("restore", "--from", path, "--dry-run"), ("restore", "--from", path, "--yes"),
                     ("backup", "verify", path)):
            rc, written, out, err = run(c.config_path, *args)
            # restore refuses on stderr in one line; verify reports on stdout, its verdict first
            lines = [ln for ln in (err or out).splitlines() if ln.strip()]
            assert rc in (1, 3), (label, args, rc, out, err)
            assert "Traceback" not in err + out and lines, (label, args, out, err)
            # restore: one sentence, then at most its details ("  - ...")
            assert args[0] == "backup" or all(ln.startswith("  - ") for ln in lines[1:]), (label, args, err)
            assert written <= MiB, (label, args, written)
            assert data_state(c) == before, (label, args)
            figures.append(f"{label} {size} B, `{' '.join(a if a != path else os.path.basename(a) for a in args)}`: "
                           f"exit {rc}, {written} B written - {lines[0].replace(bdir + '/', '')[:150]}")
        assert not [n for n in os.listdir(bdir) if n.endswith((".partial", ".part")) or n.startswith(".stage")]

    # the whole dir: listed as bad lines, never `latest`; a new backup and status go on
    rc, written, out, err = run(c.config_path, "backup", "list")
    assert rc == 0 and written <= MiB and "Traceback" not in err, (out, err)
    for path in bombs.values():
        line = next(ln for ln in out.splitlines() if os.path.basename(path) in ln)
        assert "quarantined" in line or "corrupt" in line or "not" in line, line
    rc, written, out, err = run(c.config_path, "backup")
    assert rc == 0, err
    made = out.strip().splitlines()[-1]
    assert os.path.isfile(made) and os.path.basename(made) not in [os.path.basename(p) for p in bombs.values()]
    assert all(os.path.exists(p) for p in bombs.values()), "retention took a hostile file for a backup"
    rc, _written, out, err = run(c.config_path, "status")
    assert rc == 0 and "Traceback" not in err, (out, err)
    rc, _written, out, err = run(c.config_path, "restore", "--from", "latest", "--dry-run")
    assert rc == 0 and os.path.basename(made) in out, (out, err)
    with c.client() as cl:
        assert cl.count_prefix("/k/") == 200
    with capsys.disabled():
        print("\nFIGURE bombs through the CLI on a real cluster:\n  " + "\n  ".join(figures))


def test_every_command_that_reads_a_backup_meets_each_hostile_file_in_one_sentence(
        cluster_factory: Callable[..., LoopbackCluster], tmp_path: Any, capsys: Any) -> None:
    """Each command an operator types that reads a backup, against each hostile file: the bombs,
    an encrypted backup met without its key or with a wrong one, its ciphertext flipped, its file
    cut short. An exit code and one sentence, never a traceback; nothing of the cluster touched."""
    import dataclasses
    import shutil
    import tarfile

    from etcd_agent.backup.service import take_backup
    from tests.integration.test_backup_age import keypair

    _key, recipient = keypair(tmp_path, "ops.key")
    wrong, _ = keypair(tmp_path, "wrong.key")
    c = cluster_factory(1, extra=f'[drill]\ndir = "{tmp_path}/drill"\nmetrics_file = "{tmp_path}/drill.prom"\n')
    c.start_static()
    with c.client() as cl:
        for i in range(200):
            cl.put(f"/k/{i:04d}", b"v" * 100)
    enc_cfg = dataclasses.replace(c.cfg, backup=dataclasses.replace(c.cfg.backup, encrypt_to=(recipient,)))
    sealed = take_backup(enc_cfg, member="m1", prune=False).path
    bdir = c.cfg.backup.dir
    hostile = {"encrypted": sealed}
    for label, name in (("encrypted, ciphertext flipped", "etcd-2019-08-08.tar"),
                        ("encrypted, cut short", "etcd-2019-08-09.tar")):
        hostile[label] = os.path.join(bdir, name)
        shutil.copy(sealed, hostile[label])
    with tarfile.open(sealed) as tar:
        member = tar.getmember("etcd_snapshot.db.age")
        middle = member.offset_data + member.size // 2
    with open(hostile["encrypted, ciphertext flipped"], "r+b") as fh:
        fh.seek(middle)
        byte = fh.read(1)
        fh.seek(middle)
        fh.write(bytes([byte[0] ^ 1]))
    os.truncate(hostile["encrypted, cut short"], middle)
    hostile["sparse (gnu)"] = os.path.join(bdir, "etcd-2019-08-05.tar")
    os.rename(sparse_bomb(str(tmp_path / "gnu"), "gnu"), hostile["sparse (gnu)"])
    hostile["gzip"] = os.path.join(bdir, "etcd-2019-08-07.tar")
    gzip_bomb(hostile["gzip"], (8 << 30) + 32)
    before = data_state(c)
    figures = []

    for label, path in hostile.items():
        for args in (("restore", "--from", path, "--dry-run"), ("restore", "--from", path, "--yes"),
                     ("restore", "--from", path, "--to-revision", "1", "--dry-run"),
                     ("restore", "--from", path, "--dry-run", "--identity", wrong),
                     ("backup", "verify", path), ("backup", "verify", path, "--identity", wrong),
                     ("drill", "--from", path), ("drill", "--from", path, "--identity", wrong),
                     ("backup", "import", path, "--dry-run")):
            rc, written, out, err = run(c.config_path, *args)
            shown = " ".join(a if a != path else os.path.basename(a) for a in args)
            assert "Traceback" not in err + out, (label, shown, err)
            assert rc in (0, 1, 2, 3), (label, shown, rc, out, err)
            assert rc != 0 or (args[:2] == ("backup", "verify") and label == "encrypted" and len(args) == 3), \
                (label, shown, out)  # only the keyless check of the sound ciphertext passes
            # the verdict: verify and drill report on stdout, the others refuse on stderr
            said = [ln for ln in (out if args[0] in ("backup", "drill") and out.strip() else err).splitlines()
                    if ln.strip() and " drill: " not in ln]
            assert said, (label, shown, out, err)
            assert written <= MiB, (label, shown, written)
            assert data_state(c) == before, (label, shown)
            figures.append(f"{label}, `{shown}`: exit {rc} - {said[0].replace(bdir + '/', '')[:160]}")
    for args in (("backup", "list"), ("backup", "prune", "--dry-run"), ("status",), ("restore", "cleanup", "--dry-run")):
        rc, _written, out, err = run(c.config_path, *args)
        assert rc == 0 and "Traceback" not in err + out, (args, out, err)
    assert all(os.path.exists(p) for p in hostile.values())
    with c.client() as cl:
        assert cl.count_prefix("/k/") == 200
    with capsys.disabled():
        print("\nFIGURE hostile backups through every command that reads one:\n  " + "\n  ".join(figures))
