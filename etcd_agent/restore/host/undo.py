"""A member's restore undone on its host (the halves of ``NodeRestore.rollback``), and the work
dir's housekeeping: the old data dir and files put back, the restored data kept aside, the staged
snapshot dropped. Nothing here deletes old data."""
from __future__ import annotations

import os
import shutil
from typing import List

from etcd_agent.config import Config
from etcd_agent.fs import remove_stale_parts, write_atomic
from etcd_agent.hosts.base import Host
from etcd_agent.member.local import Backend
from etcd_agent.node import replies as R
from etcd_agent.restore.host import journal as J
from etcd_agent.restore.host.receive import RECEIVED, SNAPSHOT
from etcd_agent.restore.host.setaside import free_name

CONF_ORIG = "conf.orig"  # etcd.conf as it was before `repair` rewrote it


def data(j: J.Journal, did: List[str], data_dir: str, backend: Backend) -> None:
    """etcd stopped if this op touched its data (left running if not); the old data dir put
    back, the restored one kept aside as failed-restore."""
    aside, pend = j.record(R.AsideReply), j.pending.get("aside")
    moved = (aside.moved if aside else None) or (pend.target if pend else None)
    installed = j.done("install") or "install" in j.pending
    # a failure before the data dir was touched (shipping, fencing, stopping) has nothing of
    # etcd's to undo: a member still running on its own data is left running, not restarted
    # (``restore`` only staged beside it, with etcd serving). A halted one may still be
    # exiting: its exit is waited for, then it is started again by the caller.
    touched = any(j.done(s) or s in j.pending for s in ("halt", "aside", "install", "chown", "repair", "start"))
    if touched or not backend.is_active():
        backend.stop(30.0)
        did.append("etcd stopped")
    else:
        did.append("etcd left running: its data dir was never touched")
    tmp = f"{data_dir}.restoring"
    staged = (j.pending.get("restore") or J.Pending()).output, (j.record(R.RestoreReply) or R.RestoreReply()).output
    if os.path.lexists(tmp) and tmp in staged:
        shutil.rmtree(tmp)  # our own output, staged and never moved in
        did.append(f"staged {tmp} removed")
    if isinstance(moved, str) and os.path.lexists(moved):
        if os.path.lexists(data_dir):
            failed = free_name(data_dir, "failed-restore")
            os.rename(data_dir, failed)
            did.append(f"restored data moved to {failed}")
        os.rename(moved, data_dir)
        did.append(f"{moved} moved back to {data_dir}")
    elif installed and os.path.lexists(data_dir):
        failed = free_name(data_dir, "failed-restore")
        os.rename(data_dir, failed)
        did.append(f"no old data dir; restored data moved to {failed}")


def files(j: J.Journal, did: List[str], cfg: Config, member: str, work_dir: str, host: Host) -> None:
    """etcd.conf and the unit as they were before this op."""
    rep = j.record(R.RepairReply) or R.RepairReply()
    conf = cfg.conf_file(member)
    orig = os.path.join(work_dir, CONF_ORIG)
    if rep.conf_saved and os.path.isfile(orig):
        with open(orig, "rb") as fh:
            write_atomic(conf, fh.read(), mode=0o644)
        did.append(f"{conf} restored")
    elif rep.conf_created and os.path.isfile(conf):
        os.unlink(conf)  # there was none before: leave the host as it was
        did.append(f"{conf} (rendered by this restore) removed")
    if rep.unit_created and os.path.isfile(cfg.etcd.unit_file):
        os.unlink(cfg.etcd.unit_file)
        host.run(["systemctl", "daemon-reload"], timeout=60, check=False)
        did.append(f"{cfg.etcd.unit_file} (rendered by this restore) removed")


def drop_payload(work_dir: str) -> None:
    """The snapshot copy is large and has served; the journal stays until the next restore.
    Temp files of receivers that died go too (a live receiver's stays: it is locked)."""
    for n in (SNAPSHOT, RECEIVED):
        try:
            os.unlink(os.path.join(work_dir, n))
        except FileNotFoundError:
            pass
    remove_stale_parts(work_dir, SNAPSHOT)


def clear_work_dir(work_dir: str) -> None:
    """The files a finished or rolled-back restore left in the work dir (not its sub-dirs)."""
    for n in os.listdir(work_dir):
        p = os.path.join(work_dir, n)
        if os.path.isfile(p) and not os.path.islink(p):
            os.unlink(p)
