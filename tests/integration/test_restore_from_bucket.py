"""`restore --from-bucket` (issue 33 items 1, 2, 6) on a real S3 server (Ceph RGW): a daemon copies
its full backup and delta chain to the bucket while keys are written; then the member's data dir,
its backup dir and the manifest key beside the config are destroyed (new hosts: only agent.toml and
the bucket's credentials); the key is kept "off-host". One command restores from the bucket:
``--to newest`` brings back every key, ``--to-revision N`` equals the live ``Range(rev=N)`` read
before the disaster. Faults: the wrong key file, another cluster's backup under the prefix, a
forged segment, wrong credentials - each refused in one sentence before the member is touched,
nothing written outside the staging dir, no credential in any output."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from datetime import datetime, timedelta, timezone
from typing import Any, List

import pytest

from etcd_agent.bucket import client as remotebucket
from etcd_agent.etcd.rpc import EtcdRpc
from tests.harness.rgw import RgwBed
from tests.integration.continuous import (
    agent,
    dump,
    full_backups,
    put,
    rpc,
    segment_files,
    wait_durable,
    wait_for,
)
from tests.integration.test_bucket_queue import landed, names, started
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_pitr_checkpoints import user_keys
from tests.integration.test_pitr_disaster import live_at

pytestmark = pytest.mark.integration


BED_MEMBERS = 1


def _tree(path: str) -> List[str]:
    out = []
    for root, dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in dirs + files]
    return sorted(out)


def _disaster(d: Any, c: Any, offsite: str) -> str:
    """The daemon stopped, etcd killed, its data dir, backup dir and manifest key gone; the key
    kept at ``offsite`` first. Returns the key's copy."""
    from etcd_agent.backup.keys import key_path

    d.stop()
    key = os.path.join(offsite, "manifest.key")
    os.makedirs(offsite, mode=0o700, exist_ok=True)
    shutil.copy2(key_path(c.cfg), key)
    os.chmod(key, 0o600)
    for lm in c.members:
        pid = lm.backend.pid()
        if pid:
            os.kill(pid, signal.SIGKILL)
    for m in c.cfg.members:
        shutil.rmtree(c.cfg.data_dir(m.name), ignore_errors=True)
    shutil.rmtree(c.cfg.backup.dir)
    os.unlink(key_path(c.cfg))
    return key


def _written(c: Any, n: int, prefix: str) -> int:
    r = rpc(c)
    rev = 0
    for i in range(n):
        rev = put(r, f"{prefix}{i:03d}", os.urandom(64).hex().encode())
    return rev


