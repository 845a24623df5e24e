"""The restore journal of one member: ``<work dir>/journal.json`` (0600, in a 0700 dir).

Every step writes its outcome here when it is done, and a step that moves data writes its
intention first (``pending``), so a run killed between the move and the record is recognised by
the next one. A re-run skips the steps recorded as done: that is how a restore resumes. The
journal crosses a boundary (a file, and the node protocol's replies), so it is one typed object
with one ``from_json``/``to_json``; each step's record is that step's typed reply (``node.replies``).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Type, TypeVar

from etcd_agent.errors import OperationFailed
from etcd_agent.fs import write_atomic
from etcd_agent.node.replies import StepReply
from etcd_agent.safejson import UnsafeJson, loads
from etcd_agent.typedjson import Document

JOURNAL = "journal.json"
MAX_JOURNAL = 1 << 20
RUNNING, DONE, ROLLED_BACK = "running", "done", "rolled-back"
FINAL_STATES = (DONE, ROLLED_BACK)
# The journaled steps of one member, in order.
STEPS = ("begin", "receive", "restore", "fence", "halt", "stop", "aside", "install", "chown", "repair", "start", "unfence",
         "finish")
R = TypeVar("R", bound=StepReply)


@dataclass(frozen=True)
class Pending(Document):
    """A step's intention, journaled before it moves data: a run killed between the move and the
    record is recognised by the next one."""

    target: Optional[str] = None  # aside: the name the data dir is renamed to
    output: Optional[str] = None  # restore: its staging dir
    argv: Optional[Tuple[str, ...]] = None  # restore: set once `snapshot restore` succeeded
    staged: Optional[str] = None  # install: the staged data being moved in


@dataclass
class Journal(Document):
    op: str
    member: str
    backup: str
    token: str
    initial_cluster: str
    sha256: Optional[str]  # of the snapshot: the manifest's claim at begin, the bytes received after
    size: int
    bump: Optional[int]
    fence_owner: bool
    new_cluster: bool
    was_running: bool
    state: str = RUNNING
    created: float = field(default_factory=time.time)
    steps: Dict[str, StepReply] = field(default_factory=dict)  # what each step did: its reply
    pending: Dict[str, Pending] = field(default_factory=dict)
    rollback: List[str] = field(default_factory=list)

    @property
    def open(self) -> bool:
        return self.state not in FINAL_STATES

    def done(self, step: str) -> bool:
        return step in self.steps

    def record(self, kind: Type[R]) -> Optional[R]:
        """What the step ``kind`` answers recorded (None when it has not run)."""
        r = self.steps.get(kind.STEP)
        return r if isinstance(r, kind) else None

    @classmethod
    def from_json(cls, d: object, where: str) -> "Journal":
        """The journal's key names each step record (and its member), whatever the record says."""
        if isinstance(d, dict) and isinstance(d.get("steps"), dict):
            d = {**d, "steps": {k: {**v, "step": k, "member": d.get("member")} if isinstance(v, dict) else v
                                for k, v in d["steps"].items()}}
        j = super().from_json(d, where)
        assert isinstance(j, Journal)
        return j

    def summary(self) -> "JournalSummary":
        return JournalSummary(self.op, self.state, self.sha256, self.token, self.backup, self.initial_cluster,
                              self.new_cluster, tuple(s for s in STEPS if s in self.steps))


@dataclass(frozen=True)
class JournalSummary(Document):
    """What a host reports about its member's journal in a pre-check."""

    op: str
    state: str
    sha256: Optional[str]
    token: str
    backup: str
    initial_cluster: str
    new_cluster: bool
    steps: Tuple[str, ...]

    @property
    def open(self) -> bool:
        return self.state not in FINAL_STATES


def load(path: str) -> Optional[Journal]:
    """The journal at ``path``; None when there is none; OperationFailed when it is damaged."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_JOURNAL + 1)
    except FileNotFoundError:
        return None
    try:
        doc = loads(raw, max_bytes=MAX_JOURNAL)
    except UnsafeJson as exc:
        raise OperationFailed(f"journal {path} unreadable ({exc}); move it away only after checking its data dirs") from None
    if not isinstance(doc, dict):
        raise OperationFailed(f"journal {path} is not a journal")
    return Journal.from_json(doc, path)


def save(path: str, j: Journal) -> None:
    write_atomic(path, (json.dumps(j.to_json(), indent=2, sort_keys=True) + "\n").encode(), mode=0o600)


def path_in(work_dir: str) -> str:
    return os.path.join(work_dir, JOURNAL)
