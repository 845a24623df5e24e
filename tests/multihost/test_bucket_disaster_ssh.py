"""The disaster, end to end, from the bucket alone (issue 33 item 7): three namespace masters ew1..ew3
(10.213.31.11-13), each with sshd, its own agent.toml and its own `etcd-agent run` daemon (process
backend, etcd 3.5.16) watching its member into its own delta chain and copying every full backup
and segment to a real S3 server (Ceph RGW on the bridge, fixture ``rgw_bridge``) under one prefix,
while a writer logs every acknowledged write. The disaster: every daemon and every etcd killed at
once; on every master the data dir, the backup dir and the cached manifest.key removed (the key kept
"off-host" first); the daemons restarted (they wait: these hosts ran members before). One command on
ew1, `restore --from-bucket latest --to newest --key-file K --yes` (and `--identity` when the
backups are encrypted), fetches and checks the chain there; the other masters receive the snapshot
over their node sessions. Then:

- every write the bucket held at the wipe is back (everything acknowledged longer ago than
  close_seconds + the upload lag; the figure says how long that was), no deleted key back, no key
  of a lease expired by then back;
- every master serves one new cluster with the config's three members, as each host's bootstrap
  record says, and the restarted daemons carry on on it (new chains) without bootstrapping another;
- `restore --from-bucket latest --to-revision N` equals the live ``Range(rev=N)`` read before the
  wipe.

The plain variant and the encrypted one (``[backup] encrypt_to``: full backups and segments in age
in the bucket, the restore given ``--identity``)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

from etcd_agent.backup.keys import key_path
from etcd_agent.chain import chains
from etcd_agent.chain.segments import parse_name
from etcd_agent.config import Config
from etcd_agent.errors import OperationFailed
from etcd_agent.etcd.client import EtcdClient
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.member.process import ProcessBackend
from etcd_agent.state import bootstrap
from etcd_agent.waiting import poll
from tests.harness.netns import NetnsBed, NsHost
from tests.harness.restorebed import retry_busy
from tests.harness.rgw import RgwBed, remote_table
from tests.integration.continuous import dump
from tests.integration.test_pitr_disaster import Writer, account, compare, live_at
from tests.multihost.test_pitr_ssh import AGENT, AGENT_TOML, Bed, agent_toml, daemon_bed, healthy

pytestmark = pytest.mark.multihost

PREFIX, SUBNET = "ew", "10.213.31"
CLOSE_SECONDS = 2.0  # short: the writer need not run long for several segments to reach the bucket
BUCKET_PREFIX = "p/{host}/"
WAITING = "not bootstrapping a second cluster"  # a restarted daemon's decision on a wiped host


@dataclass
class Variant:
    name: str
    recipient: str = ""  # [backup] encrypt_to, and
    identity: str = ""  # the restore's --identity


class HostBed(Bed):
    """The daemons and the operator's commands run with the master's own hostname (a UTS
    namespace of their own), as on a real master: ``{host}`` in the bucket prefix names it."""

    def as_host(self, h: NsHost, *args: str) -> List[str]:
        return self.net.exec_argv(h, ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', h.name,
                                      AGENT, "-c", AGENT_TOML, *args])

    def start_daemon(self, h: NsHost) -> None:
        log = open(os.path.join(self.work, f"daemon-{h.name}.log"), "ab")
        self.daemons[h.name] = subprocess.Popen(self.as_host(h, "run"), stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT)
        self.net._procs.append(self.daemons[h.name])

    def agent(self, h: NsHost, *args: str, timeout: float = 600) -> "subprocess.CompletedProcess[str]":
        return subprocess.run(self.as_host(h, *args), capture_output=True, text=True, timeout=timeout)


def toml_for(rgw: RgwBed, bucket: str, v: Variant):  # type: ignore[no-untyped-def]
    def toml(work: str, hosts: List[NsHost], me: NsHost, net: NetnsBed) -> str:
        text = agent_toml(work, hosts, me, net, cluster=PREFIX, close_seconds=CLOSE_SECONDS)
        if v.recipient:
            text = text.replace("[backup.delta]", f'encrypt_to = ["{v.recipient}"]\n[backup.delta]', 1)
        # the product's default layout: one folder per master (the sample's etcd-backup/{cluster}/{host}/)
        return text + remote_table(rgw, bucket, prefix=BUCKET_PREFIX, keep_last=10, connect_timeout=2,
                                   read_timeout=20)
    return toml


def chain_ends(rgw: RgwBed, bucket: str) -> Dict[str, int]:
    """<host>/chains/<key> -> the end revision of its newest segment in the bucket (0: none yet)."""
    out: Dict[str, int] = {}
    for page in rgw.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="p/"):
        for o in page.get("Contents", []):
            parts = o["Key"].split("/")
            if "chains" not in parts[:-1]:
                continue
            chain = "/".join(parts[1:parts.index("chains") + 2])
            rng = parse_name(parts[-1])
            out[chain] = max(out.get(chain, 0), rng[1] if rng else 0)
    return out


def bucket_keys(rgw: RgwBed, bucket: str) -> List[str]:
    return [o["Key"] for page in rgw.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])]


def reach(rgw: RgwBed, bucket: str, hosts_wanted: int) -> int:
    """The revision every master's copies in the bucket have reached: per host the furthest end of
    its chains (a daemon that took a new full backup - the cluster's membership changed since its
    first one - starts a new chain and leaves the old one where it ended), then the least of
    them; 0 until ``hosts_wanted`` hosts have a chain."""
    per_host: Dict[str, int] = {}
    for chain, end in chain_ends(rgw, bucket).items():
        host = chain.split("/", 1)[0]
        per_host[host] = max(per_host.get(host, 0), end)
    return min(per_host.values()) if len(per_host) >= hosts_wanted else 0


def wait_reach(rgw: RgwBed, bucket: str, revision: int) -> None:
    try:
        poll(lambda: reach(rgw, bucket, 3) >= revision, timeout=120, interval=0.5,
             what=f"revision {revision} in the bucket, in every master's chain")
    except OperationFailed as exc:
        listed = bucket_keys(rgw, bucket)
        raise AssertionError(f"{exc.message}; chains: {chain_ends(rgw, bucket)}; objects: {listed[-40:]}") from None


def serving(cfg: Config) -> Dict[str, Tuple[int, int]]:
    """member name -> (cluster id, member id) as that member serves them."""
    with EtcdClient.from_config(cfg, timeout=3.0) as cl:
        return {m.name: (st.cluster_id, st.member_id) for m in cfg.members
                for st in [cl.status(m.client_url)]}


def user_dump(cfg: Config, member: int) -> Dict[str, Tuple[bytes, int]]:
    return {k: v for k, v in dump(EtcdRpc(cfg.members[member].client_url, timeout=5.0)).items()
            if not k.startswith("/etcd-agent/")}


def wipe(bed: Bed, offsite: str) -> Tuple[str, float]:
    """Every daemon and etcd killed at once, then on every master the data dir, the backup dir and
    the cached manifest key removed; the key copied to ``offsite`` first (where an operator keeps
    it). Returns (the key's copy, when the masters died)."""
    cfg = bed.cfg(bed.net.hosts[0].name)
    pids = [ProcessBackend(cfg, m.name).pid() for m in cfg.members]
    for p in bed.daemons.values():  # first: nothing copies, nothing restarts etcd after this
        p.kill()
    for pid in pids:
        if pid:
            os.kill(pid, signal.SIGKILL)
    died = time.time()
    for p in bed.daemons.values():
        p.wait(10)
    os.makedirs(offsite, mode=0o700, exist_ok=True)
    key = os.path.join(offsite, "manifest.key")
    shutil.copy2(key_path(cfg), key)
    os.chmod(key, 0o600)
    for h in bed.net.hosts:
        c = bed.cfg(h.name)
        shutil.rmtree(c.data_dir(h.name))
        shutil.rmtree(c.backup.dir)
        os.unlink(key_path(c))
    return key, died


@pytest.fixture
def identity(tmp_path) -> Tuple[str, str]:  # type: ignore[no-untyped-def]
    """(an age identity file 0600, its recipient), kept off the masters."""
    from etcd_agent import age

    secret, recipient = age.generate_identity()
    path = tmp_path / "backup-key.txt"
    path.write_text(secret + "\n")
    os.chmod(path, 0o600)
    return str(path), recipient


@pytest.fixture(params=["plain", "encrypted"])
def variant(request, identity) -> Iterator[Variant]:  # type: ignore[no-untyped-def]
    yield Variant("plain") if request.param == "plain" else Variant("encrypted", identity[1], identity[0])


def test_every_master_wiped_restored_from_the_bucket(variant: Variant, rgw_bridge: RgwBed,
                                                     tmp_path_factory: pytest.TempPathFactory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rgw = rgw_bridge
    bucket = rgw.new_bucket()
    with daemon_bed(tmp_path_factory, PREFIX, SUBNET, toml_for(rgw, bucket, variant), HostBed) as bed:
        first = bed.net.hosts[0]
        cfg = bed.cfg(first.name)
        for h in bed.net.hosts:  # every daemon watches its own member into its own chain
            poll(lambda h=h: chains.active_base(bed.cfg(h.name).backup.dir), timeout=90,
                 what=f"{h.name}'s delta watch", interval=0.5)
        before = serving(cfg)

        w = Writer([m.client_url for m in cfg.members])
        began = time.time()
        w.start()
        try:
            poll(lambda: len(w.acks) >= 300, timeout=60, what="the writer's first writes", interval=0.2)
            with w._mu:
                mark = max(a.revision for a in w.acks)
            live_mark = live_at(cfg.members[0].client_url, mark)  # the live Range(rev=N), before the wipe
            wait_reach(rgw, bucket, mark)
            with w._mu:
                later = max(a.revision for a in w.acks)
            wait_reach(rgw, bucket, later)
            key, died = wipe(bed, str(tmp_path / "offsite"))
        finally:
            w.stop()
        acks = sorted(w.acks, key=lambda a: a.revision)
        offsets = {h.name: len(bed.log(h.name)) for h in bed.net.hosts}
        for h in bed.net.hosts:
            bed.start_daemon(h)
        for h in bed.net.hosts:  # each restarted daemon saw its data gone and waits
            poll(lambda h=h: WAITING in bed.log(h.name)[offsets[h.name]:], timeout=60, interval=0.5,
                 what=f"{h.name}'s restarted daemon deciding to wait")

        ident = ["--identity", variant.identity] if variant.identity else []
        dry = bed.agent(first, "--json", "restore", "--from-bucket", "latest", "--to", "newest", "--dry-run")
        assert dry.returncode == 0, dry.stdout + dry.stderr
        planned = json.loads(dry.stdout)["bucket"]
        ends = [rng[1] for o in planned["objects"] for rng in [parse_name(o["file"])] if rng]
        assert ends, planned
        held = max(ends)  # the newest revision the chosen chain has in the bucket
        t0 = time.monotonic()
        res, busy, _ = retry_busy(lambda: bed.agent(first, "--json", "restore", "--from-bucket", "latest", "--to",
                                                    "newest", "--key-file", key, *ident, "--yes"))
        wall = time.monotonic() - t0
        assert res.returncode == 0, res.stdout + res.stderr
        out = json.loads(res.stdout)["bucket"]
        assert any("manifest signature valid" in ln for ln in out["checked"]), out["checked"]
        poll(lambda: healthy(cfg), timeout=60, what="the restored cluster healthy", interval=0.5)

        # every write the bucket held is back; judged as the disaster tests judge, at the bucket's end
        covered = [a for a in acks if a.revision <= held]
        held_at = max(a.at for a in covered)
        got = user_dump(cfg, 1)

        def steady(d: Dict[str, Tuple[bytes, int]]) -> Dict[str, Tuple[bytes, int]]:
            return {k: v for k, v in d.items() if v[1] not in w.short_expiry}  # 3 s leases run out meanwhile

        r = account(covered, got, w.short_expiry, held_at)
        last: Dict[str, Optional[bytes]] = {}
        for a in covered:
            if a.lease not in w.short_expiry:
                last[a.key] = a.value
        wrong = [k for k, v in last.items() if (got[k][0] if k in got else None) != v]
        rpo = died - min((a.at for a in acks if a.revision > held), default=died)
        print(f"\nFIGURE bucket disaster ({variant.name}): {len(acks)} acknowledged writes over "
              f"{died - began:.1f}s ({w.errors} writer errors), {len(covered)} of them up to revision {held}, the "
              f"newest in the bucket at the wipe; lost: {len(acks) - len(covered)}, the oldest acknowledged "
              f"{rpo:.1f}s before the wipe (RPO = close_seconds {CLOSE_SECONDS:g}s + upload lag)")
        print(f"FIGURE bucket disaster ({variant.name}): restore --from-bucket latest --to newest wall time "
              f"{wall:.1f}s ({busy} busy retries); {len(out['objects'])} objects, {out['bytes_read']} bytes fetched "
              f"in {out['seconds']:.1f}s")
        assert not wrong, wrong[:5]
        assert not r["missing_old"] and not r["resurrected"] and not r["expired_present"], r

        # one new cluster, the config's members, on every master; the hosts' records say the same
        after = serving(cfg)
        ids = {cid for cid, _m in after.values()}
        assert len(ids) == 1 and ids != {cid for cid, _m in before.values()}, (before, after)
        with EtcdClient.from_config(cfg, timeout=3.0) as cl:
            listed = {m.name: m.id for m in cl.members()}
        assert listed == {n: mid for n, (_c, mid) in after.items()}, (listed, after)
        cluster_id = f"{next(iter(ids)):x}"
        for h in bed.net.hosts:
            rec = bootstrap.read(bed.cfg(h.name), h.name)
            assert rec is not None and rec.cluster_id == cluster_id, rec
        assert all(steady(user_dump(cfg, i)) == steady(got) for i in (0, 2))
        # the restarted daemons carry on on the restored cluster, each on a new chain, and never
        # bootstrapped another
        for h in bed.net.hosts:
            poll(lambda h=h: chains.active_base(bed.cfg(h.name).backup.dir), timeout=120, interval=0.5,
                 what=f"{h.name}'s daemon on a new chain")
            assert "state=new" not in bed.log(h.name)[offsets[h.name]:], bed.log(h.name)[offsets[h.name]:]
        assert serving(cfg) == after and steady(user_dump(cfg, 0)) == steady(got)
        # what the restore fetched stays one chain: kept on ew1 (its chain not pruned as an orphan)
        # and in the bucket once, under its own chain's key (a pass of the copier made now)
        push = bed.agent(first, "backup", "push")
        assert push.returncode == 0, push.stdout + push.stderr
        here = os.listdir(bed.cfg(first.name).backup.dir)
        assert all(o["file"] in here for o in out["objects"]), (sorted(here), out["objects"])
        copies = [k for k in bucket_keys(rgw, bucket) if k.startswith(f"p/{first.name}/") and
                  k.endswith("/" + out["backup"])]
        assert len([k for k in copies if f"/chains/{out['chain']}/" in k]) == 1, (out["chain"], copies)
        # the restore may have taken another master's backup (the chain that reached furthest, from
        # its folder): ew1's own backup of that second, another file under its own key, stays beside it
        assert len(copies) == (1 if out.get("folder") in (None, first.name) else 2) or \
            (out.get("folder") not in (None, first.name) and len(copies) == 1), (out.get("folder"), copies)

        # --to-revision N: the live Range(rev=N) read before the wipe
        res, busy, _ = retry_busy(lambda: bed.agent(first, "restore", "--from-bucket", "latest", "--to-revision",
                                                    str(mark), "--key-file", key, *ident, "--yes"))
        assert res.returncode == 0, res.stdout + res.stderr
        poll(lambda: healthy(cfg), timeout=60, what="healthy after --to-revision", interval=0.5)
        cmp = compare(live_mark, dump(EtcdRpc(cfg.members[2].client_url, timeout=5.0)), dict(w.short_expiry))
        print(f"FIGURE bucket disaster ({variant.name}) --to-revision {mark}: {cmp['keys']} keys, {cmp['wrong']} "
              f"differ from the live Range(rev={mark}) read before the wipe ({busy} busy retries)")
        assert cmp["wrong"] == 0 and cmp["short_bad"] == 0, cmp
        for text in (dry.stdout, dry.stderr, res.stdout, res.stderr):
            assert rgw.secret_key not in text
        if variant.name == "plain":  # the collision: once is enough, it is the same path encrypted
            two_masters_at_once(bed, held, key, steady(got), set(w.short_expiry))


def two_masters_at_once(bed: Bed, held: int, key: str, want: Dict[str, Tuple[bytes, int]],
                        short: Set[int]) -> None:
    """Two operators type the same restore from the bucket on two masters at the same moment. Each
    fetches into its own backup dir, then both race for the hosts' locks, taken in config order on
    whichever master a run started: one restores, the other is refused naming it (exit 4, nothing
    touched), or, if the first ended before the second reached the locks, the second restores again
    after it. Never both at once, never a mixed cluster: whatever the order, every master serves one
    cluster holding what the bucket held at revision ``held``."""
    assert isinstance(bed, HostBed)
    cfg = bed.cfg(bed.net.hosts[0].name)
    masters = bed.net.hosts[:2]
    argv = ("restore", "--from-bucket", "latest", "--to-revision", str(held), "--key-file", key, "--yes")
    t0 = time.monotonic()
    procs = {h.name: subprocess.Popen(bed.as_host(h, *argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for h in masters}
    for p in procs.values():
        bed.net._procs.append(p)

    def end(p: "subprocess.Popen[str]") -> Tuple[Tuple[str, str], int, float]:
        io = p.communicate(timeout=600)
        return io, p.returncode, time.monotonic() - t0

    with ThreadPoolExecutor(len(procs)) as ex:  # each one's own time to its end
        ended = dict(zip(procs, ex.map(end, procs.values())))
    summary = {name: (code, round(took, 1)) for name, ((_o, _e), code, took) in ended.items()}
    assert all(code in (0, 4) for _io, code, _t in ended.values()), {n: (c, e) for n, ((_o, e), c, _t) in ended.items()}
    winners = [name for name, (_io, code, _t) in ended.items() if code == 0]
    assert winners, summary
    for name, ((_out, err), code, _t) in ended.items():
        if code == 4:  # refused at the locks, before anything on any host
            assert "busy:" in err and "nothing touched" in err, err
            other = next(h.name for h in masters if h.name != name)
            assert f"from {other} (pid {procs[other].pid})" in err or "etcd-agent run" in err, err
            if "etcd-agent run" not in err:  # the other restore named as its operator typed it
                assert f"`etcd-agent restore --from-bucket latest --to-revision {held}` from {other}" in err, err
            print(f"FIGURE two masters at once: {name} refused: "
                  + " | ".join(ln.strip() for ln in err.splitlines() if "busy:" in ln))
    poll(lambda: healthy(cfg), timeout=60, what="healthy after the two restores", interval=0.5)
    after = serving(cfg)
    assert len({cid for cid, _m in after.values()}) == 1, after
    for i in range(len(cfg.members)):  # keys of 3 s leases left out, as the restore above judged them
        got = {k: v for k, v in user_dump(cfg, i).items() if v[1] not in short}
        assert got == want, (cfg.members[i].name, sorted(set(got) ^ set(want))[:5])
    print(f"FIGURE two masters at once (exit, seconds): {summary}; restored by {winners}, one cluster "
          f"{next(iter(after.values()))[0]:x}, {len(want)} keys as the bucket held them at revision {held}")
