"""`etcd-agent restore` on real systemd: three nspawn hosts rs1..rs3 (10.213.5.11-13) running
``etcd-agent.service`` (the daemon), etcd.service rendered by the agent, and a
``kube-apiserver.service`` stand-in fenced by the restore (``[kubernetes] fence = "unit"``).

The operator's command runs inside rs1 (nsenter: a root shell on master 1) and drives rs2/rs3
over SSH to their real sshd (host keys from the bed's known_hosts). Then the same restore is done
serially by hand with etcdctl, for comparison. Figures are printed and added to the tier summary.

The tests build on each other in file order (one cluster).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterator, List, Sequence

import pytest

from etcd_agent.config import Config
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.restore.orchestrator.plan import BUMP_REVISION
from etcd_agent.topology import initial_cluster, member_pairs
from tests.harness import agentbed, restorebed
from tests.harness.agentbed import main_pid
from tests.harness.nspawn import Container, NspawnBed
from tests.harness.releases import DEFAULT

from .conftest import METRICS, REPO

pytestmark = pytest.mark.systemd

PREFIX, SUBNET = "rs", "10.213.5"
DATA_DIR = "/var/lib/etcd/default.etcd"
APISERVER = "kube-apiserver.service"
KEYS = 10_000
LATER = 300
AGENT_UNIT = os.path.join(REPO, "systemd", "etcd-agent.service")
# answers /readyz 503 for its first READY_AFTER seconds, then 200 (as an apiserver warming up)
READY_AFTER = 2.0
STAND_IN = f"""[Unit]
Description=kube-apiserver stand-in (the restore fences it; /readyz on :6443 after {READY_AFTER:g} s)

[Service]
ExecStart=/usr/bin/python3 -c 'import http.server as h,time;t0=time.time();R=type("R",(h.BaseHTTPRequestHandler,),{{"log_message":lambda s,*a:None,"do_GET":lambda s:(s.send_response(200 if s.path=="/readyz" and time.time()-t0>={READY_AFTER} else 503),s.end_headers())}});h.HTTPServer(("",6443),R).serve_forever()'

[Install]
WantedBy=multi-user.target
"""


def agent_toml(hosts: Sequence[Container]) -> str:
    """One config for every host: each agent finds itself by name / IP."""
    return agentbed.agent_toml("rs", hosts, extra=(
        '\n[kubernetes]\nfence = "unit"\napiserver_unit = "kube-apiserver.service"\n'
        'readyz_url = "http://{host}:6443/readyz"\nreadyz_timeout = 60.0\n\n'
        '[ssh]\nuser = "root"\nidentity_file = "/etc/etcd-agent/id_ed25519"\n'
        'known_hosts = "/etc/etcd-agent/known_hosts"\nconnect_timeout = 3.0\ncommand_timeout = 120.0\n'))


def client_config(hosts: Sequence[Container]) -> Config:
    """The test side's view (from the root namespace): the members only."""
    return agentbed.parsed('[cluster]\nname = "rs"\ntoken = "rs-cluster-1"\n' + agentbed.members_toml(hosts))


def record(key: str, value: str) -> None:
    METRICS[f"restore (systemd tier): {key}"] = value
    print(f"\n[figure] {key}: {value}")


def journal(c: Container, unit: str, lines: int = 60) -> str:
    return c.exec(["journalctl", "--no-pager", "-o", "cat", "-n", str(lines), "-u", unit]).stdout


def show(c: Container, unit: str, prop: str) -> str:
    return c.systemctl("show", "-p", prop, "--value", unit).stdout.strip()


def agent(c: Container, *args: str, timeout: float = 300.0) -> "subprocess.CompletedProcess[str]":
    return c.exec(["etcd-agent", *args], timeout=timeout)


def put_many(cfg: Config, prefix: str, n: int, workers: int = 4) -> None:
    """``n`` keys of 64 ``x``s, in multi-put transactions (``tests/harness/restorebed.py``)."""
    restorebed.put_many(cfg, prefix, n, workers)


def counts(cfg: Config, endpoint: str, *prefixes: str) -> List[int]:
    with EtcdClient.from_config(cfg, timeout=5.0) as cl:
        return [cl.count_prefix(p, endpoint=endpoint) for p in prefixes]


