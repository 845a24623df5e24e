"""A real etcd watcher that lives across a restore, as a kube-apiserver reflector's does.

``etcdctl watch --rev=N -w json`` is the Go clientv3 the apiserver uses: when its connection
breaks it reconnects by itself and resumes the watch from the revision after the last one it
received. Run across a restore, it shows what an apiserver's watch cache gets: a "compacted"
cancel (etcdutl's --bump-revision --mark-compacted), or a silent resume on a history that was
rolled back (etcd 3.4, no bump). The process is stopped by PID in ``stop()``.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, List, Sequence, Tuple


@dataclass
class Seen:
    """Everything the watcher printed, in order."""

    events: List[Tuple[str, int]] = field(default_factory=list)  # (key, mod_revision)
    canceled: bool = False
    compact_revision: int = 0
    stderr: str = ""


class Watcher:
    def __init__(self, etcdctl: str, endpoints: Sequence[str], prefix: str, start_revision: int) -> None:
        self.argv = [etcdctl, f"--endpoints={','.join(endpoints)}", "watch", "--prefix", prefix,
                     f"--rev={start_revision}", "-w", "json"]
        self.seen = Seen()
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "ETCDCTL_API": "3"})
        self._out = threading.Thread(target=self._read_out, daemon=True)
        self._err = threading.Thread(target=self._read_err, daemon=True)
        self._out.start()
        self._err.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                resp = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                for ev in resp.get("Events") or []:
                    kv = ev.get("kv") or {}
                    key = base64.b64decode(kv.get("key", "")).decode(errors="replace")
                    self.seen.events.append((key, int(kv.get("mod_revision", 0))))
                if resp.get("Canceled"):
                    self.seen.canceled = True
                if resp.get("CompactRevision"):
                    self.seen.compact_revision = int(resp["CompactRevision"])

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                self.seen.stderr += line
                if "compacted" in line:
                    self.seen.canceled = True

    def revisions(self) -> List[int]:
        with self._lock:
            return [r for _k, r in self.seen.events]

    def wait(self, what: str, pred: "Callable[[Watcher], bool]", timeout: float) -> None:
        """Until ``pred(self)`` holds; AssertionError (with what the watcher saw) after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not pred(self):
            if time.monotonic() > deadline:
                with self._lock:
                    tail = self.seen.events[-3:]
                    err = self.seen.stderr[-500:]
                raise AssertionError(f"watcher: {what} not seen within {timeout:.0f}s "
                                     f"(last events {tail}, exited {self.proc.poll()}, stderr {err!r})")
            time.sleep(0.05)

    def stop(self) -> Seen:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.join(10)
        self._err.join(10)
        return self.seen


def server_watchers(client_urls: Sequence[str], timeout: float = 2.0) -> int:
    """Watchers the members serve right now (``etcd_debugging_mvcc_watcher_total`` summed over
    the members that answer): how the test knows a watcher has reconnected."""
    total = 0
    for url in client_urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
                text = r.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("etcd_debugging_mvcc_watcher_total "):
                total += int(float(line.split()[1]))
    return total
