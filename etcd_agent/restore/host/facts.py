"""What a host says about itself before a restore (``node precheck``), and where its work goes.

The host half writes these facts; the orchestrator reads them (``restore.orchestrator.precheck``
judges them). They live on the host's side so that the host never imports the orchestrator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from etcd_agent.node.protocol import PROTOCOL
from etcd_agent.restore.host.journal import JournalSummary
from etcd_agent.typedjson import Document

# Bumped when the JSON of `etcd-agent node ...` changes incompatibly; both ends must agree.
NODE_PROTOCOL = PROTOCOL


@dataclass(frozen=True)
class NodeFacts(Document):
    """What one host reported about itself for one member (``node precheck``)."""

    member: str
    protocol: int
    agent_version: str
    etcd_version: Optional[str]
    etcdctl_version: Optional[str]
    etcdutl_version: Optional[str]
    free_bytes: int
    data_dir: str
    data_dir_state: str  # absent | empty | member | other
    work_dir: str
    conf_file: str
    conf_present: bool
    unit_present: Optional[bool]  # None: the process backend has no unit
    backend: str
    running: bool
    fence_ok: bool
    fence_detail: str
    identity_match: bool
    tls_missing: Tuple[str, ...] = ()
    journal: Optional[JournalSummary] = None
    peer_url: str = ""
    client_url: str = ""
    # evidence of which cluster this host runs: its bootstrap record and its restore lineage
    bootstrap_member_id: Optional[str] = None
    bootstrap_cluster_id: Optional[str] = None
    lineage: Tuple[Tuple[str, ...], ...] = ()
    db_member_ids: Tuple[str, ...] = ()  # the members in the data dir's own db (read with etcd down)
    db_note: str = ""  # why the data dir's db could not be read, if it could not
    # the tools the host restores with: its agent.toml's, or its version pin's after a rolling
    # upgrade (None from agents that do not say: the plan assumes this config's)
    etcdctl_path: Optional[str] = None
    etcdutl_path: Optional[str] = None
    # processes serving this member (its data dir open, its ports) that this agent did not start:
    # one sentence each, why the restore cannot go on (``member.serving.refusal``); a restore
    # never moves a data dir from under them
    foreign: Tuple[str, ...] = ()


def work_dir_for(data_dir: str, member: str) -> str:
    """Where one member's restore keeps its journal and shipped files: beside the data dir, so the
    restored db lands on the same filesystem (the final step is a rename)."""
    base = data_dir.rstrip("/")
    parent = base.rsplit("/", 1)[0] or "/"
    return f"{parent.rstrip('/')}/.etcd-agent-restore-{member}"
