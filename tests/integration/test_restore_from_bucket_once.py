"""`restore --from-bucket ... --to-revision N` checks the chain once (issue 34 item 4): the staged
check of the fetched files (``stagedchecks``) is carried into the restore instead of the restore
verifying every segment's bytes again; a file swapped in the backup dir between that check and the
restore (another inode) is never restored on the strength of the carried check: it is checked
again, loudly, and refused when it is not the chain's. Counted in process on a real restore from
a real S3 server (Ceph RGW), the real ``check_chain`` wrapped by a counter."""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable, List, Tuple

import pytest

from etcd_agent.cli.main import main
from etcd_agent.etcd.rpc import EtcdRpc
from tests.harness.rgw import RgwBed
from tests.integration.continuous import dump, full_backups, segment_files, wait_durable, wait_for
from tests.integration.test_bucket_queue import landed, started
from tests.integration.test_daemon import wait_healthy
from tests.integration.test_pitr_checkpoints import user_keys
from tests.integration.test_pitr_disaster import live_at
from tests.integration.test_restore_from_bucket import _disaster, _written

pytestmark = pytest.mark.integration

BED_MEMBERS = 1


def _count_verified_checks(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """The real ``check_chain`` wherever a restore calls it, counting the calls that verify the
    segments' bytes (``verify=False`` reads headers and footers only: the outline)."""
    from etcd_agent.pitr import prepare, replayrun

    calls: List[int] = []
    real = prepare.check_chain

    def counted(*a: Any, **kw: Any) -> Any:
        if kw.get("verify", True):
            calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(prepare, "check_chain", counted)
    monkeypatch.setattr(replayrun, "check_chain", counted)
    return calls


def _gone(bed: Any, rgw: RgwBed, tmp_path: Any, **kw: Any) -> Tuple[Any, str, int, dict]:  # type: ignore[type-arg]
    """Every file copied to the bucket, then the master's data dir, backup dir and key gone."""
    _d, c, bucket = started(bed, rgw, **kw)
    mid = _written(c, 30, "/first/")
    last = _written(c, 30, "/second/")
    wait_durable(c, last)
    live_mid = user_keys(live_at(c.cfg.members[0].client_url, mid))
    want = full_backups(c) + [os.path.basename(s) for s in segment_files(c)]
    wait_for(lambda: landed(rgw, bucket, want), 120, f"the {len(want)} files copied")
    key = _disaster(_d, c, str(tmp_path / "offsite"))
    return c, key, mid, live_mid


def test_the_chain_is_checked_once_per_restore_from_the_bucket(bed, rgw: RgwBed, tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                                                                capsys) -> None:
    c, key, mid, live_mid = _gone(bed, rgw, tmp_path)
    calls = _count_verified_checks(monkeypatch)

    rc = main(["-c", c.config_path, "restore", "--from-bucket", "latest", "--to-revision", str(mid),
               "--key-file", key, "--yes"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert len(calls) == 1, f"the chain was verified {len(calls)} times in one restore from the bucket"
    assert "checked once, before it was let in" in err, err
    wait_healthy(c.cfg, 1, 60)
    assert user_keys(dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0))) == live_mid

    # --from the file now in the backup dir: one check too (the restore's own)
    calls.clear()
    fetched = full_backups(c)[0]
    assert main(["-c", c.config_path, "restore", "--from", fetched, "--to-revision", str(mid), "--yes"]) == 0, \
        capsys.readouterr().err
    assert len(calls) == 1, f"the chain was verified {len(calls)} times in one restore --from"


def _swapping(monkeypatch: pytest.MonkeyPatch, swap: Callable[[str], None]) -> None:
    """``swap`` run on the backup dir's first segment right before the restore proper opens its
    source: after the fetch checked and let the files in."""
    from etcd_agent.restore.orchestrator import orchestrate

    real = orchestrate.restore

    def swapped_first(cfg: Any, opts: Any) -> Any:
        from etcd_agent.chain.segments import list_segments

        swap(list_segments(cfg.backup.dir)[0])
        return real(cfg, opts)

    monkeypatch.setattr(orchestrate, "restore", swapped_first)


def test_a_file_swapped_after_the_check_is_checked_again_and_refused(bed, rgw: RgwBed, tmp_path,  # type: ignore[no-untyped-def]
                                                                     monkeypatch, capsys) -> None:
    c, key, mid, _live = _gone(bed, rgw, tmp_path)
    calls = _count_verified_checks(monkeypatch)

    def forged(path: str) -> None:  # another file under the name: a copy with one byte changed
        tmp = path + ".swap"
        shutil.copyfile(path, tmp)
        with open(tmp, "r+b") as fh:
            fh.seek(os.path.getsize(tmp) // 2)
            b = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([b[0] ^ 0xFF]))
        os.replace(tmp, path)

    _swapping(monkeypatch, forged)
    rc = main(["-c", c.config_path, "restore", "--from-bucket", "latest", "--to-revision", str(mid),
               "--key-file", key, "--yes"])
    err = capsys.readouterr().err
    assert rc != 0, err
    assert "not the file that was checked" in err, err
    assert len(calls) == 2, f"{len(calls)} verified chain check(s): the swapped file was not checked again"
    assert "nothing touched" in err, err
    assert not os.path.exists(c.cfg.data_dir(c.cfg.members[0].name)), "the member was touched"


def test_an_encrypted_chain_is_checked_once_too(bed, rgw: RgwBed, tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Its segments decrypted once, by the staged check, into the private dir the restore then
    replays from (not decrypted, nor checked, again); that dir gone when the restore ends."""
    from etcd_agent.pitr.workdirs import private_dir
    from tests.integration.test_backup_age import keypair

    identity, recipient = keypair(tmp_path, "id.txt")
    c, key, mid, live_mid = _gone(bed, rgw, tmp_path, backup=f'encrypt_to = ["{recipient}"]\n')
    calls = _count_verified_checks(monkeypatch)
    rc = main(["-c", c.config_path, "restore", "--from-bucket", "latest", "--to-revision", str(mid),
               "--key-file", key, "--identity", identity, "--yes"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert ".seg.age" in err, "the chain was not encrypted"
    assert len(calls) == 1, f"the encrypted chain was verified {len(calls)} times in one restore from the bucket"
    assert "checked once, before it was let in" in err, err
    wait_healthy(c.cfg, 1, 60)
    assert user_keys(dump(EtcdRpc(c.cfg.members[0].client_url, timeout=5.0))) == live_mid
    left = os.listdir(private_dir(c.cfg)) if os.path.isdir(private_dir(c.cfg)) else []
    assert not [n for n in left if n.startswith("etcd-open-")], f"decrypted segments left: {left}"


def test_bytes_changed_in_place_after_the_check_are_refused_by_the_replay(bed, rgw: RgwBed, tmp_path,  # type: ignore[no-untyped-def]
                                                                          monkeypatch, capsys) -> None:
    """The same inode, one byte changed: the carried check is taken (the file is the one checked),
    and the replay, which reads every segment again against the check's sha256, refuses it
    before any member is touched."""
    c, key, mid, _live = _gone(bed, rgw, tmp_path)
    calls = _count_verified_checks(monkeypatch)

    def flipped(path: str) -> None:
        ino = os.stat(path).st_ino
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            b = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([b[0] ^ 0xFF]))
        assert os.stat(path).st_ino == ino

    _swapping(monkeypatch, flipped)
    rc = main(["-c", c.config_path, "restore", "--from-bucket", "latest", "--to-revision", str(mid),
               "--key-file", key, "--yes"])
    err = capsys.readouterr().err
    assert rc != 0, err
    assert "checked once, before it was let in" in err and len(calls) == 1, err
    assert "changed during the replay" in err or "changed since the chain was checked" in err, err
    assert not os.path.exists(c.cfg.data_dir(c.cfg.members[0].name)), "the member was touched"
