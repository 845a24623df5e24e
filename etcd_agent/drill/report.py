"""What a restore drill reports: how far it got, what it proved and what it could not, step times.

``backup.drill`` fills a ``DrillReport`` as it runs; this module only says it - as JSON, as the
lines ``etcd-agent drill`` prints, and as the ``DrillRecord`` kept per backup and per host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from etcd_agent.drill.record import DrillRecord
from etcd_agent.errors import OperationFailed


@dataclass
class DrillReport:
    spec: str
    started: float  # unix time
    host: str = ""  # the member of the host that ran it (else the host name)
    backup: Optional[str] = None  # file name
    path: Optional[str] = None
    ok: bool = False
    duration: float = 0.0
    problem: Optional[str] = None  # one sentence
    step: str = ""  # where it stopped (or ended)
    proved: Optional[str] = None
    checked: List[str] = field(default_factory=list)
    not_proven: List[str] = field(default_factory=list)
    steps: Dict[str, float] = field(default_factory=dict)
    kind: Optional[str] = None
    signature: Optional[str] = None
    revision: Optional[int] = None
    keys: Optional[int] = None
    leases: Optional[int] = None
    sample: Optional[int] = None
    digest: Optional[str] = None
    etcd_version: Optional[str] = None
    run_as: Optional[str] = None
    endpoint: Optional[str] = None
    interrupted: bool = False
    content_failure: bool = False

    def record(self) -> DrillRecord:
        return DrillRecord(backup=self.backup or f"(none: --from {self.spec})", ok=self.ok, at=self.started,
                           duration=self.duration, host=self.host, problem=self.problem, revision=self.revision,
                           keys=self.keys, leases=self.leases, sample=self.sample, etcd_version=self.etcd_version,
                           digest=self.digest[:16] if self.digest else None)

    def to_json(self) -> Dict[str, Any]:
        return {
            "backup": self.backup, "path": self.path, "ok": self.ok, "started": self.started, "host": self.host,
            "duration": round(self.duration, 3), "problem": self.problem, "step": self.step, "proved": self.proved,
            "checked": self.checked, "not_proven": self.not_proven,
            # in the order they ran (a JSON object's keys would be sorted on output)
            "steps": [{"step": k, "seconds": round(v, 3)} for k, v in self.steps.items()],
            "kind": self.kind, "signature": self.signature,
            "revision": self.revision, "keys": self.keys, "leases": self.leases, "sample": self.sample,
            "digest": self.digest, "etcd_version": self.etcd_version, "run_as": self.run_as,
            "endpoint": self.endpoint, "interrupted": self.interrupted,
        }

    def lines(self) -> List[str]:
        name = self.backup or f"--from {self.spec}"
        if self.ok:
            head = f"restore drill of {name}: PASSED in {self.duration:.1f}s"
        elif self.interrupted:
            head = f"restore drill of {name}: INTERRUPTED after {self.duration:.1f}s ({self.step})"
        else:
            head = f"restore drill of {name}: FAILED after {self.duration:.1f}s while {self.step}: {self.problem}"
        out = [head]
        if self.proved:
            out.append(f"  proved: {self.proved}")
        out += [f"  ok: {c}" for c in self.checked]
        out += [f"  not proven: {c}" for c in self.not_proven]
        if self.steps:
            out.append("  took: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.steps.items()))
        return out


class DrillFailed(OperationFailed):
    """A check of the drill failed; ``content`` when the archive itself is bad (the reader said so)."""

    def __init__(self, message: str, *, content: bool = False, details: Optional[List[str]] = None) -> None:
        super().__init__(message, details=details)
        self.content = content
