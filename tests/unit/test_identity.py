"""identity.judge (pure) on the identities of real etcd snapshots (tests/data/make_snapshots.py):
cluster a (m1..m3, token tok-a), the same layout re-bootstrapped by hand (tok-a2), a foreign one."""
from __future__ import annotations

import os
from typing import Any, Dict

import pytest

from etcd_agent.backup.evidence import parse_lineage
from etcd_agent.backup.identity import Evidence, HostIds, KnownMember, judge
from etcd_agent.config import Config, load
from etcd_agent.etcd.snapdb import SnapshotIdentity, cluster_id_from, read_identity

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
SNAP: Dict[str, SnapshotIdentity] = {
    n: read_identity(os.path.join(DATA, f"snap-{n}.db"), verify_trailer=True) for n in ("a", "a-reboot", "b", "a-34")
}


def config(ports: Any = (17380, 17382, 17384), names: Any = ("m1", "m2", "m3")) -> Config:
    members = "".join(
        f'[[member]]\nname = "{n}"\nhost = "127.0.0.1"\nclient_url = "http://127.0.0.1:{p + 1000}"\n'
        f'peer_url = "http://127.0.0.1:{p}"\n'
        for n, p in zip(names, ports)
    )
    return load("/nonexistent/agent.toml", text=f'[cluster]\nname = "a"\ntoken = "tok-a"\n'
                f'[etcd]\ndata_dir = "/var/lib/etcd/{{name}}.etcd"\nconf_file = "/etc/etcd/{{name}}.conf"\n{members}')


CFG = config()


def running(snap: SnapshotIdentity) -> Evidence:
    return Evidence(running=tuple(KnownMember(m.id, m.name, m.peer_urls) for m in snap.members))


def test_same_cluster_proven_by_running_member_ids() -> None:
    v = judge(SNAP["a"], CFG, running(SNAP["a"]), new_cluster=False)
    assert v.ok and v.same_cluster is True and v.layout_ok
    ids = ",".join(sorted(format(m.id, "x") for m in SNAP["a"].members))
    assert f"member ids {ids} match the running cluster" in v.proven
    assert any("have the config's names and peer URLs" in p for p in v.proven)
    # etcd 3.4 writes the same ids for the same peer URLs and token
    assert judge(SNAP["a-34"], CFG, running(SNAP["a"]), new_cluster=False).same_cluster is True


def test_foreign_cluster_refused_whatever_a_manifest_would_say() -> None:
    v = judge(SNAP["b"], CFG, running(SNAP["a"]), new_cluster=False)
    assert not v.ok and v.same_cluster is False and not v.layout_ok
    assert "another cluster layout" in v.refused[0] and "--new-cluster" in v.refused[0]
    assert any("foreign cluster" in r and "--new-cluster" in r for r in v.refused)
    # a config of b's layout, with a's cluster running: layout fine, ids foreign
    cfg_b = config((17390, 17392, 17394), ("x1", "x2", "x3"))
    v = judge(SNAP["b"], cfg_b, running(SNAP["a"]), new_cluster=False)
    assert not v.ok and v.layout_ok and "other member ids" in v.refused[0]


def test_rebootstrapped_by_hand_is_recognised_and_explained() -> None:
    v = judge(SNAP["a"], CFG, running(SNAP["a-reboot"]), new_cluster=False)
    assert not v.ok and v.layout_ok and v.same_cluster is False
    (why,) = v.refused
    assert "have this config's names and peer URLs but other member ids" in why
    assert "restored or re-bootstrapped by hand" in why and "--new-cluster" in why
    v = judge(SNAP["a"], CFG, running(SNAP["a-reboot"]), new_cluster=True)
    assert v.ok and v.same_cluster is False and any("--new-cluster" in u for u in v.unproven)