def test_every_master_gone_restored_from_the_bucket_alone(bed, rgw: RgwBed, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d, c, bucket = started(bed, rgw)
    mid = _written(c, 40, "/first/")
    last = _written(c, 40, "/second/")
    wait_durable(c, last)
    live_mid = user_keys(live_at(c.cfg.members[0].client_url, mid))
    live_last = user_keys(live_at(c.cfg.members[0].client_url, last))
    want = full_backups(c) + [os.path.basename(s) for s in segment_files(c)]
    wait_for(lambda: landed(rgw, bucket, want), 120, f"the {len(want)} files copied")
    key = _disaster(d, c, str(tmp_path / "offsite"))
    directory = c.cfg.backup.dir

    dry = agent(c, "--json", "restore", "--from-bucket", "latest", "--to", "newest", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    dry_doc = json.loads(dry.stdout)
    planned = dry_doc["bucket"]
    assert [(h["member"], h["problems"]) for h in dry_doc["hosts"]] == [("m1", [])], dry_doc["hosts"]
    kinds = [o["kind"] for o in planned["objects"]]
    assert kinds[0] == "full" and "segment" in kinds, planned
    # the hosts' sessions take their operation lock (.etcd-agent.lock in the backup dir), as any dry run's
    assert not os.path.exists(directory) or _tree(directory) == [".etcd-agent.lock"], "a dry run fetched"
    text = agent(c, "restore", "--from-bucket", "latest", "--to", "newest", "--dry-run")
    assert text.returncode == 0 and "fetch chains/" in text.stdout and "nothing fetched" in text.stdout, text.stdout
    assert "m1 (local): pre-check ok" in text.stdout, text.stdout

    # a newer copy of the full backup with no chain (a backup by hand at the same revision, which
    # the daemon's chain did not move onto): `latest --to newest` takes the chain that reaches furthest
    s3 = rgw.client()
    full_key = next(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="p/")["Contents"]
                    if o["Key"].endswith("/" + planned["backup"]))
    lone = "f" * 64
    newer = (datetime.now(timezone.utc) + timedelta(seconds=30)).strftime("etcd-%Y-%m-%d-%H-%M-%S.tar")
    s3.copy_object(Bucket=bucket, Key=f"p/chains/{lone}/{newer}", CopySource={"Bucket": bucket, "Key": full_key},
                   Metadata=s3.head_object(Bucket=bucket, Key=full_key)["Metadata"], MetadataDirective="REPLACE")
    res = agent(c, "restore", "--from-bucket", "latest", "--to", "newest", "--key-file", key, "--yes", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert lone not in res.stderr and planned["chain"] in res.stderr, res.stderr
    assert "manifest signature valid with the manifest key" in res.stderr, res.stderr
    assert "sha256 matches its metadata" in res.stderr, res.stderr
    wait_healthy(c.cfg, 1, 60)
    got = user_keys(dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0)))
    assert got == live_last, (len(got), len(live_last))
    assert sorted(o["file"] for o in planned["objects"]) == sorted(n for n in os.listdir(directory)
                                                                    if not n.startswith(".")), os.listdir(directory)
    assert not os.path.exists(os.path.join(directory, ".fetch")), _tree(directory)

    again = agent(c, "restore", "--from-bucket", "latest", "--to-revision", str(mid), "--key-file", key, "--yes",
                  timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already in" in again.stderr, again.stderr  # nothing fetched twice
    wait_healthy(c.cfg, 1, 60)
    got_mid = user_keys(dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0)))
    assert got_mid == live_mid, (len(got_mid), len(live_mid))
    for out in (dry.stdout, text.stdout, res.stdout, res.stderr, again.stderr):
        assert rgw.secret_key not in out
    print(f"\nFIGURE restore --from-bucket --to newest: {len(planned['objects'])} objects, "
          f"{planned['bytes']} bytes; {len(got)} keys back; --to-revision {mid}: {len(got_mid)} keys equal the live "
          "Range(rev)")