def wait_healthy(cfg: Config, timeout: float) -> float:
    t0 = time.monotonic()
    bad: List[str] = []
    with EtcdClient.from_config(cfg, timeout=2.0) as cl:
        while time.monotonic() - t0 < timeout:
            bad = [m.name for m in cfg.members if not cl.healthy(m.client_url, timeout=2.0)[0]]
            if not bad:
                return time.monotonic() - t0
            time.sleep(0.2)
    raise AssertionError(f"not healthy after {timeout:.0f}s: {bad}")


def revisions(cfg: Config) -> Dict[str, int]:
    with EtcdClient.from_config(cfg, timeout=3.0) as cl:
        return {m.name: cl.status(m.client_url).revision for m in cfg.members}


def each(bed: NspawnBed, fn) -> list:  # type: ignore[no-untyped-def]
    with ThreadPoolExecutor(max_workers=len(bed)) as pool:
        return list(pool.map(fn, bed.containers))


@pytest.fixture(scope="module")
def rs(base_tree: str) -> Iterator[NspawnBed]:
    bed = NspawnBed(3, prefix=PREFIX, subnet=SUBNET, base=base_tree)
    try:
        bed.up()
        t0 = time.monotonic()
        agentbed.install_agents(bed, REPO, AGENT_UNIT, agent_toml(bed.containers), extra_units={APISERVER: STAND_IN})
        wait_healthy(client_config(bed.containers), 120)
        record("bed", f"3 hosts up in {bed.timings['up']:.1f} s; agent installed, daemons bootstrapped "
                      f"a static cluster in {time.monotonic() - t0:.1f} s")
        yield bed
    finally:
        bed.down()


@pytest.fixture(scope="module")
def backup(rs: NspawnBed) -> Dict:
    cfg = client_config(rs.containers)
    t = time.monotonic()
    put_many(cfg, "/k/", KEYS)
    put_s = time.monotonic() - t
    res = agent(rs[0], "--json", "backup")
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    put_many(cfg, "/later/", LATER)
    record("keys", f"{KEYS} put in {put_s:.1f} s; backup {out['path']} ({out['size']} bytes, revision {out['revision']})")
    return out


