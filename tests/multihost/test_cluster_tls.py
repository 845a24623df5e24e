"""A TLS etcd cluster across three namespace hosts, rendered by the agent, checked over https.

A throwaway CA (openssl CLI, argv only) signs one certificate per host with the host's IP (and
127.0.0.1) as SANs, usable for server and client auth (etcd peers are both), plus an admin client
certificate for the root namespace. Each host's etcd.conf comes from ``topology.render_conf`` with
``[tls]`` set; etcd is started inside the host's namespace with exactly the conf's ``ETCD_*``
variables (what the process backend and systemd's EnvironmentFile= give it) and is stopped by PID
when the bed goes down.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List

import pytest

from etcd_agent.cli.main import main
from etcd_agent.cluster.status import cluster_status
from etcd_agent.config import Config, TlsSection, load
from etcd_agent.errors import EtcdError
from etcd_agent.etcd import proto
from etcd_agent.etcd.client import EtcdClient, prefix_end
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.topology import parse_conf, render_conf, static_bootstrap
from tests.harness.netns import NetnsBed, NsHost
from tests.harness.releases import DEFAULT, release

pytestmark = pytest.mark.multihost

PREFIX = "et"
SUBNET = "10.213.3"


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(d: str, name: str) -> None:
    openssl(
        "req", "-x509", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.crt", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )


def make_cert(d: str, ca: str, name: str, ips: List[str], usage: str) -> None:
    """Key + certificate ``name`` signed by ``ca``, with IP SANs and the given extended key usage."""
    openssl(
        "req", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr", "-subj", f"/CN={name}",
    )
    ext = f"{d}/{name}.ext"
    with open(ext, "w") as fh:
        if ips:
            fh.write("subjectAltName=" + ",".join(f"IP:{ip}" for ip in ips) + "\n")
        fh.write(f"extendedKeyUsage={usage}\nkeyUsage=critical,digitalSignature,keyEncipherment\nbasicConstraints=CA:FALSE\n")
    openssl(
        "x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/{ca}.crt", "-CAkey", f"{d}/{ca}.key",
        "-CAcreateserial", "-out", f"{d}/{name}.crt", "-days", "2", "-extfile", ext,
    )
    os.chmod(f"{d}/{name}.key", 0o600)


def config_text(work: str, hosts: List[NsHost], cert: str) -> str:
    """The agent config every host shares, except which certificate it presents."""
    tls = f"{work}/tls"
    lines = [
        "[cluster]", 'name = "tls"', 'token = "tls-token"', 'bootstrap = "static"',
        "[etcd]", release(DEFAULT).toml(), 'service_manager = "process"', 'user = "root"', 'group = "root"',
        f'data_dir = "{work}/data/{{name}}.etcd"', f'conf_file = "{work}/conf/{{name}}.conf"',
        f'unit_file = "{work}/conf/etcd.service"', f'run_dir = "{work}/run"',
        "[tls]",
        f'client_ca = "{tls}/ca.crt"', f'client_cert = "{tls}/{cert}.crt"', f'client_key = "{tls}/{cert}.key"',
        f'peer_ca = "{tls}/ca.crt"', f'peer_cert = "{tls}/{cert}.crt"', f'peer_key = "{tls}/{cert}.key"',
        "[backup]", f'dir = "{work}/backups"',
    ]
    for h in hosts:
        lines += ["[[member]]", f'name = "{h.name}"', f'host = "{h.ip}"']
    return "\n".join(lines) + "\n"


@dataclass
class TlsCluster:
    bed: NetnsBed
    work: str
    admin: Config  # the root namespace's view: admin client certificate
    admin_path: str
    confs: Dict[str, str] = field(default_factory=dict)
    formed_in: float = 0.0


def healthy_rows(cfg: Config, timeout: float = 1.0) -> Dict[str, bool]:
    return {r.name: r.healthy for r in cluster_status(cfg, timeout=timeout)}


def wait_until(pred: Any, timeout: float, interval: float = 0.2) -> float:
    """Seconds until ``pred()`` held; fails the test after ``timeout``."""
    t = time.monotonic()
    while not pred():
        if time.monotonic() - t > timeout:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - t


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[TlsCluster]:
    if os.geteuid() != 0:
        pytest.skip("multihost tests need root (network namespaces)")
    bed = NetnsBed(3, prefix=PREFIX, subnet=SUBNET)
    try:
        bed.up()
        work = bed.workdir
        tls = f"{work}/tls"
        for sub in ("tls", "data", "conf", "run", "backups"):
            os.makedirs(f"{work}/{sub}", mode=0o700, exist_ok=True)
        make_ca(tls, "ca")
        for h in bed.hosts:
            make_cert(tls, "ca", h.name, [h.ip, "127.0.0.1"], "serverAuth,clientAuth")
        make_cert(tls, "ca", "admin", [], "clientAuth")
        make_ca(tls, "rogue-ca")
        make_cert(tls, "rogue-ca", "rogue", [], "clientAuth")
        admin_path = f"{work}/admin.toml"
        with open(admin_path, "w") as fh:
            fh.write(config_text(work, bed.hosts, "admin"))
        tc = TlsCluster(bed, work, load(admin_path), admin_path)

        t = time.monotonic()
        for h in bed.hosts:
            path = f"{work}/{h.name}.toml"
            with open(path, "w") as fh:
                fh.write(config_text(work, bed.hosts, h.name))
            cfg = load(path)  # validates: TLS files exist, URLs derived as https
            member = cfg.member(h.name)
            conf = render_conf(cfg, member, static_bootstrap(cfg, member))
            with open(cfg.conf_file(h.name), "w") as fh:
                fh.write(conf)
            tc.confs[h.name] = conf
            env = {k: v for k, v in parse_conf(conf).items() if k.startswith("ETCD_")}
            env["PATH"] = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            with open(f"{work}/run/{h.name}.log", "ab") as logf:
                bed.popen(h, [cfg.etcd.binary], env=env, stdout=logf, stderr=subprocess.STDOUT)
        wait_until(lambda: all(healthy_rows(tc.admin).values()), 60)
        tc.formed_in = time.monotonic() - t
        print(f"\nTLS cluster of 3 namespace hosts healthy in {tc.formed_in:.1f}s")
        yield tc
    finally:
        bed.down()


def test_tls_cluster_forms_and_reports_over_https(tls_cluster: TlsCluster, capsys: Any) -> None:
    tc = tls_cluster
    conf = parse_conf(tc.confs["et1"])
    assert conf["ETCD_ADVERTISE_CLIENT_URLS"] == f"https://{SUBNET}.11:2379"
    assert conf["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"https://{SUBNET}.11:2380"
    assert conf["ETCD_CLIENT_CERT_AUTH"] == "true" and conf["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    assert conf["ETCD_CERT_FILE"].endswith("/tls/et1.crt")
    assert all(f"https://{h.ip}:2380" in conf["ETCD_INITIAL_CLUSTER"] for h in tc.bed.hosts)

    rows = cluster_status(tc.admin, timeout=2.0)
    assert [(r.name, r.healthy, r.reachable) for r in rows] == [(h.name, True, True) for h in tc.bed.hosts]
    assert sum(1 for r in rows if r.leader) == 1 and len({r.raft_term for r in rows}) == 1
    with EtcdClient.from_config(tc.admin) as c:
        assert sorted(m.name for m in c.members()) == ["et1", "et2", "et3"]
        assert all(u.startswith("https://") for m in c.members() for u in m.peer_urls + m.client_urls)
        c.put("tls/k", b"v")
        assert c.get("tls/k") == b"v"
    # the CLI over https: status exit 0, member list with every member started and healthy
    capsys.readouterr()
    assert main(["-c", tc.admin_path, "--json", "status"]) == 0
    assert json.loads(capsys.readouterr().out)["healthy"] is True
    assert main(["-c", tc.admin_path, "--json", "member", "list"]) == 0
    listed = json.loads(capsys.readouterr().out)["members"]
    assert sorted((r["name"], r["started"], r["healthy"], r["in_config"]) for r in listed) == [
        (h.name, True, True, True) for h in tc.bed.hosts
    ]


def test_clients_without_a_valid_certificate_are_refused(tls_cluster: TlsCluster) -> None:
    tc = tls_cluster
    url = tc.admin.members[0].client_url
    tls = f"{tc.work}/tls"
    no_cert = TlsSection(client_ca=f"{tls}/ca.crt")
    rogue = TlsSection(client_ca=f"{tls}/ca.crt", client_cert=f"{tls}/rogue.crt", client_key=f"{tls}/rogue.key")
    for section in (no_cert, rogue):
        with EtcdClient([url], tls=section, timeout=2.0) as c:
            with pytest.raises(EtcdError):
                c.status(url)
            ok, why = c.healthy(url, timeout=2.0)
            assert not ok and why
    # plain http to the TLS port is refused as well
    with EtcdClient([url.replace("https://", "http://")], timeout=2.0) as c:
        with pytest.raises(EtcdError):
            c.members()
    # while the admin certificate still works
    with EtcdClient.from_config(tc.admin, [url], timeout=2.0) as c:
        assert c.status(url).version == DEFAULT


def test_the_watch_transport_speaks_tls_from_the_same_config(tls_cluster: TlsCluster) -> None:
    """``etcd.rpc`` (the continuous backup's watch, the replay's transactions) opens its channel
    where the client does, with the same [tls] files: a watch over https sees a write; without a
    client certificate etcd refuses it."""
    tc = tls_cluster
    url = tc.admin.members[1].client_url
    with EtcdClient.from_config(tc.admin, [url]) as c:
        c.put("tls/watched", b"seen")
    with EtcdRpc(url, tls=tc.admin.tls, timeout=5.0, single_threaded_streams=True) as r:
        head = r.header(serializable=False)
        req = proto.encode_watch_create(b"tls/", prefix_end(b"tls/"), start_revision=1)
        seen = []
        for raw in r.watch_batch(req, timeout=10.0):
            seen += [ev.key for ev in proto.decode_watch_response(raw, r.max_message).events]
            if b"tls/watched" in seen:
                break
        assert b"tls/watched" in seen and head.revision > 1
    no_cert = TlsSection(client_ca=tc.admin.tls.client_ca)
    with EtcdRpc(url, tls=no_cert, timeout=2.0) as r, pytest.raises(EtcdError):
        r.header(serializable=False)


@pytest.mark.parametrize("role", ["follower", "leader"])
def test_partition_of_one_host_and_recovery(tls_cluster: TlsCluster, capsys: Any, role: str) -> None:
    """A follower's partition leaves the other two healthy throughout; the leader's costs the
    other two one election before they are healthy again. Both rejoin and catch up."""
    tc = tls_cluster
    rows = cluster_status(tc.admin, timeout=2.0)
    victim_name = next(r.name for r in rows if bool(r.leader) == (role == "leader"))
    victim = tc.bed.host(victim_name)
    others = [h.name for h in tc.bed.hosts if h.name != victim_name]
    prefix = f"tls/partition-{role}/"
    tc.bed.set_link(victim, False)
    try:
        detect = wait_until(
            lambda: healthy_rows(tc.admin) == {**dict.fromkeys(others, True), victim_name: False}, 30
        )
        rows = cluster_status(tc.admin, timeout=1.0)
        gone = next(r for r in rows if r.name == victim_name)
        assert not gone.reachable and gone.errors
        assert sum(1 for r in rows if r.leader) == 1 and not gone.leader
        capsys.readouterr()
        assert main(["-c", tc.admin_path, "--json", "status", "--timeout", "1"]) == 1
        out = json.loads(capsys.readouterr().out)
        assert out["healthy"] is False
        assert {m["name"]: m["reachable"] for m in out["members"]} == {**dict.fromkeys(others, True), victim_name: False}
        with EtcdClient.from_config(tc.admin, [tc.admin.member(n).client_url for n in others]) as c:
            for i in range(20):
                c.put(f"{prefix}{i}", b"x")  # writes commit with 2 of 3
    finally:
        tc.bed.set_link(victim, True)
    recover = wait_until(lambda: all(healthy_rows(tc.admin).values()), 60)
    url = tc.admin.member(victim_name).client_url

    def caught_up() -> bool:
        revs = {r.revision for r in cluster_status(tc.admin, timeout=1.0)}
        return len(revs) == 1

    wait_until(caught_up, 30)
    with EtcdClient.from_config(tc.admin, [url]) as c:
        assert c.count_prefix(prefix, endpoint=url) == 20
    print(f"\npartition of the {role} {victim_name}: detected (others healthy) in {detect:.1f}s, "
          f"all healthy {recover:.1f}s after reconnect")
