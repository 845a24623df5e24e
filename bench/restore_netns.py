"""The namespace tier of bench/restore_bench.py: three hosts fc1..fc3 (10.213.12.11-13) with sshd.

Built like tests/multihost/test_restore_ssh.py's bed (each host its own agent.toml through
/etc/netns, the process backend, etcd 3.5.16 with etcdutl), under the machine-wide bed lock. The
agent runs on fc1 (fc1 through LocalHost, fc2/fc3 over SSH, known_hosts enforced). By hand is
what an operator on fc1 does: per host stop etcd, ``mv`` the data dir aside, ``etcdutl snapshot
restore``, start etcd - fc1 in a local shell, fc2/fc3 through one OpenSSH command each that also
carries the snapshot on stdin (the least an operator can do over SSH); serially, and on all
three hosts at once. Then every member is polled healthy from outside, every 50 ms.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

import psutil

from bench.restore_bench import (
    Run,
    agent_run,
    extract_snapshot,
    interleave,
    new_token,
    report,
    restore_argv,
    wait_all_healthy,
)
from etcd_agent.config import Config
from etcd_agent.member.process import ProcessBackend
from etcd_agent.topology import parse_conf
from tests.harness import bedlock
from tests.harness.netns import NetnsBed, NsHost
from tests.multihost.test_restore_ssh import AGENT, AGENT_TOML, ETC_DIR, Bed, build, counts, put_many

PREFIX, SUBNET = "fc", "10.213.12"


def _host_script(cfg: Config, name: str, pid: int, snap: str, token: str, receive: bool) -> str:
    """One host's runbook as the shell lines an operator types (every value quoted)."""
    dd = cfg.data_dir(name)
    env = ["env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"] + [
        f"{k}={v}" for k, v in parse_conf(open(cfg.conf_file(name), encoding="utf-8").read()).items() if k.startswith("ETCD_")
    ]
    pidf = os.path.join(cfg.etcd.run_dir, f"{name}.by-hand-pid")
    log = os.path.join(cfg.etcd.run_dir, f"{name}.log")
    lines = ["set -e"]
    if receive:
        lines.append(f"cat > {shlex.quote(snap)}")
    lines += [
        f"kill -TERM {pid}",
        # etcd's parent may be gone (a zombie of a non-reaping init counts as stopped)
        f"while s=$(cut -d' ' -f3 /proc/{pid}/stat 2>/dev/null) && [ \"$s\" != Z ]; do sleep 0.05; done",
        shlex.join(["mv", dd, f"{dd}.by-hand-{time.time():.3f}"]),
        shlex.join(restore_argv(cfg, cfg.etcd.etcdutl or cfg.etcd.etcdctl, snap, name, dd, token)) + " >/dev/null",
        "setsid sh -c 'echo $$ > \"$0\"; exec \"$@\"' " + shlex.join([pidf, *env, cfg.etcd.binary])
        + f" >>{shlex.quote(log)} 2>&1 </dev/null &",
    ]
    return "\n".join(lines) + "\n"


