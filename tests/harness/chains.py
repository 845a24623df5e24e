"""Delta chains as a test bench changes them, shared by the unit tier (the hostile chains handed
to ``pitr.prepare``) and the integration tier (the same forgeries against a daemon's real chain):
a forged tail, the signatures stripped, and the files under a dir to show a refusal wrote nothing."""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Tuple

from etcd_agent.chain.reader import read_segment, verify_segment
from etcd_agent.chain.segments import PUT, Event, Txn, list_segments
from etcd_agent.chain.writer import SegmentWriter

EVIL = "/registry/clusterrolebindings/evil"


def tree(root: str) -> Dict[str, Tuple[int, int]]:
    """Every file and dir under ``root`` with its size and mtime: what a refusal must leave as it was."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


def append_tail(d: str, sign_key: Optional[bytes]) -> str:
    """A well-formed segment continuing the chain (linked by sha256, next seq and revision) with
    one put the cluster never saw, written by the segment writer with ``sign_key``."""
    last = verify_segment(list_segments(d)[-1])
    h = last.header
    rev = last.end_revision + 1
    t = last.footer.end_time_ms + 10
    w = SegmentWriter(d, dataclasses.replace(h, seq=h.seq + 1, start_revision=rev, prev_sha256=last.sha256,
                                             start_time_ms=t), sign_key=sign_key)
    w.add_txn(Txn(rev, t, (Event(PUT, EVIL.encode(), b"cluster-admin", rev, rev, 1, 0),)))
    return w.close(t + 10, confirmed=True).path


def strip_signatures(d: str) -> None:
    """The chain as a daemon before signed segments wrote it: the same records, no signature,
    each header linking to the rewritten file before it."""
    prev = ""
    for p in list_segments(d):
        seg = read_segment(p)
        os.unlink(p)
        h = seg.info.header
        w = SegmentWriter(d, dataclasses.replace(h, prev_sha256=prev))
        for t in seg.txns:
            w.add_txn(t)
        for rec in seg.info.lease_records:
            w.add_lease(rec)
        prev = w.close(seg.info.footer.end_time_ms, confirmed=seg.info.footer.confirmed).sha256
