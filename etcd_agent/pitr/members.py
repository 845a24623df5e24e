"""A point-in-time restore's tail loaded into the restored members (``[backup.delta]
point_in_time_load``): every member restores the start snapshot itself - the newest checkpoint
the chain vouches for, else the full backup - and once the restored cluster serves, its
apiservers still fenced, the chain after that snapshot is written into it through etcd's API.
No throwaway member, no second db to save, ship and restore (docs/plan-fenced-load.md).

``Tail`` folds the chain in a thread from the moment the restore opened its source (while the
hosts open, pre-check, receive the snapshot, stop and restore), then ``load`` writes it: the
leases its puts name, deletes, puts, the lease rule, and a compaction at the final revision, so
that nothing reads or watches the restored cluster between its start snapshot and the target.

``record``/``read_record``: the small file that names a tail restore (full backup, target,
checkpoint) - the restore's journals name it as their backup, so that ``restore --from <it>``
resumes the restore as its message says."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Callable, Optional, Tuple

from etcd_agent.chain.errors import ReplayError
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.pitr import keyspace
from etcd_agent.pitr.leasefix import LeaseKeeper
from etcd_agent.pitr.leases import MIN_TTL
from etcd_agent.pitr.loadtail import CLUSTER, Batches, replay_result, target_ms, write_tail
from etcd_agent.pitr.prepare import Prepared
from etcd_agent.pitr.replay import ReplayResult
from etcd_agent.pitr.replayrun import Folding
from etcd_agent.pitr.workdirs import TAIL_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config

log = logging.getLogger(__name__)

RECORD_SUFFIX = ".tail"
RECORD_FORMAT = "etcd-agent-tail-1"
MAX_RECORD = 16 * 1024


def members_load(cfg: "Config") -> bool:
    """Whether a point-in-time restore loads its tail into the restored members: asked for, or
    ``auto`` with a fence that keeps the apiservers away until it is loaded."""
    way = cfg.backup.delta.point_in_time_load
    return way == "members" or (way == "auto" and cfg.kubernetes.fence != "none")


class Tail:
    """The chain after the start snapshot (at revision ``restored``), folded in a thread into a
    key space under ``work_parent`` (a private dir); ``staging``: the decrypted or fetched
    segments it reads, owned from now on and removed once folded (or at ``close``)."""

    def __init__(self, prep: Prepared, restored: int, work_parent: str, staging: Optional[str] = None,
                 memory_bytes: int = keyspace.DEFAULT_MEMORY) -> None:
        if restored < prep.plan.base_revision:
            raise ReplayError(f"the start snapshot is at revision {restored}, before its chain's base "
                              f"{prep.plan.base_revision}")
        self.prep = prep
        self.restored = restored
        self._staging = staging
        self._work = tempfile.mkdtemp(prefix=TAIL_PREFIX, dir=work_parent)  # 0700; a killed run's is swept
        self._ks: Optional[keyspace.KeySpace] = keyspace.KeySpace(self._work, memory_bytes=memory_bytes)
        self._folding: Optional[Folding] = Folding(prep.plan, restored, self._ks, CLUSTER)
        self._folded: Optional[Tuple[int, float, Batches]] = None

    def folded(self) -> Tuple[int, float, Batches]:
        """Wait for the fold: (segments used, its seconds, the load's transactions)."""
        if self._folded is None:
            assert self._folding is not None, "the tail was closed"
            self._folded = self._folding.result()
            self._drop_staging()
        return self._folded

    def load(self, rpc: EtcdRpc, start_rev: int, lap: Callable[[str], None] = lambda name: None, *,
             resuming: bool = False, min_ttl: int = MIN_TTL, unknown_ttl: int = 60) -> ReplayResult:
        """The tail written into the restored cluster ``rpc`` reaches, which must be at
        ``start_rev`` (its start snapshot's revision, bumped) - any other revision means
        something wrote to it first, and nothing is loaded. ``resuming``: a run of the same
        restore may have loaded part of it (its members restored before it was stopped are not
        restored again): every key is deleted or put to its value at the target whatever it holds
        now, a lease the tail names is granted if absent, the lease rule judges what the cluster
        holds. The result as a replay reports it."""
        t0 = time.monotonic()
        segs, fold_seconds, batches = self.folded()
        assert self._ks is not None
        lap("fold (its wait)")
        now = rpc.header(serializable=False).revision
        if now < start_rev or (now != start_rev and not resuming):
            raise ReplayError(f"the restored cluster is at revision {now}, expected {start_rev} (its start snapshot's, "
                              "bumped): something wrote to it before the tail; nothing loaded")
        plan = self.prep.plan
        at_ms = target_ms(plan)
        keeper = LeaseKeeper(rpc)
        try:
            w = write_tail(rpc, plan, self._ks, batches, start_rev=start_rev, at_ms=at_ms, min_ttl=min_ttl,
                           unknown_ttl=unknown_ttl, keeper=keeper, limits=CLUSTER, lap=lap)
            final = rpc.header(serializable=False).revision
            # nothing reads or watches the restored cluster between the start snapshot and the
            # target: its history before the final revision goes (etcd compacts in the background)
            if final > start_rev:
                rpc.compact(final)
            lap("compact")
        finally:
            keeper.close()
        return replay_result(plan, self._ks, w, restored=self.restored, segments=segs, at_ms=at_ms,
                             fold_seconds=fold_seconds, snapshot_path="", snapshot_revision=final,
                             seconds=time.monotonic() - t0,
                             started_from=self.prep.start.name if self.prep.start is not None else "")

    def _drop_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def close(self) -> None:
        """The fold stopped (if still running), its key space and work dir removed, the staging too."""
        if self._folding is not None:
            self._folding.abandon()
            self._folding = None
        if self._ks is not None:
            self._ks.close()
            self._ks = None
        shutil.rmtree(self._work, ignore_errors=True)
        self._drop_staging()


# ---------------------------------------------------------------- the record a journal names


@dataclasses.dataclass(frozen=True)
class Record:
    """What names a tail restore: the full backup (its file name in the backup dir), the target
    revision, whether checkpoints may be used and an unsigned chain accepted."""

    backup: str
    revision: int
    checkpoints: bool = True
    accept_unsigned: bool = False


def record_path(work_dir: str, prep: Prepared) -> str:
    return os.path.join(work_dir, f"{prep.entry.name}.to-{prep.plan.stop_revision}{RECORD_SUFFIX}")


def write_record(path: str, rec: Record) -> None:
    from etcd_agent.fs import write_atomic

    body = {"format": RECORD_FORMAT, **dataclasses.asdict(rec)}
    write_atomic(path, (json.dumps(body, indent=1) + "\n").encode(), mode=0o600)


def read_record(path: str) -> Record:
    """A record written by ``write_record``, read bounded and checked field by field."""
    from etcd_agent.fs import open_regular
    from etcd_agent.safejson import load as load_json

    with open_regular(path) as fh:
        doc = load_json(fh, max_bytes=MAX_RECORD)
    ok = (isinstance(doc, dict) and doc.get("format") == RECORD_FORMAT and isinstance(doc.get("backup"), str)
          and 0 < len(doc["backup"]) <= 255 and "/" not in doc["backup"] and doc["backup"] not in (".", "..")
          and isinstance(doc.get("revision"), int) and not isinstance(doc.get("revision"), bool)
          and doc["revision"] > 0 and isinstance(doc.get("checkpoints"), bool)
          and isinstance(doc.get("accept_unsigned"), bool))
    if not ok:
        raise ReplayError(f"{path}: not a point-in-time tail record this agent wrote; nothing touched")
    return Record(doc["backup"], doc["revision"], doc["checkpoints"], doc["accept_unsigned"])
