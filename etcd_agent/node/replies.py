"""What the node protocol's steps answer, typed: one ``Document`` per reply.

The host builds these and sends ``to_json()`` as the reply's result; the orchestrator reads them
back with ``from_json`` (``HostNode.ask``), so a field of the wrong type or a missing one is a
``ProtocolError`` naming the step and the field where the reply is read - never a KeyError in the
code that uses it. A restore step's reply is also what its member's journal records of it
(``restore.journal``): one type for the wire and the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple, Type

from etcd_agent.typedjson import Document, JsonObject


@dataclass(frozen=True)
class StepReply(Document):
    """Every restore step's answer: which step of which member, when it was done (journaled), and
    why it did nothing when it did nothing. A subclass per step adds what that step did."""

    REQUIRED: ClassVar[Tuple[str, ...]] = ("step", "member")
    STEP: ClassVar[str] = ""  # the step a subclass answers; "" the base (a step without fields)

    step: str = ""
    member: str = ""
    at: Optional[float] = None
    skipped: Optional[str] = None

    def note(self) -> str:
        """A few words for the orchestrator's progress line ("" for none)."""
        return self.skipped or ""

    @classmethod
    def variant(cls, d: JsonObject) -> "Type[Any]":
        step = d.get("step")
        kind = _BY_STEP.get(step) if cls is StepReply and isinstance(step, str) else None
        return kind or cls


@dataclass(frozen=True)
class BeginReply(StepReply):
    STEP = "begin"
    was_running: Optional[bool] = None


@dataclass(frozen=True)
class FenceReply(StepReply):
    STEP = "fence"
    method: str = "none"  # none | unit | manifest
    was_active: Optional[bool] = None  # unit: the apiserver ran (so unfence starts it again)
    moved: Optional[str] = None  # manifest: where it went

    def note(self) -> str:
        return self.skipped or self.moved or ""


@dataclass(frozen=True)
class HaltReply(StepReply):
    STEP = "halt"
    # "db closed" (etcd is still exiting), "exited", "not running", "stopped earlier in this restore"
    # (a resume: never signal the restored etcd), or what kept the db lock from being seen
    how: str = ""
    waited: Optional[float] = None  # seconds from the signal to that

    def note(self) -> str:
        if self.skipped:
            return self.skipped
        return self.how + (f" after {self.waited:.2f}s" if self.waited is not None else "")


@dataclass(frozen=True)
class StopReply(StepReply):
    STEP = "stop"
    # etcds of this member stopped besides the backend's own: running without a pid file
    strays: Tuple[str, ...] = ()

    def note(self) -> str:
        return self.skipped or ("also stopped " + "; ".join(self.strays) if self.strays else "")


@dataclass(frozen=True)
class ServingReply(StepReply):
    """``serving``: who serves the member after the start (not journaled: checked each time)."""

    STEP = "serving"
    pid: Optional[int] = None
    cluster_id: Optional[str] = None
    revision: Optional[int] = None

    def note(self) -> str:
        return self.skipped or f"pid {self.pid}, cluster {self.cluster_id}, revision {self.revision}"


@dataclass(frozen=True)
class AsideReply(StepReply):
    STEP = "aside"
    moved: Optional[str] = None  # the data dir's name aside; None: there was none

    def note(self) -> str:
        return self.skipped or self.moved or ""


@dataclass(frozen=True)
class ReceiveReply(StepReply):
    STEP = "receive"
    sha256: Optional[str] = None
    size: Optional[int] = None
    how: Optional[str] = None  # "file": copied from the file on the restoring master; else the stream's codec

    def note(self) -> str:
        if self.skipped:
            return self.skipped
        return f"copied from the file on this master, sha256 {self.sha256[:16]}..." if self.how == "file" and \
            self.sha256 else ""


@dataclass(frozen=True)
class RestoreReply(StepReply):
    STEP = "restore"
    argv: Tuple[str, ...] = ()
    output: Optional[str] = None  # <data dir>.restoring