class NetnsBench:
    def __init__(self, bed: Bed, snap: str) -> None:
        self.bed = bed
        self.snap = snap
        self.cfg = bed.cfg(bed.h1.name)

    def ssh_argv(self, h: NsHost, script: str) -> List[str]:
        net = self.bed.net
        return net.exec_argv(net.hosts[0], [
            "ssh", "-i", net.client_key, "-o", f"UserKnownHostsFile={net.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", f"root@{h.ip}", script])

    def one_host(self, h: NsHost, pid: int, token: str) -> None:
        local = h is self.bed.net.hosts[0]
        snap = self.snap if local else os.path.join(self.bed.work, h.name, "by-hand-snapshot.db")
        script = _host_script(self.cfg, h.name, pid, snap, token, receive=not local)
        if local:
            argv = self.bed.net.exec_argv(h, ["sh", "-c", script])
            subprocess.run(argv, check=True, capture_output=True, timeout=600)
        else:
            with open(self.snap, "rb") as fh:
                subprocess.run(self.ssh_argv(h, script), stdin=fh, check=True, capture_output=True, timeout=600)

    def by_hand(self, parallel: bool) -> Run:
        pids = {m.name: ProcessBackend(self.cfg, m.name).pid() for m in self.cfg.members}
        if not all(pids.values()):
            raise SystemExit(f"by hand: not every etcd runs before the round: {pids}")
        token = new_token()
        hosts = self.bed.net.hosts
        t0 = time.monotonic()
        if parallel:
            with ThreadPoolExecutor(len(hosts)) as ex:
                list(ex.map(lambda h: self.one_host(h, int(pids[h.name] or 0), token), hosts))
        else:
            for h in hosts:
                self.one_host(h, int(pids[h.name] or 0), token)
        steps = time.monotonic() - t0
        wait_all_healthy(self.cfg)
        run = Run(time.monotonic() - t0, {"hosts": steps, "wait": time.monotonic() - t0 - steps})
        self.adopt()
        return run

    def adopt(self) -> None:
        """After a round by hand (untimed): the etcds it started get the pid files the process
        backend writes, so the next agent round can stop them after its identity checks."""
        for m in self.cfg.members:
            with open(os.path.join(self.cfg.etcd.run_dir, f"{m.name}.by-hand-pid"), encoding="utf-8") as fh:
                pid = int(fh.read().strip())
            rec = {"pid": pid, "create_time": psutil.Process(pid).create_time(), "binary": self.cfg.etcd.binary}
            with open(os.path.join(self.cfg.etcd.run_dir, f"{m.name}.pid"), "w", encoding="utf-8") as fh:
                json.dump(rec, fh)


def netns(keys: int, rounds: int, directory: str) -> None:
    bedlock.acquire(say=lambda s: print(s, flush=True))
    made_etc = not os.path.exists(ETC_DIR)
    if made_etc:
        os.makedirs(ETC_DIR, mode=0o755)
    work = tempfile.mkdtemp(prefix="fc-restore-netns-", dir=directory)
    net = NetnsBed(3, prefix=PREFIX, subnet=SUBNET)
    try:
        bed = build(net, work)
        cfg = bed.cfg(net.hosts[0].name)
        put_many(cfg, "/k/", keys)
        res = bed.agent(net.hosts[0], "--json", "backup")
        if res.returncode != 0:
            raise SystemExit(f"backup failed: {res.stderr}")
        backup: Dict[str, object] = json.loads(res.stdout)
        snap = extract_snapshot(str(backup["path"]), work)
        print(f"netns: keys={keys} snapshot={backup['size']} bytes", flush=True)
        nb = NetnsBench(bed, snap)
        ways = {
            "agent restore --yes (SSH)": lambda: agent_run(net.exec_argv(net.hosts[0], [
                AGENT, "-c", AGENT_TOML, "--json", "restore", "--from", str(backup["path"]), "--yes"])),
            "by hand, serial": lambda: nb.by_hand(parallel=False),
            "by hand, 3 hosts at once": lambda: nb.by_hand(parallel=True),
        }

        def check() -> None:
            got = counts(cfg, "/k/", "/later/")
            if got != [keys, 0]:
                raise SystemExit(f"restored data wrong: counts {got}, expected {[keys, 0]}")

        runs = interleave(ways, rounds, between=lambda: put_many(cfg, "/later/", 100), check=check)
        report(f"netns, 3 hosts over SSH, {keys} keys, snapshot {backup['size']} bytes", runs,
               agent="agent restore --yes (SSH)")
    finally:
        net.down()  # every process of the namespaces by PID: etcd, sshd, sessions
        shutil.rmtree(work, ignore_errors=True)
        if made_etc:
            try:
                os.rmdir(ETC_DIR)
            except OSError:
                pass
        bedlock.release()
