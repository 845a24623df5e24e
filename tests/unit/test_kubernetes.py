"""The Kubernetes cleanup rules (pure)."""
from __future__ import annotations

from etcd_agent.cluster.kubernetes import master_addresses, plan_cleanup, readyz_url, rule_text
from etcd_agent.config import parse_text


def cfg(extra: str = "", hosts=("10.0.0.1", "10.0.0.2", "10.0.0.3")):  # type: ignore[no-untyped-def]
    text = "[kubernetes]\n" + extra + "\n" + "".join(
        f'[[member]]\nname = "m{i}"\nhost = "{h}"\n' for i, h in enumerate(hosts, 1))
    c, errors = parse_text(text)
    assert c is not None and not errors, errors
    return c


KEYS = ["/registry/masterleases/10.0.0.1", "/registry/masterleases/10.0.0.9", "/registry/masterleases/10.0.0.3",
        "/registry/leases/kube-system/kube-scheduler", "/registry/leases/kube-system/kube-controller-manager",
        "/registry/leases/kube-system/some-operator"]


def test_masterleases_of_former_masters_go_the_masters_own_stay() -> None:
    c = cfg()
    masters, unknown = master_addresses(c)
    plan = plan_cleanup(c, KEYS, masters, unknown)
    assert [r.key for r in plan.delete] == ["/registry/masterleases/10.0.0.9"]
    assert {r.key for r in plan.keep} >= {"/registry/masterleases/10.0.0.1", "/registry/masterleases/10.0.0.3"}
    assert "some-operator" not in " ".join(r.key for r in plan.keep + plan.delete)  # not ours to judge


def test_leader_leases_go_only_when_asked() -> None:
    c = cfg("drop_leader_leases = true")
    plan = plan_cleanup(c, KEYS, ["10.0.0.1", "10.0.0.2", "10.0.0.3"], [])
    assert sorted(r.key for r in plan.delete) == ["/registry/leases/kube-system/kube-controller-manager",
                                                  "/registry/leases/kube-system/kube-scheduler",
                                                  "/registry/masterleases/10.0.0.9"]
    assert "leader leases" in rule_text(c, ["10.0.0.1"])


def test_unknown_master_addresses_delete_no_masterlease() -> None:
    c = cfg(hosts=("10.0.0.1", "master2.invalid", "10.0.0.3"))
    masters, unknown = master_addresses(c, resolve=False)
    assert unknown == ["master2.invalid"]
    plan = plan_cleanup(c, KEYS, masters, unknown)
    assert plan.delete == [] and any("not guessing" in r.why for r in plan.keep) and plan.notes


def test_other_prefix_and_readyz_url() -> None:
    c = cfg('etcd_prefix = "/k8s"\nreadyz_url = "https://{host}:6443/readyz"')
    plan = plan_cleanup(c, ["/k8s/masterleases/10.0.0.7", "/registry/masterleases/10.0.0.7"], ["10.0.0.1"], [])
    assert [r.key for r in plan.delete] == ["/k8s/masterleases/10.0.0.7"]
    assert readyz_url(c, c.member("m2")) == "https://10.0.0.2:6443/readyz"


def test_readyz_url_is_validated() -> None:
    for bad in ("ftp://{host}/readyz", "https://10.0.0.1:6443/readyz", "https://{host}:6443/readyz?x=1"):
        c, errors = parse_text(f'[kubernetes]\nreadyz_url = "{bad}"\n[[member]]\nname = "m1"\nhost = "10.0.0.1"\n')
        assert any("readyz_url" in e for e in errors), (bad, errors)
