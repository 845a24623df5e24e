"""With a fence configured, a point-in-time restore with ``point_in_time_load = "auto"`` loads
the tail into the members: the tail is written into the restored members while the apiserver's manifest is still
moved aside, and nothing of the start snapshot's state is left readable in the history once it
is back. Real etcd 3.5.16, three members, one daemon per member writing the chain."""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, List, Tuple

import pytest

from etcd_agent.errors import EtcdError
from etcd_agent.etcd.rpc import EtcdRpc
from etcd_agent.restore.orchestrator.plan import BUMP_REVISION
from tests.integration.continuous import agent, delete, dump, put, rpc, start_all, wait_durable, wait_watching
from tests.integration.test_pitr_checkpoints import live_at, same_state, user_keys

pytestmark = pytest.mark.integration


class ManifestWatch:
    """Polls the apiserver manifest every 2 ms: when it went aside and when it came back."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.events: List[Tuple[str, float]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        there = os.path.exists(self.path)
        while not self._stop.wait(0.002):
            now = os.path.exists(self.path)
            if now != there:
                self.events.append(("back" if now else "aside", time.monotonic()))
                there = now

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)


def test_with_a_fence_the_tail_is_loaded_into_the_members_before_the_apiserver_returns(bed, tmp_path) -> None:  # type: ignore[no-untyped-def]
    manifest = os.path.join(str(tmp_path), "kube-apiserver.yaml")
    with open(manifest, "w") as fh:
        fh.write("kind: Pod\n")
    d = bed(delta={"point_in_time_load": '"auto"'}, tables=f'[kubernetes]\nfence = "manifest"\nmanifest = "{manifest}"\n'
                   f'manifest_aside_dir = "{tmp_path}/manifests-aside"\n')
    c = d.c
    start_all(d)
    wait_watching(c)
    r = rpc(c)
    lease, _ = r.lease_grant(600)
    for i in range(300):
        put(r, f"/t/{i:03d}", b"one")
    put(r, "/t/leased", b"L", lease)
    delete(r, "/t/007")
    target = put(r, "/t/last", b"at the target")
    for i in range(50):  # after the target: never restored
        put(r, f"/t/{i:03d}", b"after")
    later = put(r, "/t/later", b"x")
    wait_durable(c, later)
    want = user_keys(live_at(r, target))
    r.close()

    watch = ManifestWatch(manifest)
    try:
        res = agent(c, "--json", "restore", "--from", "latest", "--to-revision", str(target), "--yes")
    finally:
        watch.stop()
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    timings: Dict[str, float] = out["timings"]
    # auto under a fence: no throwaway member, the load inside the fenced window
    assert "load" in timings and not any(k.startswith("read: replay") for k in timings), sorted(timings)
    assert "written into the restored members" in res.stderr, res.stderr
    assert out["plan"]["tail_to"] == target, out["plan"]
    assert any(s["step"] == "load" for s in out["plan"]["hosts"][0]["steps"]), out["plan"]["hosts"][0]["steps"]
    assert [e for e, _ in watch.events] == ["aside", "back"], watch.events
    assert any("reached revision" in ln for ln in out["point_in_time"]), out["point_in_time"]
    with EtcdRpc(c.cfg.members[1].client_url, timeout=5.0) as r2:
        got = user_keys(dump(r2))
        diff = same_state(want, got)
        assert not diff, diff[:10]
        assert got["/t/leased"][1] != 0, "the leased key came back without its lease"
        # the start snapshot's state is history that nobody reads: compacted up to the final revision
        start = out["plan"]["revision"] + BUMP_REVISION  # the restored members' first revision
        assert r2.header(serializable=False).revision > start
        with pytest.raises(EtcdError, match="compacted"):
            r2.range(b"/t/", b"/t0", revision=start)
    assert open(manifest).read() == "kind: Pod\n"
    print(f"\nFIGURE fenced pitr: load {timings['load']:.3f}s inside the fence ({len(want)} keys at revision {target}); "
          f"restore {out['duration']:.2f}s, downtime {out['downtime']:.2f}s")
