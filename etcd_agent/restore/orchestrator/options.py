"""What a restore is asked to do (``Options``) and what it reports (``Outcome``), and the words and
ids every part of it shares; ``orchestrate`` runs it."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from etcd_agent.restore.orchestrator import plan as P
from etcd_agent.restore.orchestrator.live import Progress

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.age import Identities
    from etcd_agent.pitr.carried import CheckedChain
    from etcd_agent.pitr.replay import Target

# what an operator who stopped waiting (a second Ctrl-C) is told: nothing more was asked of the hosts
LEFT_AS_IS = ("steps still running on the hosts were not waited for and nothing more was done (a stuck one is "
              "stopped 30 s after its session closes); run `etcd-agent restore rollback --yes` on any master to "
              "roll every member back, or the same restore command to resume it")


def new_op_id(stamp: str, sha256: Optional[str]) -> str:
    """A new restore's id: when, what, and a random part - a retry within the same second of
    a rolled-back restore of the same backup is a new restore, not that one (whose journal
    says rolled back and would refuse it)."""
    return f"{stamp}-{(sha256 or 'runbook')[:8]}-{secrets.token_hex(3)}"


@dataclass
class Options:
    spec: str
    dry_run: bool = False
    new_token: Optional[str] = None
    new_cluster: bool = False
    confirm: Optional[Callable[[str], bool]] = None  # shown the plan; False = abort
    progress: Progress = lambda s: None
    health_timeout: Optional[float] = None
    identities: Optional["Identities"] = None  # decrypts an encrypted backup (--identity)
    # a point in time (parsed once, by the CLI): the full backup's chain replayed to it; None: plain
    target: Optional["Target"] = None
    checkpoints: bool = True  # False: --no-checkpoint (the whole chain from the full backup)
    accept_unsigned: bool = False  # --accept-unsigned-chain
    # the restore as the operator typed it (e.g. "restore --from-bucket latest --to-revision 545"):
    # what a second run's busy refusal and `status` name; "": "restore --from <the file opened>"
    command: str = ""
    # the target's chain as --from-bucket checked it before the files were let in: not checked
    # again while the files are the same (``pitr.carried.take``)
    checked: Optional["CheckedChain"] = None


@dataclass
class Outcome:
    plan: P.Plan
    done: bool = False
    duration: float = 0.0
    timings: Dict[str, float] = field(default_factory=dict)
    revisions: Dict[str, int] = field(default_factory=dict)
    downtime: Optional[float] = None  # fence -> unfence
    cleanup: List[str] = field(default_factory=list)  # what the Kubernetes cleanup did
    ready: Dict[str, str] = field(default_factory=dict)  # member -> its apiserver's /readyz wait
    point_in_time: List[str] = field(default_factory=list)  # a tail loaded into the members: what it reached

    def to_json(self) -> Dict[str, Any]:
        return {
            "plan": self.plan.to_json(),
            "done": self.done,
            "duration": round(self.duration, 3),
            "downtime": None if self.downtime is None else round(self.downtime, 3),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "revisions": self.revisions,
            "kubernetes_cleanup": self.cleanup,
            "apiservers": self.ready,
            "point_in_time": self.point_in_time,
        }