def test_what_is_not_this_clusters_is_refused_before_the_member_is_touched(bed, rgw: RgwBed, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d, c, bucket = started(bed, rgw)
    last = _written(c, 20, "/k/")
    wait_durable(c, last)
    want = full_backups(c) + [os.path.basename(s) for s in segment_files(c)]
    wait_for(lambda: landed(rgw, bucket, want), 120, f"the {len(want)} files copied")
    key = _disaster(d, c, str(tmp_path / "offsite"))
    directory = c.cfg.backup.dir
    data_dir = c.cfg.data_dir(c.cfg.members[0].name)
    s3 = rgw.client()
    prefix = remotebucket.expand_prefix("p/", c.cfg.cluster.name)

    def refused(*args: str, says: str, rc: int = 3) -> str:
        res = agent(c, "restore", "--from-bucket", "latest", *args, "--yes", timeout=300)
        assert res.returncode == rc, res.stdout + res.stderr
        assert says in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()[-1:]) == 1
        assert rgw.secret_key not in res.stdout + res.stderr
        assert not os.path.exists(data_dir), "the member was touched"
        left = [n for n in (_tree(directory) if os.path.isdir(directory) else []) if not n.startswith(".")]
        assert not left, f"written outside the staging dir: {left}"
        return str(res.stderr)

    # a key file of another cluster: the manifest is not signed with it
    other = tmp_path / "other.key"
    other.write_text("cd" * 32 + "\n")
    other.chmod(0o600)
    refused("--key-file", str(other), says="signed with another key than the key in")
    # a key file others can read: refused before anything else
    loose = tmp_path / "loose.key"
    shutil.copy(key, loose)
    loose.chmod(0o644)
    refused("--key-file", str(loose), says="chmod 600", rc=2)

    # a forged segment in the bucket (its bytes and their sha256 metadata replaced together): the
    # object passes its metadata check and the chain check refuses it
    sizes = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="p/")["Contents"]}
    seg = max((n for n in names(rgw, bucket) if n.endswith(".seg")), key=lambda n: sizes[f"p/{n}"])
    body = s3.get_object(Bucket=bucket, Key=f"p/{seg}")["Body"].read()
    forged = bytearray(body)
    forged[len(forged) // 2] ^= 0x01
    s3.put_object(Bucket=bucket, Key=f"p/{seg}", Body=bytes(forged),
                  Metadata={"sha256": hashlib.sha256(bytes(forged)).hexdigest()})
    refused("--to-revision", str(last), "--key-file", key, says="cannot be reached from")
    err = refused("--to", "newest", "--key-file", key, says="To restore up to its last good point, say so: --to-revision")
    assert "the chain stops at revision" in err, err
    s3.put_object(Bucket=bucket, Key=f"p/{seg}", Body=body, Metadata={"sha256": hashlib.sha256(body).hexdigest()})

    # another cluster's backup, newest under the prefix: its members are not this config's
    foreign_bed = bed(n=1)
    foreign_bed.c.start_static()
    foreign = agent(foreign_bed.c, "backup")
    assert foreign.returncode == 0, foreign.stdout + foreign.stderr
    tar = full_backups(foreign_bed.c)[-1]
    newest = (datetime.now(timezone.utc) + timedelta(seconds=60)).strftime("etcd-%Y-%m-%d-%H-%M-%S.tar")
    ahead = "etcd-2099-01-01-00-00-00.tar"  # dated ahead by a clock that jumped: never `latest`
    with open(os.path.join(foreign_bed.c.cfg.backup.dir, tar), "rb") as fh:
        blob = fh.read()
    for name in (newest, ahead):
        s3.put_object(Bucket=bucket, Key=f"{prefix}{name}", Body=blob,
                      Metadata={"sha256": hashlib.sha256(blob).hexdigest()})
    err = refused(says="another cluster layout")
    assert "--new-cluster" in err and newest in err, err
    assert not os.path.exists(os.path.join(directory, ".fetch", newest + ".part")), "refused bytes kept"
    res = agent(c, "restore", "--from-bucket", ahead, "--dry-run")
    assert res.returncode == 3 and "dated in the future by its name" in res.stderr, res.stdout + res.stderr


def test_wrong_credentials_are_one_sentence_and_keep_nothing(bed, rgw: RgwBed, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d, c, bucket = started(bed, rgw)
    wait_for(lambda: landed(rgw, bucket, full_backups(c)), 60, "the first full backup copied")
    _disaster(d, c, str(tmp_path / "offsite"))
    with open(c.config_path) as fh:
        text = fh.read()
    wrong = "not-the-secret-0123456789"
    with open(c.config_path, "w") as fh:
        fh.write(text.replace(f'secret_key = "{rgw.secret_key}"', f'secret_key = "{wrong}"'))
    res = agent(c, "restore", "--from-bucket", "latest", "--yes", timeout=120)
    assert res.returncode != 0, res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert wrong not in res.stdout + res.stderr and rgw.secret_key not in res.stdout + res.stderr
    assert not os.path.exists(c.cfg.data_dir(c.cfg.members[0].name))


def readme_block() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    m = re.search(r"<!-- bucket-disaster -->\s*```sh\n(.*?)```\s*<!-- /bucket-disaster -->", text, re.S)
    assert m, "the README lost its bucket-disaster block"
    return m.group(1)


def test_the_readme_walk_through_runs_verbatim(bed, rgw: RgwBed, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """README "Every master is gone": its block, line by line, on a master whose data dir, backup
    dir and manifest key are gone; ``etcd-agent`` on PATH reads this bed's config (on a master:
    /etc/etcd-agent/agent.toml), the key's off-host copy in the current directory."""
    from tests.integration.test_restore import AGENT

    d, c, bucket = started(bed, rgw)
    last = _written(c, 30, "/readme/")
    wait_durable(c, last)
    live = user_keys(live_at(c.cfg.members[0].client_url, last))
    want = full_backups(c) + [os.path.basename(s) for s in segment_files(c)]
    wait_for(lambda: landed(rgw, bucket, want), 120, f"the {len(want)} files copied")
    offsite = str(tmp_path / "offsite")
    _disaster(d, c, offsite)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "etcd-agent"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(AGENT)} -c {shlex.quote(c.config_path)} "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    res = subprocess.run(["bash", "-e", "-x", "-c", readme_block()], cwd=offsite, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "nothing fetched" in res.stdout and "restored from" in res.stdout, res.stdout
    got = user_keys(dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0)))
    assert got == live, (len(got), len(live))


