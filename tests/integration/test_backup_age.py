"""Encrypted backups ([backup] encrypt_to) of a real etcd (the default release, 3.5.16, with etcdutl):
decrypted by hand with the `age` CLI to the very snapshot etcd sent, restored with --identity,
refused without it (nothing touched), with a wrong key, with a key file others can read;
a tampered ciphertext caught; verify without the key saying what it checked and what not."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from typing import Any, Dict, List, Tuple

import pytest

from etcd_agent import age
from etcd_agent.backup.service import take_backup
from etcd_agent.cli.main import main
from etcd_agent.member.process import ProcessBackend
from tests.harness.loopback import LoopbackCluster
from tests.harness.releases import DEFAULT, release
from tests.integration.test_restore_etcd35 import AGENT

pytestmark = pytest.mark.integration

AGE = shutil.which("age")
KEYS = 2_000


def keypair(d: Any, name: str) -> Tuple[str, str]:
    """(identity file 0600, recipient), made by the agent's code (the age CLI reads the same file)."""
    secret, recipient = age.generate_identity()
    path = os.path.join(str(d), name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"# public key: {recipient}\n{secret}\n")
    return path, recipient


def encrypted_cluster(cluster_factory: Any, *recipients: str) -> LoopbackCluster:
    to = ", ".join(f'"{r}"' for r in recipients)
    c = cluster_factory(3, extra=f'encrypt_to = [{to}]\n[ssh]\nagent_path = "{AGENT}"\n')
    c.start_static()
    with c.client() as cl:
        for i in range(KEYS):
            cl.put(f"/k/{i:06d}", os.urandom(256).hex().encode())  # a db of a few MB: many age chunks
    return c


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree_state(c: LoopbackCluster) -> List[Tuple[str, int, int]]:
    """What a refused restore must leave as it was. The backup dir: every file (path, size,
    mtime_ns). The members' data dirs: which inode each data dir, member dir and db is, and the
    pid of each running etcd -- not sizes or mtimes, which the live etcd changes on its own
    (a CI run saw member/snap/db's mtime move 0.1 s after the 100 writes above)."""
    out = []
    for root, _dirs, files in os.walk(c.cfg.backup.dir):
        for n in files:
            st = os.stat(os.path.join(root, n))
            out.append((os.path.join(root, n), st.st_size, st.st_mtime_ns))
    for m in c.cfg.members:
        d = c.cfg.data_dir(m.name)
        for p in (d, os.path.join(d, "member"), os.path.join(d, "member", "snap", "db")):
            out.append((p, os.stat(p).st_ino, 0))
        out.append((f"pid of {m.name}", ProcessBackend(c.cfg, m.name).pid() or 0, 0))
    return sorted(out)


def cli(c: LoopbackCluster, capsys: Any, *args: str) -> Tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["-c", c.config_path, *args])
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.mark.skipif(AGE is None, reason="the age CLI is not installed (packaging/install-deps.sh test installs it)")
def test_encrypted_backup_is_decrypted_by_hand_with_age(cluster_factory: Any, tmp_path: Any, capsys: Any) -> None:
    keyfile, recipient = keypair(tmp_path, "ops.key")
    _, other = keypair(tmp_path, "other.key")
    c = encrypted_cluster(cluster_factory, recipient, other)
    t = time.monotonic()
    b = take_backup(c.cfg, member="m1")
    took = time.monotonic() - t
    with tarfile.open(b.path) as tar:
        assert tar.getnames() == ["etcd.conf", "etcd.service", "etcd_snapshot.db.age", "manifest.json"]
    # the manual recovery of the README, verbatim: tar x, then age -d
    work = tmp_path / "by-hand"
    work.mkdir()
    subprocess.run(["tar", "xf", b.path], cwd=work, check=True)
    subprocess.run([str(AGE), "-d", "-i", keyfile, "-o", "etcd_snapshot.db", "etcd_snapshot.db.age"], cwd=work,
                   check=True)
    manifest = json.loads((work / "manifest.json").read_text())
    enc = manifest["encryption"]
    plain = str(work / "etcd_snapshot.db")
    assert enc["recipients"] == [recipient, other] and "AGE-SECRET-KEY" not in json.dumps(manifest).upper()
    assert sha256_file(plain) == enc["plaintext_sha256"] == b.sha256
    assert os.path.getsize(plain) == enc["plaintext_size"]
    ct = str(work / "etcd_snapshot.db.age")
    assert sha256_file(ct) == manifest["files"]["etcd_snapshot.db.age"]["sha256"]
    assert os.path.getsize(ct) == age.encrypted_size(enc["plaintext_size"], 2)
    # etcd's own check of its trailer and db: the decrypted file is a sound snapshot
    st = subprocess.run([str(release(DEFAULT).etcdutl), "snapshot", "status", plain, "-w", "json"], capture_output=True,
                        text=True, timeout=60, check=True)
    status: Dict[str, Any] = json.loads(st.stdout)
    assert status["revision"] == b.revision == manifest["revision"] and status["totalKey"] >= KEYS
    # the plaintext never reached the backup dir
    with open(plain, "rb") as fh:
        page = fh.read(8192)[4096:]
    assert page not in open(b.path, "rb").read()
    with capsys.disabled():
        print(f"\nFIGURE age-manual-decrypt: {enc['plaintext_size']} B db, {KEYS} keys, backup {took:.2f}s; "
              f"`tar xf` + `age -d -i ops.key`: sha256 {enc['plaintext_sha256'][:16]}... = manifest plaintext_sha256; "
              f"`etcdutl snapshot status`: revision {status['revision']}, {status['totalKey']} keys, "
              f"hash {status['hash']}")


