#!/usr/bin/env python3
"""Benchmark: a point-in-time restore against the plain restore of the same full backup.

A 3-member loopback cluster (etcd 3.5.16, fsync on) gets ``--full-keys`` keys of ``--size``
bytes; full backup A is taken, then a chain of ``--events`` events continues A, full backup B is
taken, and a chain of ``--long-events`` events continues B. The events: mostly single puts over
50,000 keys of their own, or with ``--chain-keys updates`` over the full backup's keys (a state
that keeps its size, as a Kubernetes cluster's mostly does), every 10th a 3-key transaction,
every 25th a delete. The chains:

- ``--chain live`` (default): written as the product writes them - the daemon's supervisor (in
  this process) watching the cluster while a writer (``livechain``) puts the events in, with the
  checkpoints it takes on its own (``[backup.delta]`` defaults, but checkpoint_min_seconds
  ``--checkpoint-min-seconds``: the product's 60 s at 500 writes/s is ~30,000 events, and the
  bench writes several times faster), the cluster compacted as the apiserver does it
  (``--compact-seconds``);
- ``--chain synthetic``: segment files written straight (``delta_bench.synthetic_chain``): no
  checkpoint, the replay of the whole chain.

Then ``--rounds`` interleaved rounds (the order rotated each round, so a noisy neighbour hits
every way alike) of real ``etcd-agent --json restore ... --yes`` runs, each timed from the
command to its exit (every member healthy):

- ``plain A``: ``--from A``;  ``pitr A``: ``--from A --to newest`` (the replay of the chain, from
  its newest checkpoint if there is one, then the same restore of its result);
- ``plain B``, ``pitr B`` likewise; ``pitr B, whole chain`` (live chains): ``--no-checkpoint``;
- ``plain A@target``, ``plain B@target``: a full backup of the state each point-in-time restore
  reaches (taken once, of the cluster that restore left), restored plainly: the floor of any
  replay design, since the restore ships and starts that larger state whatever produced it.

Printed: each way's wall (min/median/max), and each point-in-time restore's ratio to the plain
restore of the same full backup and to the plain restore of its target state (median over
median, and per round), the target state's to the full backup's, and each way's phase timings
(the restore's JSON ``timings``). The goal (issue 24): ``pitr B / plain B`` <= 1.5.

    flock /tmp/etcd-agent-heavy.lock .venv/bin/python bench/pitr_bench.py [--rounds 3]
        [--events 100000] [--long-events 600000] [--full-keys 10000] [--chain-keys new|updates]
        [--chain live|synthetic] [--checkpoint-min-seconds 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from bench.delta_bench import synthetic_chain  # noqa: E402
from bench.installed import byte_compile  # noqa: E402
from bench.livechain import delta_config, live_chain, warm_up  # noqa: E402
from bench.restore_bench import Run, agent_run, interleave  # noqa: E402
from etcd_agent.backup import keys  # noqa: E402
from etcd_agent.backup.service import take_backup  # noqa: E402
from etcd_agent.chain import chains as delta_chains  # noqa: E402
from etcd_agent.continuous.supervisor import DeltaSupervisor  # noqa: E402
from etcd_agent.etcd import proto  # noqa: E402
from etcd_agent.etcd.rpc import EtcdRpc  # noqa: E402
from tests.harness.loopback import LoopbackCluster  # noqa: E402
from tests.integration.test_restore import AGENT, EXTRA  # noqa: E402


def fill(rpc: EtcdRpc, keys: int, size: int) -> Dict[bytes, tuple]:
    """``keys`` keys full/NNNNNN of ``size`` bytes; returns key -> (create revision, version)."""
    value = os.urandom(size)
    made: Dict[bytes, tuple] = {}
    for i in range(0, keys, 100):
        batch = [b"full/%06d" % j for j in range(i, min(i + 100, keys))]
        rev = rpc.txn([proto.op_put(k, value) for k in batch]).revision
        made.update((k, (rev, 1)) for k in batch)
    return made


def members_config(cfg_path: str) -> str:
    """A copy of the bench cluster's config whose point-in-time restores load the tail into the
    restored members (``[backup.delta] point_in_time_load = "members"``): the same cluster."""
    with open(cfg_path) as fh:
        text = fh.read()
    line = 'point_in_time_load = "members"\n'
    text = text.replace("[backup.delta]\n", "[backup.delta]\n" + line, 1) if "[backup.delta]\n" in text else (
        text + "\n[backup.delta]\n" + line)
    out = os.path.join(os.path.dirname(cfg_path), "agent-members.toml")
    with open(out, "w") as fh:
        fh.write(text)
    return out


def state_digest(c: LoopbackCluster) -> str:
    """sha256 of every key, value and lease the cluster serves now (the two ways must agree)."""
    import hashlib

    h = hashlib.sha256()
    with EtcdRpc(c.cfg.members[0].client_url, timeout=60.0, max_message=1 << 30) as r:
        for kv in sorted(r.range(b"\0", b"\0").kvs, key=lambda kv: kv.key):
            if kv.key.startswith(b"/etcd-agent/"):  # the agent's own lineage record differs by design
                continue
            h.update(b"%d:%s%d:%s%d;" % (len(kv.key), kv.key, len(kv.value), kv.value, kv.lease))
    return h.hexdigest()


def restore_run(cfg_path: str, backup: str, pitr: bool, new_cluster: bool = False, whole: bool = False,
                tree: str = "") -> Run:
    # ``tree``: another checkout's package run instead (its `node serve` children inherit it)
    argv = (["env", f"PYTHONPATH={tree}"] if tree else []) + [AGENT, "-c", cfg_path, "--json", "restore", "--from", backup]
    if pitr:
        argv += ["--to", "newest"] + (["--no-checkpoint"] if whole else [])
    if new_cluster:  # a backup of the cluster as a later restore replaced it: a rollback point
        argv += ["--new-cluster"]
    return agent_run(argv + ["--yes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--long-events", type=int, default=600_000)
    ap.add_argument("--full-keys", type=int, default=10_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--chain-keys", choices=("new", "updates"), default="new",
                    help="the chain's puts: 50,000 keys of its own (default), or the full backup's keys")
    ap.add_argument("--chain", choices=("live", "synthetic"), default="live")
    ap.add_argument("--checkpoint-min-seconds", type=float, default=10.0)
    ap.add_argument("--warmup-events", type=int, default=100_000,
                    help="live chains: events written before full backup A (no watch): A is then a backup of a "
                         "cluster that has been running, as the checkpoints are")
    ap.add_argument("--compact-seconds", type=float, default=10.0,
                    help="live chains: compact every this often to the revision of this long before (the apiserver's "
                         "5 minutes, in the bench's time)")
    ap.add_argument("--members", choices=("true", "false"), default="true",
                    help="also pitr B with the tail loaded into the restored members (point_in_time_load = members)")
    ap.add_argument("--keep", action="store_true", help="leave the work dir (backups, config) for profiling")
    ap.add_argument("--json")
    ap.add_argument("--baseline", default="", help="another checkout (e.g. `git archive` of main): its pitr B and "
                    "plain B restores interleaved with this tree's, an A/B on the same chain")
    a = ap.parse_args()
    a.members = a.members == "true"
    byte_compile()
    if a.baseline and not compileall.compile_dir(os.path.join(a.baseline, "etcd_agent"), quiet=1, workers=0):
        raise SystemExit(f"cannot byte-compile {a.baseline}")
    work = tempfile.mkdtemp(prefix="pitr-bench-", dir=a.dir)
    extra = delta_config(a.checkpoint_min_seconds) if a.chain == "live" else ""
    c = LoopbackCluster(os.path.join(work, "c"), 3, extra=extra + EXTRA)
    report: Dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
                              "full_keys": a.full_keys, "size": a.size, "rounds": a.rounds,
                              "chain_keys": a.chain_keys, "chain": a.chain}
    try:
        c.start_static()
        rpc = EtcdRpc(c.cfg.members[0].client_url, timeout=30.0)
        filled = fill(rpc, a.full_keys, a.size)
        if a.chain == "live" and a.warmup_events:
            warm = warm_up(c.cfg, a.warmup_events, a.size, compact_seconds=a.compact_seconds, **chain_keys(a))
            report["warmup"] = warm
            print(f"warm-up: {warm['events']} events in {warm['write_seconds']:.0f}s, no watch", flush=True)
        full_a = take_backup(c.cfg, member="m1")
        chains: Dict[str, Dict[str, Any]] = {}
        if a.chain == "live":
            full_b = live_chains(c, a, full_a, chains)
        else:
            rpc.txn([proto.op_put(b"between", b"A and B")])
            full_b = take_backup(c.cfg, member="m1")
        rpc.close()
        assert full_a.revision is not None and full_b.revision is not None
        t0 = int(time.time() * 1000) - 3_600_000
        for name, full, events in (("A", full_a, a.events), ("B", full_b, a.long_events)):
            if a.chain == "live":
                break
            t = time.monotonic()
            if a.chain_keys == "new":  # 50,000 keys of its own: the state grows ~5x
                last = synthetic_chain(c.cfg.backup.dir, full.revision, events, a.size, t0, base_sha256=full.sha256,
                                       sign_key=keys.local_key(c.cfg).key)
            else:  # the full backup's own keys, updated and deleted: the state keeps its size
                last = synthetic_chain(c.cfg.backup.dir, full.revision, events, a.size, t0, base_sha256=full.sha256,
                                       key_format=b"full/%06d", key_count=a.full_keys, existing=filled,
                                       sign_key=keys.local_key(c.cfg).key)
            segs = [p for p in os.listdir(c.cfg.backup.dir) if p.startswith("etcd-delta-")]
            chains[name] = {"backup": os.path.basename(full.path), "bytes": full.size, "revision": full.revision,
                            "events": events, "last_revision": last}
            print(f"full backup {name}: {full.size / 1e6:.1f} MB at revision {full.revision}; chain of {events} "
                  f"events to revision {last} written in {time.monotonic() - t:.0f}s ({len(segs)} segment files "
                  "in the dir)", flush=True)
        report["chains"] = chains
        # the floor: a full backup already holding each target's state (taken of the cluster a
        # point-in-time restore just left), restored plainly - what no replay design can beat
        at_target = {}
        digests: Dict[str, str] = {}
        for name, full in (("A", full_a), ("B", full_b)):
            restore_run(c.config_path, full.path, True)  # exits the bench if it fails
            digests[name] = state_digest(c)
            at_target[name] = take_backup(c.cfg, member="m1")
            chains[name]["target_state_backup_bytes"] = at_target[name].size
            print(f"full backup of {name}'s target state: {at_target[name].size / 1e6:.1f} MB", flush=True)
        ways = {
            "plain A": lambda: restore_run(c.config_path, full_a.path, False),
            f"pitr A (+{a.events} events)": lambda: restore_run(c.config_path, full_a.path, True),
            "plain A@target": lambda: restore_run(c.config_path, at_target["A"].path, False, True),
            "plain B": lambda: restore_run(c.config_path, full_b.path, False),
            f"pitr B (+{a.long_events} events)": lambda: restore_run(c.config_path, full_b.path, True),
            "plain B@target": lambda: restore_run(c.config_path, at_target["B"].path, False, True),
        }
        if a.chain == "live":
            ways["pitr B, whole chain (--no-checkpoint)"] = lambda: restore_run(c.config_path, full_b.path, True,
                                                                                 whole=True)
        if a.members:
            members = members_config(c.config_path)

            def members_b() -> Run:
                run = restore_run(members, full_b.path, True)
                got = state_digest(c)  # untimed: the same data as the throwaway member's replay left
                if got != digests["B"]:
                    raise SystemExit(f"pitr B, members load: the cluster holds another state (sha256 {got[:16]}) "
                                     f"than the replay's ({digests['B'][:16]})")
                return run

            ways[f"pitr B, members load (+{a.long_events} events)"] = members_b
        if a.baseline:
            ways["pitr B (baseline)"] = lambda: restore_run(c.config_path, full_b.path, True, tree=a.baseline)
            ways["plain B (baseline)"] = lambda: restore_run(c.config_path, full_b.path, False, tree=a.baseline)
        runs = interleave(ways, a.rounds, between=lambda: None, check=lambda: None)
        names = list(ways)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"\n== point-in-time restore vs plain restore, 3 members, full backup of {a.full_keys} keys x "
              f"{a.size} B ({a.rounds} rounds; load average now {load}, {os.cpu_count()} cpus)")
        print(f"{'wall s':<34} {'min':>6} {'median':>6} {'max':>6}")
        out: Dict[str, Any] = {}
        for n in names:
            w = [r.wall for r in runs[n]]
            print(f"{n:<34} {min(w):6.2f} {statistics.median(w):6.2f} {max(w):6.2f}")
            out[n] = {"walls": w, "phases": [r.phases for r in runs[n]]}
        pairs = [(names[0], names[1]), (names[3], names[4]), (names[2], names[1]), (names[5], names[4]),
                 (names[0], names[2]), (names[3], names[5])]
        if a.chain == "live":
            pairs += [(names[3], names[6]), (names[4], names[6])]
        if a.baseline:
            pairs += [("plain B (baseline)", "pitr B (baseline)"), ("pitr B (baseline)", names[4])]
        if a.members:
            way = f"pitr B, members load (+{a.long_events} events)"
            pairs += [(names[3], way), (names[5], way), (names[4], way)]  # plain B, plain B@target, pitr B
        for plain, pitr in pairs:
            pw, qw = [r.wall for r in runs[plain]], [r.wall for r in runs[pitr]]
            per = [q / p for p, q in zip(pw, qw)]
            ratio = statistics.median(qw) / statistics.median(pw)
            print(f"ratio {pitr} / {plain}: {ratio:.2f} (median over median); per round min/median/max "
                  f"{min(per):.2f} / {statistics.median(per):.2f} / {max(per):.2f}")
            out[f"ratio {pitr} / {plain}"] = {"median_over_median": ratio, "per_round": per}
        report["ways"] = out
        report["machine"]["loadavg_end"] = os.getloadavg()
        if a.json:
            with open(a.json, "w") as fh:
                fh.write(json.dumps(report, indent=2) + "\n")
    finally:
        c.stop()
        if a.keep:
            print(f"kept: {work} (config {c.config_path})")
        else:
            shutil.rmtree(work, ignore_errors=True)


def chain_keys(a: argparse.Namespace) -> Dict[str, Any]:
    """The live writer's keys: 50,000 of its own, or the full backup's."""
    if a.chain_keys == "new":
        return {"key_format": b"syn/%06d", "key_count": 50000}
    return {"key_format": b"full/%06d", "key_count": a.full_keys}


def live_chains(c: LoopbackCluster, a: argparse.Namespace, full_a: Any, chains: Dict[str, Dict[str, Any]]) -> Any:
    """Chain A of ``a.events`` continuing ``full_a``, full backup B, chain B of ``a.long_events``:
    written by a writer while the daemon's supervisor watches and takes its checkpoints. Returns B."""
    keys = chain_keys(a)
    sup = DeltaSupervisor(lambda: (c.cfg, c.cfg.member("m1")))
    sup.start()
    try:
        full_b = None
        for name, full, events in (("A", full_a, a.events), ("B", None, a.long_events)):
            if full is None:
                full = full_b = take_backup(c.cfg, member="m1")  # the supervisor moves to a new chain
            got = live_chain(c.cfg, sup, full.revision, events, a.size, compact_seconds=a.compact_seconds, **keys)
            found = delta_chains.scan(c.cfg.backup.dir)
            ch = next(x for x in found.chains if x.base_revision == full.revision)
            chains[name] = {"backup": os.path.basename(full.path), "bytes": full.size, "revision": full.revision,
                            **got, "segments": ch.usable, "chain_bytes": ch.bytes,
                            "checkpoints": [cp.to_json() for cp in ch.checkpoints],
                            "events_after_newest_checkpoint": ch.replay_events}
            print(f"full backup {name}: {full.size / 1e6:.1f} MB at revision {full.revision}; a live chain of "
                  f"{got['events']} events to revision {got['last_revision']} in {got['write_seconds']:.0f}s "
                  f"({got['rate']:.0f} events/s; {ch.usable} segments, {ch.bytes / 1e6:.0f} MB); the chain vouches for "
                  f"{len(ch.checkpoints)} checkpoint(s), {ch.replay_events} events after the newest", flush=True)
    finally:
        sup.stop()
    return full_b


if __name__ == "__main__":
    main()