def test_new_hosts_with_other_names_find_the_old_masters_folders(bed, rgw: RgwBed, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The default prefix (``etcd-backup/{cluster}/{host}/``) files each master's copies under its
    host name; the new masters may be named otherwise. The restore looks through every master's
    folder (a hostile folder name is not one), takes the newest, and fetches from that folder."""
    from tests.harness.rgw import remote_table
    from tests.integration.continuous import start_all, wait_watching

    bucket = rgw.new_bucket()
    d = bed(tables=remote_table(rgw, bucket, prefix="etcd-backup/{cluster}/{host}/", connect_timeout=2, read_timeout=20))
    start_all(d)
    wait_watching(d.c)
    c = d.c
    last = _written(c, 20, "/hosts/")
    wait_durable(c, last)
    live = user_keys(live_at(c.cfg.members[0].client_url, last))
    s3 = rgw.client()
    mine = remotebucket.expand_prefix("etcd-backup/{cluster}/{host}/", c.cfg.cluster.name)
    want = full_backups(c) + [os.path.basename(s) for s in segment_files(c)]

    def copied() -> bool:
        got = {o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects_v2(Bucket=bucket, Prefix=mine).get("Contents", [])}
        return all(f in got for f in want)

    wait_for(copied, 120, f"the {len(want)} files copied under {mine}")
    _disaster(d, c, str(tmp_path / "offsite"))
    old = f"etcd-backup/{c.cfg.cluster.name}/old-master-1/"
    for o in s3.list_objects_v2(Bucket=bucket, Prefix=mine)["Contents"]:  # the old master's folder
        head = s3.head_object(Bucket=bucket, Key=o["Key"])
        s3.copy_object(Bucket=bucket, Key=old + o["Key"][len(mine):], CopySource={"Bucket": bucket, "Key": o["Key"]},
                       Metadata=head["Metadata"], MetadataDirective="REPLACE")
        s3.delete_object(Bucket=bucket, Key=o["Key"])
    s3.put_object(Bucket=bucket, Key=f"etcd-backup/{c.cfg.cluster.name}/.hidden/etcd-2099-01-01-00-00-00.tar", Body=b"x",
                  Metadata={"sha256": hashlib.sha256(b"x").hexdigest()})
    res = agent(c, "restore", "--from-bucket", "latest", "--to", "newest", "--yes", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "chains/" in res.stderr and "old-master-1" in res.stderr, res.stderr
    wait_healthy(c.cfg, 1, 60)
    assert user_keys(dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0))) == live