def test_restore_needs_the_identity_and_checks_the_ciphertext(cluster_factory: Any, tmp_path: Any,
                                                              capsys: Any) -> None:
    keyfile, recipient = keypair(tmp_path, "ops.key")
    wrong, _ = keypair(tmp_path, "wrong.key")
    c = encrypted_cluster(cluster_factory, recipient)
    b = take_backup(c.cfg, member="m1")
    with c.client() as cl:
        for i in range(100):
            cl.put(f"/later/{i:06d}", b"w")

    # verify without the key: everything the ciphertext shows, and plainly what it cannot
    rc, out, _ = cli(c, capsys, "backup", "verify", b.path)
    assert rc == 0, out
    assert "encrypted (age), checked WITHOUT the key" in out.splitlines()[0]
    assert "sha256 of the ciphertext matches the manifest" in out and "manifest signature valid" in out
    assert "1 X25519 recipient stanza(s) = the recipients the manifest lists" in out
    assert "not checked: etcd_snapshot.db: encrypted and not decrypted (no --identity)" in out
    assert "not checked: `snapshot status` not run: the snapshot is encrypted" in out
    keyless = [ln.strip() for ln in out.splitlines()[1:]]
    rc, out, _ = cli(c, capsys, "backup", "verify", b.path, "--identity", keyfile)
    assert rc == 0 and "decrypted with the identity" in out.splitlines()[0], out
    assert "snapshot status ok on the decrypted copy" in out and "identity: " in out
    rc, out, _ = cli(c, capsys, "backup", "list")
    assert rc == 0 and "encrypted (age, to 1 recipient(s))" in out

    # restore without the key, with a wrong key, with a key file others can read: refused, untouched
    before = tree_state(c)
    refusals = {}
    os.chmod(wrong, 0o600)
    open_key = str(tmp_path / "open.key")
    shutil.copy(keyfile, open_key)
    os.chmod(open_key, 0o644)
    for label, extra in (("no identity", []), ("wrong identity", ["--identity", wrong]),
                         ("identity 0644", ["--identity", open_key])):
        rc, out, err = cli(c, capsys, "restore", "--from", b.path, "--yes", *extra)
        lines = err.strip().splitlines()
        assert rc == 3 and len(lines) == 1, (label, rc, err)
        refusals[label] = lines[0]
    assert "its snapshot is encrypted (age to age1" in refusals["no identity"]
    assert "pass --identity FILE" in refusals["no identity"] and "nothing touched" in refusals["no identity"]
    assert "none of the 1 key in identity file" in refusals["wrong identity"]
    assert refusals["identity 0644"].endswith(f"run chmod 600 {open_key}")
    assert tree_state(c) == before, "a refused restore touched files"
    with c.client() as cl:
        assert cl.count_prefix("/later/") == 100

    # a tampered copy: caught without the key (signed ciphertext sha256) and with it (chunk tag)
    bad = str(tmp_path / "tampered.tar")
    shutil.copy(b.path, bad)
    with tarfile.open(bad) as tar:
        member = tar.getmember("etcd_snapshot.db.age")
        at = member.offset_data + member.size // 2  # inside the payload: the structure stays valid
    with open(bad, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 1]))
    rc, out, _ = cli(c, capsys, "backup", "verify", bad)
    assert rc == 1 and "PROBLEM: " in out and "sha256 mismatch" in out, out
    rc, out, err = cli(c, capsys, "restore", "--from", bad, "--yes", "--identity", keyfile)
    assert rc == 1 and "fails authentication" in err, err
    assert tree_state(c) == before

    # the dry run's plan says the backup is encrypted and for whom; then the restore with the key
    rc, out, _ = cli(c, capsys, "restore", "--from", b.path, "--dry-run", "--identity", keyfile)
    assert rc == 0 and f"encrypted (age, to 1 recipient(s): {recipient[:12]}..." in out, out
    c.stop()
    for m in c.cfg.members:
        shutil.rmtree(c.cfg.data_dir(m.name))
    t = time.monotonic()
    rc, out, err = cli(c, capsys, "restore", "--from", b.path, "--yes", "--identity", keyfile)
    wall = time.monotonic() - t
    assert rc == 0, err
    with c.client() as cl:
        counts = [cl.count_prefix("/k/"), cl.count_prefix("/later/")]
    assert counts == [KEYS, 0]
    assert not [n for n in os.listdir(c.cfg.backup.dir) if n.startswith(".etcd-agent-stage")]  # staging gone
    with capsys.disabled():
        print("\nFIGURE age-verify-nokey: exit 0; " + " | ".join(keyless[:4]))
        for label, line in refusals.items():
            print(f"FIGURE age-restore-refused ({label}): exit 3: {line}")
        print("FIGURE age-tampered: verify without key exit 1 (ciphertext sha256), restore with key exit 1 "
              "(chunk authentication); nothing touched")
        print(f"FIGURE age-restore-identity: restore --identity wall time {wall:.2f}s; /k/ {counts[0]} keys back, "
              f"/later/ {counts[1]}")


