"""`k8s cleanup` against real etcd holding keys laid out as a Kubernetes cluster writes them."""
from __future__ import annotations

from typing import List

import pytest

from etcd_agent.cli.main import main
from tests.harness.loopback import LoopbackCluster

pytestmark = pytest.mark.integration

K8S = {
    "/registry/masterleases/127.0.0.1": b"\x6b\x38\x73\x00endpoints-of-a-master",  # a master now
    "/registry/masterleases/10.9.9.9": b"\x6b\x38\x73\x00endpoints-of-a-gone-one",  # not a master now
    "/registry/masterleases/10.9.9.8": b"\x6b\x38\x73\x00another-gone-one",
    "/registry/leases/kube-system/kube-controller-manager": b"\x6b\x38\x73\x00holder=master9",
    "/registry/leases/kube-system/kube-scheduler": b"\x6b\x38\x73\x00holder=master9",
    "/registry/leases/kube-system/my-operator": b"\x6b\x38\x73\x00not the agent's to touch",
    "/registry/secrets/default/s1": b"\x6b\x38\x73\x00secret",
    "/registry/pods/default/p1": b"\x6b\x38\x73\x00pod",
    "/app/config": b"unrelated",
}


def listing(c: LoopbackCluster) -> List[str]:
    with c.client() as cl:
        return sorted(cl.keys("/registry/") + cl.keys("/app/"))


def test_cleanup_removes_exactly_the_stale_entries(cluster_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    c = cluster_factory(1, extra='[kubernetes]\ndrop_leader_leases = true\n')
    c.start_static()
    with c.client() as cl:
        for k, v in K8S.items():
            cl.put(k, v)
    before = listing(c)
    capsys.readouterr()
    assert main(["-c", c.config_path, "k8s", "cleanup", "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert listing(c) == before  # a dry run deletes nothing
    for gone in ("10.9.9.9", "10.9.9.8", "kube-controller-manager", "kube-scheduler"):
        assert f"would delete /registry/{'masterleases' if '.' in gone else 'leases/kube-system'}/{gone}" in dry, dry
    assert "keep /registry/masterleases/127.0.0.1: a master now" in dry
    assert main(["-c", c.config_path, "k8s", "cleanup", "--yes"]) == 0
    after = listing(c)
    assert set(before) - set(after) == {"/registry/masterleases/10.9.9.9", "/registry/masterleases/10.9.9.8",
                                        "/registry/leases/kube-system/kube-controller-manager",
                                        "/registry/leases/kube-system/kube-scheduler"}
    with capsys.disabled():
        print("\nFIGURE k8s cleanup before: " + ", ".join(before))
        print("FIGURE k8s cleanup after:  " + ", ".join(after))
        print("FIGURE k8s cleanup --dry-run:\n" + dry)