def test_dry_run(rs: NspawnBed, backup: Dict) -> None:
    pids = {c.name: (main_pid(c, "etcd"), main_pid(c, APISERVER)) for c in rs.containers}
    res = agent(rs[0], "restore", "--from", backup["path"], "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr.count("pre-check ok") == 3, res.stderr
    assert f"stop {APISERVER}" in res.stdout and "chown -R etcd:etcd /var/lib/etcd/default.etcd" in res.stdout
    # etcd 3.5.16's etcdutl on every host: the restored revision is bumped for the apiservers' watch caches
    assert f"revision bumped by {BUMP_REVISION}" in res.stdout and res.stdout.count("--mark-compacted") == 3
    print("\n--- restore --dry-run (systemd tier) ---\n" + res.stdout)
    assert {c.name: (main_pid(c, "etcd"), main_pid(c, APISERVER)) for c in rs.containers} == pids


def test_disaster_restore_with_daemons_running(rs: NspawnBed, backup: Dict) -> None:
    cfg = client_config(rs.containers)
    api_pids = {c.name: main_pid(c, APISERVER) for c in rs.containers}

    def disaster(c: Container) -> None:
        # the data disks are gone: etcd down, data dir deleted; the daemon comes back and finds that
        c.systemctl("stop", "etcd-agent", "etcd", check=True)
        c.exec(["rm", "-rf", DATA_DIR], check=True)
        c.systemctl("start", "etcd-agent", check=True)

    each(rs, disaster)
    t0 = time.monotonic()
    res = agent(rs[0], "--json", "restore", "--from", backup["path"], "--yes")
    wall = time.monotonic() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    outcome = json.loads(res.stdout)
    phases = outcome["timings"]
    # the apiservers came back one at a time, each after the one before answered /readyz
    assert sorted(outcome["apiservers"]) == [c.name for c in rs.containers], outcome["apiservers"]
    assert all(v.startswith("ready after") for v in outcome["apiservers"].values()), outcome["apiservers"]
    # the containers share the host kernel's monotonic clock: their start times compare directly
    order = [int(c.systemctl("show", APISERVER, "-p", "ExecMainStartTimestampMonotonic", "--value").stdout.strip() or 0)
             / 1e6 for c in rs.containers]
    for a, b in zip(order, order[1:]):
        assert b - a >= READY_AFTER - 0.2, f"the next apiserver started {b - a:.2f} s after the previous one: {order}"
    revs = revisions(cfg)
    assert len(set(revs.values())) == 1 and min(revs.values()) > backup["revision"] + BUMP_REVISION, revs
    for c in rs.containers:
        ep = f"http://{c.ip}:2379"
        assert counts(cfg, ep, "/k/", "/later/") == [KEYS, 0], c.name
        # chown -R etcd:etcd really applied (the restore runs as root)
        owners = c.exec(["find", DATA_DIR, "-not", "-user", "etcd"]).stdout.split()
        assert owners == [], f"{c.name}: not owned by etcd: {owners[:5]}"
        assert c.exec(["stat", "-c", "%U:%G", DATA_DIR]).stdout.strip() == "etcd:etcd"
        # the apiserver stand-in was stopped during the restore and runs again
        assert c.systemctl("is-active", APISERVER).stdout.strip() == "active"
        assert main_pid(c, APISERVER) not in (0, api_pids[c.name]), f"{c.name}: {APISERVER} was not fenced"
        api_log = journal(c, APISERVER)
        assert "Stopped" in api_log or "Stopping" in api_log, api_log
        # the daemon waited while the restore ran, and is back in charge of a healthy member
        log = journal(c, "etcd-agent", 400)
        assert "is in progress on this host; hands off" in log, log[-3000:]
        assert "Traceback" not in log
        assert not c.exec(["ls", "/var/lib/etcd-agent"]).stdout.count("restore-in-progress")
    status = agent(rs[0], "status")
    assert status.returncode == 0 and "RESTORE IN PROGRESS" not in status.stdout, status.stdout
    time.sleep(3)  # three daemon cycles on the restored cluster
    wait_healthy(cfg, 10)
    record("restore --yes over SSH, data dirs deleted on 3 hosts, daemons running",
           f"wall {wall:.1f} s, {KEYS} keys back, none of {LATER} later, revision {set(revs.values())}")
    record("restore phases", ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
    record("apiservers unfenced one at a time", ", ".join(f"{n} {v}" for n, v in outcome["apiservers"].items())
           + "; started " + ", ".join(f"+{t - order[0]:.1f} s" for t in order))
    print("\n".join(line for line in res.stderr.splitlines() if "restore:" in line))


def test_unreachable_host_at_precheck_refused(rs: NspawnBed, backup: Dict) -> None:
    cfg = client_config(rs.containers)
    before = {c.name: agentbed.untouched_state(c, DATA_DIR, ("etcd", APISERVER)) for c in rs.containers}
    rs3 = rs.net.hosts[2]
    rs.net.set_link(rs3, False)
    try:
        t = time.monotonic()
        res = agent(rs[0], "restore", "--from", backup["path"], "--yes")
        took = time.monotonic() - t
    finally:
        rs.net.set_link(rs3, True)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "rs3 (10.213.5.13): pre-check FAILED: unreachable" in res.stderr, res.stderr
    assert "rs1 (local): pre-check ok" in res.stderr and "rs2 (10.213.5.12): pre-check ok" in res.stderr
    after = {c.name: agentbed.untouched_state(c, DATA_DIR, ("etcd", APISERVER)) for c in rs.containers}
    assert after == before, "nothing may be stopped or touched when a pre-check fails"
    wait_healthy(cfg, 30)
    record("host unreachable at pre-check", f"refused (exit 3) in {took:.1f} s; etcd, apiserver and data untouched")


def test_same_restore_serially_by_hand(rs: NspawnBed, backup: Dict) -> None:
    """The seed runbook, one host after another: stop the apiserver and etcd, move the data dir
    aside, copy the snapshot over, `etcdutl snapshot restore` (the cluster's release) with the
    host's flags, chown, start etcd; then wait for the cluster and start the apiservers. The
    daemons are stopped for it."""
    cfg = client_config(rs.containers)
    put_many(cfg, "/later/", 10)
    each(rs, lambda c: c.systemctl("stop", "etcd-agent", check=True))
    work = tempfile.mkdtemp(prefix="rs-hand-")
    try:
        with tarfile.open(os.path.join(rs[0].root, backup["path"].lstrip("/"))) as t:
            src = t.extractfile("etcd_snapshot.db")
            assert src is not None
            with open(os.path.join(work, "snap.db"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        ic = initial_cluster(member_pairs(cfg.members))
        t0 = time.monotonic()
        for c in rs.containers:
            m = cfg.member(c.name)
            c.systemctl("stop", APISERVER, "etcd", check=True)
            c.exec(["mv", DATA_DIR, f"{DATA_DIR}.by-hand"], check=True)
            shutil.copyfile(os.path.join(work, "snap.db"), os.path.join(c.root, "var/tmp/snap.db"))  # "scp"
            c.exec([f"/opt/etcd/{DEFAULT}/etcdutl", "snapshot", "restore", "/var/tmp/snap.db", f"--name={m.name}",
                    f"--initial-cluster={ic}", "--initial-cluster-token=rs-by-hand",
                    f"--initial-advertise-peer-urls={m.peer_url}", f"--data-dir={DATA_DIR}"], check=True)
            c.exec(["chown", "-R", "etcd:etcd", DATA_DIR], check=True)
            c.systemctl("start", "--no-block", "etcd", check=True)
        wait_healthy(cfg, 60)
        for c in rs.containers:
            c.systemctl("start", APISERVER, check=True)
        hand = time.monotonic() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
        each(rs, lambda c: c.systemctl("start", "etcd-agent"))
    for c in rs.containers:
        assert counts(cfg, f"http://{c.ip}:2379", "/k/", "/later/") == [KEYS, 0]
    record("same restore serially by hand (etcdutl, 3 hosts)", f"{hand:.1f} s (commands back to back, no "
           "typing, no checks, no rollback; the agent's wall time above includes verify, pre-checks and locks)")


def test_an_etcd_running_outside_the_unit_is_refused(rs: NspawnBed, backup: Dict) -> None:
    """rs2's etcd runs outside etcd.service (a transient unit with the same conf, as an operator's
    `systemd-run` would leave it): not the unit's MainPID, so not the agent's to stop. The restore
    is refused naming its pid and command line, and nothing is touched (issue 38, item 2)."""
    cfg = client_config(rs.containers)
    rs2 = rs[1]
    binary = re.search(r"path=(\S+)", show(rs2, "etcd", "ExecStart"))
    assert binary is not None
    rs2.systemctl("stop", "etcd-agent", check=True)  # its daemon would start etcd.service again
    rs2.systemctl("stop", "etcd", check=True)
    try:
        rs2.exec(["systemd-run", "--unit=etcd-by-hand", "-p", "EnvironmentFile=/etc/etcd/etcd.conf", "-p", "User=etcd",
                  binary.group(1)], check=True)
        wait_healthy(cfg, 60)
        pid = main_pid(rs2, "etcd-by-hand")
        before = {c.name: agentbed.untouched_state(c, DATA_DIR, (APISERVER,)) for c in rs.containers}
        res = agent(rs[0], "restore", "--from", backup["path"], "--yes")
        assert res.returncode == 3, res.stdout + res.stderr
        assert f"pid {pid} ({binary.group(1)}) has {DATA_DIR}/member/snap/db open" in res.stderr, res.stderr
        assert "this agent did not start it (systemd backend)" in res.stderr, res.stderr
        after = {c.name: agentbed.untouched_state(c, DATA_DIR, (APISERVER,)) for c in rs.containers}
        assert after == before and main_pid(rs2, "etcd-by-hand") == pid
        record("etcd outside the unit", "refused (exit 3), naming its pid and command line; nothing touched")
    finally:
        rs2.systemctl("stop", "etcd-by-hand")
        rs2.systemctl("start", "--no-block", "etcd")
        rs2.systemctl("start", "etcd-agent")
    wait_healthy(cfg, 60)
