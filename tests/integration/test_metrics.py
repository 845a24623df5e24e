"""The daemon's Prometheus endpoint, scraped from a real daemon process on a loopback cluster."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from etcd_agent.backup.service import take_backup
from etcd_agent.daemon.metrics import samples
from tests.harness.loopback import free_port_pairs

pytestmark = pytest.mark.integration


def test_scrape_daemon_metrics(cluster_factory, tmp_path):
    (port, _), = free_port_pairs(1)
    state = tmp_path / "state"
    c = cluster_factory(3, extra=f'[daemon]\nstate_dir = "{state}"\nmetrics_address = "127.0.0.1:{port}"\n')
    c.start_static()
    with c.client() as cl:
        cl.put("/metrics/k", b"v")
    take_backup(c.cfg, member="m1", prune=False)
    os.makedirs(state, exist_ok=True)
    with open(state / "upgrade.json", "w") as fh:  # as `etcd-agent upgrade` leaves it
        json.dump({"target": "3.5.1", "state": "done", "total": 3, "done": 3, "updated": time.time()}, fh)

    log_path = tmp_path / "daemon.log"  # a file, not a pipe nobody reads until the end: a pipe fills and stalls it
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "etcd_agent.cli.main", "-c", c.config_path, "run",
                             "--member", "m2", "--interval", "1"], stderr=log, text=True)
    try:
        text, deadline = "", time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                # a full refresh has finished once its last gauge is set
                if any(n == "etcd_agent_last_cycle_timestamp_seconds" and v > 0 for n, _l, v in samples(text)):
                    break
            except OSError:
                pass
            time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
    daemon_log = log_path.read_text()[-3000:]
    got = {(n, tuple(sorted(labels.items()))): v for n, labels, v in samples(text)}
    for m in ("m1", "m2", "m3"):
        assert got.get(("etcd_agent_member_healthy", (("member", m),))) == 1.0, (text[-2000:], daemon_log)
        assert got[("etcd_agent_db_size_bytes", (("member", m),))] > 0
    assert sum(v for (n, _l), v in got.items() if n == "etcd_agent_member_is_leader") == 1.0
    assert got[("etcd_agent_cluster_healthy_members", ())] == 3.0
    assert 0 <= got[("etcd_agent_backup_age_seconds", ())] < 300
    assert got[("etcd_agent_backup_count", ())] == 1.0
    assert got[("etcd_agent_upgrade_members_done", ())] == 3.0
    assert got[("etcd_agent_upgrade_in_progress", ())] == 0.0
    with open(os.environ.get("SCRAPE_OUT", "/tmp/etcd-agent-scrape.txt"), "w") as fh:
        fh.write(text)