def test_import_reencrypts_to_the_configured_recipients(cluster_factory: Any, tmp_path: Any, capsys: Any) -> None:
    keyfile, recipient = keypair(tmp_path, "ops.key")
    c = encrypted_cluster(cluster_factory, recipient)
    b = take_backup(c.cfg, member="m1")
    outside = str(tmp_path / "copy.tar")
    shutil.copy(b.path, outside)
    rc, _, err = cli(c, capsys, "backup", "import", outside)
    assert rc == 3 and "its snapshot is encrypted" in err and "--identity" in err, err
    # a config without encrypt_to: importing would store the snapshot in the clear
    plain_cfg = str(tmp_path / "plain.toml")
    with open(c.config_path) as fh, open(plain_cfg, "w") as out:
        out.write("".join(ln for ln in fh if not ln.startswith("encrypt_to")))
    capsys.readouterr()
    assert main(["-c", plain_cfg, "backup", "import", outside, "--identity", keyfile]) == 3
    assert "would store it in the clear" in capsys.readouterr().err
    rc, out, err = cli(c, capsys, "backup", "import", outside, "--identity", keyfile)
    assert rc == 0, err
    new = out.splitlines()[0]
    assert new != b.path and os.path.dirname(new) == c.cfg.backup.dir
    with tarfile.open(new) as tar:
        assert "etcd_snapshot.db.age" in tar.getnames()
        m = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
    assert m["encryption"]["recipients"] == [recipient] and m["imported"]["encrypted_to"] == [recipient]
    assert m["encryption"]["plaintext_sha256"] == b.sha256  # the same snapshot, a fresh file key
    with tarfile.open(b.path) as tar:
        old = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
    assert m["files"]["etcd_snapshot.db.age"]["sha256"] != old["files"]["etcd_snapshot.db.age"]["sha256"]
    rc, out, _ = cli(c, capsys, "backup", "verify", new, "--identity", keyfile)
    assert rc == 0, out
    with capsys.disabled():
        print(f"\nFIGURE age-import: without --identity exit 3; into a config without encrypt_to exit 3; "
              f"with it: {os.path.basename(new)} re-encrypted to {recipient[:12]}..., same plaintext sha256, "
              "new ciphertext; verify --identity exit 0")