@dataclass(frozen=True)
class InstallReply(StepReply):
    STEP = "install"
    installed: Optional[str] = None


@dataclass(frozen=True)
class ChownReply(StepReply):
    STEP = "chown"
    owner: Optional[str] = None  # user:group; None with ``skipped``: etcd runs as the agent


@dataclass(frozen=True)
class RepairReply(StepReply):
    STEP = "repair"
    conf: Optional[str] = None  # what became of etcd.conf
    conf_created: bool = False  # rendered: rollback removes it
    conf_saved: bool = False  # rewritten, the original kept: rollback puts it back
    unit: Optional[str] = None
    unit_created: bool = False

    def note(self) -> str:
        return self.skipped or self.conf or ""


@dataclass(frozen=True)
class UnfenceReply(StepReply):
    STEP = "unfence"
    started: Optional[str] = None  # the apiserver unit started again
    restored: Optional[str] = None  # the static pod manifest put back


@dataclass(frozen=True)
class RollbackReply(StepReply):
    STEP = "rollback"
    did: Tuple[str, ...] = ()
    running: bool = False  # what is true now, not what was intended
    was_running: Optional[bool] = None


_BY_STEP: Dict[str, Type[StepReply]] = {k.STEP: k for k in (
    BeginReply, FenceReply, HaltReply, StopReply, ServingReply, AsideReply, ReceiveReply, RestoreReply, InstallReply, ChownReply, RepairReply,
    UnfenceReply, RollbackReply)}


@dataclass(frozen=True)
class MemberSteps(Document):
    """One member's part of a ``steps`` reply: the steps it finished, then its error if it failed."""

    member: str
    steps: Tuple[StepReply, ...] = ()
    error: Optional[JsonObject] = None  # AgentError.to_json(), rebuilt by errors.error_from_json


@dataclass(frozen=True)
class StepsReply(Document):
    """``steps``: every member's results, in no particular order."""

    members: Tuple[MemberSteps, ...]


@dataclass(frozen=True)
class Decision(Document):
    path: str
    keep: bool
    reason: str


@dataclass(frozen=True)
class CleanupReply(Document):
    """``cleanup``: a member's set-aside data dirs, what is kept and why, what was removed."""

    member: str
    dry_run: bool = False
    decisions: Tuple[Decision, ...] = ()
    removed: Tuple[str, ...] = ()
    error: Optional[str] = None  # the orchestrator's note when the host could not answer


@dataclass(frozen=True)
class LockReply(Document):
    lock: str
    held: bool


@dataclass(frozen=True)
class ReleaseReply(Document):
    """``release-version``: what a release's tools report (None: missing or broken)."""

    binary: Optional[str] = None
    etcdctl: Optional[str] = None
    etcdutl: Optional[str] = None


@dataclass(frozen=True)
class UpgradeReply(Document):
    """``upgrade-member``: one member's upgrade step."""

    member: str
    version: str
    outcome: str  # upgraded | skipped
    binary: Optional[str] = None
    seconds: Optional[float] = None


@dataclass(frozen=True)
class BackupReply(Document):
    """``backup``: the verified backup written on that host (``backup.service.BackupResult``)."""

    path: str
    size: int
    revision: Optional[int]
    sha256: str
    duration: float
    member: str
    pruned: Tuple[str, ...] = ()
    warnings: Tuple[str, ...] = ()
    quarantined: Tuple[str, ...] = ()


__all__ = [
    "StepReply", "BeginReply", "FenceReply", "StopReply", "ServingReply", "AsideReply", "ReceiveReply", "RestoreReply", "InstallReply",
    "ChownReply", "RepairReply", "UnfenceReply", "RollbackReply", "MemberSteps", "StepsReply", "Decision",
    "CleanupReply", "LockReply", "ReleaseReply", "UpgradeReply", "BackupReply",
]
