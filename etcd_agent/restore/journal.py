"""The restore journal of one member: ``<work dir>/journal.json`` (0600, in a 0700 dir).

Every step writes its outcome here when it is done, and a step that moves data writes its
intention first (``pending``), so a run killed between the move and the record is recognised by
the next one. A re-run skips the steps recorded as done: that is how a restore resumes. The
journal crosses a boundary (a file, and the node protocol's replies), so it is one typed object
with one ``from_json``/``to_json``.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..errors import OperationFailed
from ..fs import write_atomic
from ..safejson import UnsafeJson, loads

JOURNAL = "journal.json"
MAX_JOURNAL = 1 << 20
RUNNING, DONE, ROLLED_BACK = "running", "done", "rolled-back"
FINAL_STATES = (DONE, ROLLED_BACK)
# The journaled steps of one member, in order.
STEPS = ("begin", "receive", "restore", "fence", "stop", "aside", "install", "chown", "repair", "start", "unfence",
         "finish")


@dataclass
class Journal:
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
    steps: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    pending: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    rollback: List[str] = field(default_factory=list)

    @property
    def open(self) -> bool:
        return self.state not in FINAL_STATES

    def done(self, step: str) -> bool:
        return step in self.steps

    def info(self, step: str) -> Dict[str, Any]:
        """What ``step`` recorded (empty when it has not run)."""
        return self.steps.get(step) or {}

    def to_json(self) -> Dict[str, Any]:
        return {
            "op": self.op, "member": self.member, "backup": self.backup, "token": self.token,
            "initial_cluster": self.initial_cluster, "sha256": self.sha256, "size": self.size, "bump": self.bump,
            "fence_owner": self.fence_owner, "new_cluster": self.new_cluster, "was_running": self.was_running,
            "state": self.state, "created": self.created, "steps": self.steps, "pending": self.pending,
            "rollback": self.rollback,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> "Journal":
        def get(key: str, kind: Any, optional: bool = False) -> Any:
            v = d.get(key)
            if v is None and optional:
                return None
            if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
                raise OperationFailed(f"{where}: journal field {key!r} is missing or malformed")
            return v

        steps = get("steps", dict)
        pending = get("pending", dict)
        if not all(isinstance(v, dict) for v in list(steps.values()) + list(pending.values())):
            raise OperationFailed(f"{where}: journal steps are malformed")
        rollback = d.get("rollback") or []
        return cls(
            op=get("op", str), member=get("member", str), backup=get("backup", str), token=get("token", str),
            initial_cluster=get("initial_cluster", str), sha256=get("sha256", str, True), size=get("size", int),
            bump=get("bump", int, True), fence_owner=bool(d.get("fence_owner")), new_cluster=bool(d.get("new_cluster")),
            was_running=bool(d.get("was_running")), state=get("state", str), created=float(get("created", (int, float))),
            steps=steps, pending=pending, rollback=[str(x) for x in rollback] if isinstance(rollback, list) else [],
        )

    def summary(self) -> "JournalSummary":
        return JournalSummary(self.op, self.state, self.sha256, self.token, self.backup, self.initial_cluster,
                              self.new_cluster, tuple(s for s in STEPS if s in self.steps))


@dataclass(frozen=True)
class JournalSummary:
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

    def to_json(self) -> Dict[str, Any]:
        return {"op": self.op, "state": self.state, "sha256": self.sha256, "token": self.token, "backup": self.backup,
                "initial_cluster": self.initial_cluster, "new_cluster": self.new_cluster, "steps": list(self.steps)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "JournalSummary":
        steps = d.get("steps") or []
        sha = d.get("sha256")
        return cls(str(d.get("op")), str(d.get("state")), sha if isinstance(sha, str) else None, str(d.get("token")),
                   str(d.get("backup")), str(d.get("initial_cluster")), bool(d.get("new_cluster")),
                   tuple(str(s) for s in steps) if isinstance(steps, list) else ())


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