def test_the_delta_chain_beside_encrypted_backups_is_encrypted_too(tmp_path: Any) -> None:
    """With encrypt_to the daemon's delta segments are age files to the same recipients (.seg.age):
    no file of the backup dir holds a Secret in the clear, and the distribution's age decrypts a
    segment by hand (the age file starts after the seal's 8 KiB) to a segment holding it."""
    from etcd_agent.chain.seal import SEAL_BLOCK
    from etcd_agent.waiting import poll
    from tests.integration.continuous import make_bed, start_all

    keyfile, recipient = keypair(tmp_path, "ops")
    d = make_bed(str(tmp_path / "bed"), 1, backup=f'encrypt_to = ["{recipient}"]\n')
    try:
        start_all(d)
        backup_dir = d.c.cfg.backup.dir

        def segments() -> List[str]:
            return sorted(n for n in os.listdir(backup_dir) if ".seg" in n) if os.path.isdir(backup_dir) else []

        poll(lambda: bool(segments()), timeout=60, what="the first segment")
        with d.c.client() as cl:
            for i in range(50):
                cl.put(f"/registry/secrets/default/s{i}", b"s3cr3t-%d" % i)
        poll(lambda: len(segments()) >= 3, timeout=60, what="segments after the writes")
        time.sleep(2.0)
        names = segments()
        assert names and all(n.endswith(".seg.age") for n in names), names
        for dirpath, _dirs, files in os.walk(backup_dir):
            for n in files:
                with open(os.path.join(dirpath, n), "rb") as fh:
                    assert b"s3cr3t" not in fh.read(), n
        plains = []
        for n in names:
            out = subprocess.run(f"tail -c +{SEAL_BLOCK + 1} '{os.path.join(backup_dir, n)}' | age -d -i '{keyfile}'",
                                 shell=True, capture_output=True, check=True).stdout
            assert out.startswith(b"ETCDDSEG"), n
            plains.append(out)
        assert any(b"s3cr3t-49" in p for p in plains)
        name = d.c.cfg.members[0].name
        assert "continuous backup is off" not in d.log(name)

        # encrypt_to removed and the daemon reloaded: the open segment closes, the chain goes on in
        # the clear, and it is still one chain that checks end to end
        import signal

        from etcd_agent.chain import chains

        with open(d.c.config_path) as fh:
            text = fh.read()
        with open(d.c.config_path, "w") as fh:
            fh.write(text.replace(f'encrypt_to = ["{recipient}"]\n', ""))
        os.kill(d.procs[name].pid, signal.SIGHUP)
        with d.c.client() as cl:
            cl.put("/registry/configmaps/default/after", b"plain-now")
        poll(lambda: any(n.endswith(".seg") for n in segments()), timeout=60, what="a plain segment after the reload")
        assert "encrypt_to changed" in d.log(name)
        scan = chains.scan(backup_dir)
        mine = [ch for ch in scan.chains if ch.encrypted]
        assert len(mine) == 1 and mine[0].stop is None and mine[0].usable == len(mine[0].paths), \
            [ch.describe() for ch in scan.chains]
        assert mine[0].encrypted < len(mine[0].paths)
        print(f"\nFIGURE age-delta: {len(names)} segments, all .seg.age, none holds a plaintext byte of the "
                  f"Secrets; age -d by hand gives the v1 segments ({sum(map(len, plains))} bytes)")
    finally:
        d.stop()
        d.c.stop()


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 1]))