def test_lineage_recognises_an_earlier_incarnation() -> None:
    ids = frozenset(SNAP["a"].member_ids)
    ev = Evidence(running=running(SNAP["a-reboot"]).running, lineage=(ids,))
    v = judge(SNAP["a"], CFG, ev, new_cluster=False)
    assert v.ok and v.same_cluster is True and any("restore lineage" in p for p in v.proven)
    # older lineage records hold cluster ids: a bootstrap membership's id is computable
    cid = cluster_id_from(SNAP["a"].member_ids)
    sets, cids = parse_lineage(f'["{cid:x}", ["{format(SNAP["a"].members[0].id, "x")}"], {{"member_ids": []}}, 5]'.encode())
    assert cids == {cid} and len(sets) == 2
    v = judge(SNAP["a"], CFG, Evidence(running=running(SNAP["a-reboot"]).running, lineage_cluster_ids=cids),
              new_cluster=False)
    assert v.ok and any("bootstrap cluster id" in p for p in v.proven)


def test_host_evidence_alone_decides() -> None:
    own = HostIds("m1's data dir (/var/lib/etcd/member/snap/db)", frozenset(SNAP["a-reboot"].member_ids))
    v = judge(SNAP["a"], CFG, Evidence(hosts=(own,)), new_cluster=False)
    assert not v.ok and "other member ids" in v.refused[0] and "m1's data dir" in v.refused[0]
    rec = HostIds("m2's bootstrap record", frozenset({SNAP["a"].members[0].id}))
    v = judge(SNAP["a"], CFG, Evidence(hosts=(own, rec)), new_cluster=False)
    assert v.ok and any("m2's bootstrap record" in p for p in v.proven)


def test_no_evidence_proceeds_on_layout_and_says_so() -> None:
    v = judge(SNAP["a"], CFG, Evidence(), new_cluster=False)
    assert v.ok and v.same_cluster is None
    assert any("compared with nothing" in u and "layout match is all that was checked" in u for u in v.unproven)
    v = judge(SNAP["b"], CFG, Evidence(), new_cluster=False)
    assert not v.ok and "another cluster layout" in v.refused[0]


@pytest.mark.parametrize(
    "ports,names,want",
    [
        ((17380, 17382, 17399), ("m1", "m2", "m3"), "snapshot member m3 has peer URL http://127.0.0.1:17384"),
        ((17380, 17382), ("m1", "m2"), "snapshot member m3 (http://127.0.0.1:17384) is not in the config"),
        ((17380, 17382, 17384, 17386), ("m1", "m2", "m3", "m4"), "config member(s) m4 are not in the snapshot"),
    ],
)
def test_layout_differences(ports: Any, names: Any, want: str) -> None:
    v = judge(SNAP["a"], config(ports, names), running(SNAP["a"]), new_cluster=False)
    assert not v.ok and want in v.refused[0]
    assert judge(SNAP["a"], config(ports, names), running(SNAP["a"]), new_cluster=True).ok


def test_shares_members_tells_history_from_another_cluster() -> None:
    from etcd_agent.backup.identity import shares_members

    assert shares_members(SNAP["a"], config((17380, 17382, 17384, 17386), ("m1", "m2", "m3", "m4")))  # scale-up
    assert shares_members(SNAP["a"], config((17380, 17382), ("m1", "m2")))  # scale-down
    assert not shares_members(SNAP["b"], CFG)


def test_a_config_member_missing_from_the_snapshot_is_named_with_what_the_snapshot_lists() -> None:
    """(CI 46: a replay's full backup refused for lacking m1, the message saying nothing of what
    it held.) A config of four members, the snapshot of three: the fourth is named, and so is every
    member the snapshot lists, with its peer URL."""
    from etcd_agent.backup.identity import layout_problems

    cfg4 = config((17380, 17382, 17384, 17386), ("m1", "m2", "m3", "m4"))
    problems = layout_problems(SNAP["a"], cfg4)
    assert len(problems) == 1 and problems[0].startswith("config member(s) m4 are not in the snapshot's cluster "), problems
    for m in SNAP["a"].members:
        assert f"{m.name} {','.join(m.peer_urls)}" in problems[0], problems[0]