def test_a_copied_encrypted_backup_with_to_revision_is_read_with_the_identity(tmp_path: Any) -> None:
    """A full backup copied into the backup dir (no check of this host remembers its revision) and
    encrypted: with --identity its revision is read by decrypting it, and the point-in-time restore
    goes on; a wrong key, a flipped ciphertext byte, a damaged seal (the age header's MAC) and a
    file cut short are each named in one sentence, exit 3, nothing touched."""
    from tests.integration.continuous import (
        agent,
        full_backups,
        make_bed,
        put,
        rpc,
        start_all,
        wait_durable,
        wait_watching,
    )

    keyfile, recipient = keypair(tmp_path, "ops.key")
    wrong, _ = keypair(tmp_path, "wrong.key")
    d = make_bed(str(tmp_path / "bed"), 1, backup=f'encrypt_to = ["{recipient}"]\n')
    try:
        start_all(d)
        c = d.c
        wait_watching(c)
        full = full_backups(c)[0]
        r = rpc(c)
        target = 0
        for i in range(30):
            target = put(r, f"/pitr/{i:03d}", b"v")
        wait_durable(c, target)
        d.stop()
        # copied here from elsewhere: a new inode, so no check of this host knows its revision
        path = os.path.join(c.cfg.backup.dir, full)
        shutil.copy2(path, str(tmp_path / "copy"))
        os.replace(str(tmp_path / "copy"), path)
        with tarfile.open(path) as tar:
            member = tar.getmember("etcd_snapshot.db.age")
            start, size = member.offset_data, member.size
        with open(path, "rb") as fh:
            fh.seek(start)
            head = fh.read(4096)
        mac_at = start + head.index(b"\n--- ") + len(b"\n--- ") + 5  # a base64 character of the header MAC
        damaged = {}
        for label in ("ciphertext flipped", "seal damaged", "cut short"):
            damaged[label] = str(tmp_path / f"{label.replace(' ', '-')}.tar")
            shutil.copy(path, damaged[label])
        _flip(damaged["ciphertext flipped"], start + size // 2)
        with open(damaged["seal damaged"], "r+b") as fh:
            fh.seek(mac_at)
            ch = fh.read(1)
            fh.seek(mac_at)
            fh.write(b"B" if ch == b"A" else b"A")
        os.truncate(damaged["cut short"], start + size // 2)
        # the age file cut short inside an archive written anew around it (a copy tool that stopped)
        damaged["age file cut short"] = str(tmp_path / "age-cut-short.tar")
        with tarfile.open(path) as src, tarfile.open(damaged["age file cut short"], "w") as dst:
            for ti in src.getmembers():
                data = src.extractfile(ti).read()  # type: ignore[union-attr]
                if ti.name == "etcd_snapshot.db.age":
                    data = data[:len(data) // 2]
                    ti.size = len(data)
                dst.addfile(ti, io.BytesIO(data))
        pitr_dir = os.path.join(c.cfg.backup.dir, ".pitr")

        def untouched() -> List[Tuple[str, int, int]]:
            """tree_state but the restore's lock files (their holder records); nothing staged left."""
            assert not [n for n in os.listdir(pitr_dir) if n != ".lock"] if os.path.isdir(pitr_dir) else True
            return [t for t in tree_state(c) if not t[0].endswith(".lock")]

        before = untouched()

        said = {}
        for label, src, key in (("wrong identity", path, wrong), *((lb, p, keyfile) for lb, p in damaged.items())):
            res = agent(c, "restore", "--from", src, "--to-revision", str(target), "--dry-run", "--identity", key)
            lines = [ln for ln in res.stderr.splitlines() if ln.strip() and " restore: " not in ln]
            assert res.returncode == 3 and len(lines) == 1, (label, res.returncode, res.stderr)
            assert "Traceback" not in res.stderr and "unknown without reading it" not in lines[0], (label, lines)
            said[label] = lines[0]
            assert untouched() == before, label
        assert "none of the 1 key in identity file" in said["wrong identity"]
        assert "fails authentication" in said["ciphertext flipped"]
        assert "header MAC does not match" in said["seal damaged"]
        assert "truncated" in said["cut short"]
        assert "incomplete stream" in said["age file cut short"] or "truncated" in said["age file cut short"]

        res = agent(c, "restore", "--from", full, "--to-revision", str(target), "--dry-run", "--identity", keyfile)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"reached revision {target}" in res.stdout, res.stdout
        assert untouched() == before
        print("\nFIGURE copied encrypted backup, --to-revision with --identity: exit 0, replayed to revision "
              f"{target}")
        for label, line in said.items():
            print(f"FIGURE copied encrypted backup, {label}: exit 3: {line}")
    finally:
        d.stop()
        d.c.stop()
