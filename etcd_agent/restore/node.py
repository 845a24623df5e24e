"""One host's restore steps, run locally on that host by ``etcd-agent node STEP``.

Every step is idempotent and journaled in ``<work dir>/journal.json`` (beside the data dir, 0700):
a step already in the journal is not done again, so re-running a crashed restore resumes it. Steps
that move data write their intention to the journal first ("pending"), so a crash between the move
and the journal entry is recognised on the next run. Nothing here deletes old data: the data dir
is renamed aside, and a failed restore's output is renamed aside too.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

from .. import __version__
from ..config import Config, Member
from ..errors import CommandError, OperationFailed, RefusedError
from ..etcd.tools import ETCDCTL_ENV, snapshot_restore_argv, version_of
from ..fs import ensure_private_dir, makedirs, write_atomic
from ..hosts.local import LocalHost
from ..member.local import LocalMember, backend_for
from ..state import markers
from ..state.locks import touch_alive
from ..topology import NEW, Bootstrap, parse_conf, render_conf
from . import plan as P

log = logging.getLogger(__name__)

JOURNAL = "journal.json"
SNAPSHOT = "etcd_snapshot.db"
TAR_CONF = "archive-etcd.conf"
TAR_UNIT = "archive-etcd.service"
CONF_ORIG = "conf.orig"


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _free_name(base: str, tag: str) -> str:
    target = f"{base}.{tag}-{_stamp()}"
    n = 1
    while os.path.lexists(target if n == 1 else f"{target}.{n}"):
        n += 1
    return target if n == 1 else f"{target}.{n}"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class NodeRestore:
    """The restore of one member on this host."""

    def __init__(self, cfg: Config, member: str, op: Optional[str] = None) -> None:
        self.cfg = cfg
        self.member: Member = cfg.member(member)
        self.op = op
        self.data_dir = cfg.data_dir(member).rstrip("/")
        self.work_dir = P.work_dir_for(self.data_dir, member)
        self.journal_path = os.path.join(self.work_dir, JOURNAL)
        self.host = LocalHost(member)
        self.backend = backend_for(cfg, member)

    # ------------------------------------------------------------ journal

    def journal(self) -> Optional[Dict[str, Any]]:
        try:
            with open(self.journal_path, encoding="utf-8") as fh:
                j = json.load(fh)
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise OperationFailed(f"{self.member.name}: journal {self.journal_path} unreadable: {exc}")
        return j if isinstance(j, dict) else None

    def _save(self, j: Dict[str, Any]) -> None:
        write_atomic(self.journal_path, (json.dumps(j, indent=2, sort_keys=True) + "\n").encode(), mode=0o600)

    def _mine(self) -> Dict[str, Any]:
        """The journal of this op; refused when another (or no) restore is journaled."""
        j = self.journal()
        if j is None or j.get("op") != self.op:
            raise RefusedError(
                f"{self.member.name}: no journal of restore {self.op} in {self.work_dir}"
                + (f" (it holds {j.get('op')})" if j else "")
            )
        touch_alive(self.cfg, str(self.op))
        return j

    def _step(self, name: str, fn: Any) -> Dict[str, Any]:
        """Run ``fn(journal)`` unless ``name`` is journaled already; journal its result."""
        j = self._mine()
        if j.get("state") in P.FINAL_STATES:
            raise RefusedError(f"{self.member.name}: restore {self.op} is {j['state']} already")
        done = j.setdefault("steps", {})
        if name in done:
            return {"step": name, "member": self.member.name, "skipped": "already done", **done[name]}
        result = fn(j) or {}
        result["at"] = time.time()
        done[name] = result
        j.setdefault("pending", {}).pop(name, None)
        self._save(j)
        log.info("%s: restore %s: %s done", self.member.name, self.op, name)
        return {"step": name, "member": self.member.name, **result}

    def _pending(self, j: Dict[str, Any], name: str, info: Dict[str, Any]) -> None:
        j.setdefault("pending", {})[name] = info
        self._save(j)

    # ------------------------------------------------------------ precheck (read-only)

    def precheck(self) -> Dict[str, Any]:
        cfg, m = self.cfg, self.member
        out: Dict[str, Any] = {
            "member": m.name, "protocol": P.NODE_PROTOCOL, "agent_version": __version__,
            "data_dir": self.data_dir, "work_dir": self.work_dir, "conf_file": cfg.conf_file(m.name),
            "backend": cfg.etcd.service_manager, "peer_url": m.peer_url, "client_url": m.client_url,
        }
        for key, binary in (("etcd_version", cfg.etcd.binary), ("etcdctl_version", cfg.etcd.etcdctl), ("etcdutl_version", cfg.etcd.etcdutl)):
            try:
                out[key] = version_of(self.host, binary) if binary else None
            except CommandError:
                out[key] = None
        parent = os.path.dirname(self.data_dir) or "/"
        probe = parent
        while not os.path.exists(probe) and probe != "/":
            probe = os.path.dirname(probe)
        out["free_bytes"] = shutil.disk_usage(probe).free
        if not os.path.lexists(self.data_dir):
            out["data_dir_state"] = "absent"
        elif not os.path.isdir(self.data_dir) or os.path.islink(self.data_dir):
            out["data_dir_state"] = "other"
        elif os.path.isdir(os.path.join(self.data_dir, "member")):
            out["data_dir_state"] = "member"
        else:
            out["data_dir_state"] = "empty"
        out["conf_present"] = os.path.isfile(cfg.conf_file(m.name))
        out["unit_present"] = os.path.isfile(cfg.etcd.unit_file) if cfg.etcd.service_manager == "systemd" else None
        try:
            out["running"] = self.backend.is_active()
        except Exception as exc:  # a broken backend is a fact to report, not a crash
            out["running"] = False
            out["backend_error"] = str(exc)
        out["fence_ok"], out["fence_detail"] = self._fence_possible()
        out["identity_match"] = _is_this_machine(m.host)
        t = cfg.tls
        out["tls_missing"] = [p for p in (t.client_ca, t.client_cert, t.client_key, t.peer_ca, t.peer_cert, t.peer_key) if p and not os.path.isfile(p)]
        out["journal"] = self.journal_summary()
        return out

    def journal_summary(self) -> Optional[Dict[str, Any]]:
        j = self.journal()
        if j is None:
            return None
        keys = ("op", "state", "sha256", "token", "backup", "initial_cluster", "new_cluster")
        return {**{k: j.get(k) for k in keys}, "steps": [s for s in P.STEPS if s in j.get("steps", {})]}

    def _fence_possible(self) -> Tuple[bool, str]:
        k = self.cfg.kubernetes
        if k.fence == "none":
            return True, "no fencing configured"
        if k.fence == "unit":
            res = self.host.run(["systemctl", "show", k.apiserver_unit, "-p", "LoadState"], timeout=30, check=False)
            if res.ok and "LoadState=loaded" in res.stdout:
                return True, f"{k.apiserver_unit} is loaded"
            return False, f"{k.apiserver_unit} is not a loaded unit ({(res.stdout or res.stderr).strip()[:120]})"
        aside = os.path.join(k.manifest_aside_dir, os.path.basename(k.manifest))
        if os.path.isfile(k.manifest) or os.path.isfile(aside):
            return True, f"{k.manifest} can be moved to {k.manifest_aside_dir}"
        return False, f"neither {k.manifest} nor {aside} exists"

    # ------------------------------------------------------------ steps

    def begin(self, *, token: str, initial_cluster: str, sha256: str, size: int, backup: str,
              bump: Optional[int], fence_owner: bool, new_cluster: bool) -> Dict[str, Any]:
        """Create the work dir and the journal (or find this op's journal: resume)."""
        ensure_private_dir(self.work_dir)  # the snapshot lands here: 0700, or refused if found open
        j = self.journal()
        if j is not None and j.get("op") != self.op:
            if j.get("state") not in P.FINAL_STATES:
                raise RefusedError(f"{self.member.name}: unfinished restore {j.get('op')} journaled in {self.work_dir}")
            self._clear_work_dir()
            j = None
        # before anything is touched: the daemon must not heal what this restore stops on purpose
        markers.write_restore(self.cfg, self.member.name, str(self.op), backup)
        if j is None:
            j = {
                "op": self.op, "member": self.member.name, "state": "running", "created": time.time(),
                "token": token, "initial_cluster": initial_cluster, "sha256": sha256, "size": size,
                "backup": backup, "bump": bump, "fence_owner": fence_owner, "new_cluster": new_cluster,
                "was_running": self.backend.is_active(), "steps": {}, "pending": {},
            }
            self._save(j)
        return self._step("begin", lambda j: {"was_running": j["was_running"]})

    def fence(self) -> Dict[str, Any]:
        def do(j: Dict[str, Any]) -> Dict[str, Any]:
            k = self.cfg.kubernetes
            if k.fence == "none" or not j.get("fence_owner"):
                return {"method": "none"}
            if k.fence == "unit":
                active = self.host.run(["systemctl", "is-active", k.apiserver_unit], timeout=30, check=False).stdout.strip()
                was = active in ("active", "activating", "reloading")
                if was:
                    self.host.run(["systemctl", "stop", k.apiserver_unit], timeout=120)
                return {"method": "unit", "was_active": was}
            aside = os.path.join(k.manifest_aside_dir, os.path.basename(k.manifest))
            if os.path.isfile(k.manifest):
                makedirs(k.manifest_aside_dir, 0o700)
                os.replace(k.manifest, aside)
                return {"method": "manifest", "moved": aside}
            return {"method": "manifest", "moved": aside if os.path.isfile(aside) else None}
        return self._step("fence", do)

    def stop(self) -> Dict[str, Any]:
        def do(j: Dict[str, Any]) -> Dict[str, Any]:
            self._stop_etcd()
            if self.backend.is_active():
                raise OperationFailed(f"{self.member.name}: etcd still running after stop ({self.backend.describe()})")
            return {}
        return self._step("stop", do)

    def aside(self) -> Dict[str, Any]:
        def do(j: Dict[str, Any]) -> Dict[str, Any]:
            pend = j.get("pending", {}).get("aside")
            if pend and not os.path.lexists(self.data_dir) and os.path.lexists(pend["target"]):
                return {"moved": pend["target"]}  # moved before a crash, not journaled yet
            if not os.path.lexists(self.data_dir):
                return {"moved": None}
            target = _free_name(self.data_dir, "pre-restore")
            self._pending(j, "aside", {"target": target})
            os.rename(self.data_dir, target)
            log.warning("%s: data dir %s set aside as %s", self.member.name, self.data_dir, target)
            return {"moved": target}
        return self._step("aside", do)

    def receive(self) -> Dict[str, Any]:
        """The shipped snapshot is complete: sha256 as journaled (from the archive's manifest)."""
        def do(j: Dict[str, Any]) -> Dict[str, Any]:
            path = os.path.join(self.work_dir, SNAPSHOT)
            if not os.path.isfile(path):
                raise OperationFailed(f"{self.member.name}: snapshot {path} not shipped")
            got = sha256_file(path)
            if got != j["sha256"]:
                os.unlink(path)  # a damaged copy: the next run ships it again
                raise OperationFailed(f"{self.member.name}: shipped snapshot sha256 {got[:16]}... != {j['sha256'][:16]}...; removed")
            return {"sha256": got, "size": os.path.getsize(path)}
        return self._step("receive", do)

    def restore(self) -> Dict[str, Any]:
        def do(j: Dict[str, Any]) -> Dict[str, Any]:
            tmp = f"{self.data_dir}.restoring"
            pend = j.get("pending", {}).get("restore")
            if pend and os.path.isdir(self.data_dir) and not os.path.lexists(tmp):
                return {"argv": pend["argv"]}  # renamed before a crash
            if os.path.lexists(self.data_dir):
                raise OperationFailed(f"{self.member.name}: {self.data_dir} reappeared after it was set aside; not touching it")
            snap = os.path.join(self.work_dir, SNAPSHOT)
            if sha256_file(snap) != j["sha256"]:
                raise OperationFailed(f"{self.member.name}: snapshot {snap} changed since it arrived (sha256 mismatch)")
            if os.path.lexists(tmp):
                shutil.rmtree(tmp)  # our own partial output of an interrupted attempt
            argv = snapshot_restore_argv(
                self.cfg, snapshot=snap, name=self.member.name, initial_cluster=j["initial_cluster"],
                token=j["token"], peer_url=self.member.peer_url, data_dir=tmp, bump_revision=j.get("bump"),
            )
            res = self.host.run(argv, timeout=1800, check=False, env=ETCDCTL_ENV)
            if not res.ok:
                if os.path.lexists(tmp):
                    shutil.rmtree(tmp)
                tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-2:]
                raise OperationFailed(f"{self.member.name}: snapshot restore failed (exit {res.returncode}): {' / '.join(tail)}")
            self._pending(j, "restore", {"argv": argv})
            os.rename(tmp, self.data_dir)
            os.chmod(self.data_dir, 0o700)
            return {"argv": argv}
        return self._step("restore", do)

    def chown(self) -> Dict[str, Any]:
        def do(j: Dict[str, Any]) -> Dict[str, Any]:
            if self.cfg.etcd.service_manager != "systemd":
                return {"skipped": "process backend: etcd runs as the agent's user"}
            owner = f"{self.cfg.etcd.user}:{self.cfg.etcd.group}"
            self.host.run(["chown", "-R", owner, self.data_dir], timeout=600)
            return {"owner": owner}
        return self._step("chown", do)

    def repair(self) -> Dict[str, Any]:
        """etcd.conf (and etcd.service) present and naming this member in the restored cluster."""
        def do(j: Dict[str, Any]) -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            conf = self.cfg.conf_file(self.member.name)
            values = P.restore_conf_values(self.cfg, self.member, j["initial_cluster"], j["token"])
            try:
                with open(conf, encoding="utf-8") as fh:
                    old: Optional[str] = fh.read()
            except FileNotFoundError:
                old = None
            if old is None:
                base = _read(os.path.join(self.work_dir, TAR_CONF))
                source = "the archive" if base is not None else "the config"
                if base is None:
                    base = render_conf(self.cfg, self.member, Bootstrap(self.member.name, NEW, j["initial_cluster"], j["token"]))
                makedirs(os.path.dirname(conf) or "/", 0o755)  # not 0777 under umask 000
                write_atomic(conf, P.rewrite_conf(base, values).encode(), mode=0o644)
                out["conf"] = f"missing: repaired from {source}"
                out["conf_created"] = True
            else:
                cur = parse_conf(old)
                if all(cur.get(k) == v for k, v in values.items()):
                    out["conf"] = "kept"
                else:
                    write_atomic(os.path.join(self.work_dir, CONF_ORIG), old.encode(), mode=0o600)
                    write_atomic(conf, P.rewrite_conf(old, values).encode(), mode=0o644)
                    out["conf"] = "identity/cluster keys rewritten (original kept for rollback)"
                    out["conf_saved"] = True
            if self.cfg.etcd.service_manager == "systemd":
                unit = self.cfg.etcd.unit_file
                if os.path.isfile(unit):
                    out["unit"] = "kept"
                else:
                    text = _read(os.path.join(self.work_dir, TAR_UNIT)) or LocalMember(self.cfg, self.member).unit_text()
                    write_atomic(unit, text.encode(), mode=0o644)
                    self.host.run(["systemctl", "daemon-reload"], timeout=60)
                    out["unit"] = "missing: repaired"
            return out
        return self._step("repair", do)

    def _stop_etcd(self, timeout: float = 30.0) -> None:
        self.backend.stop(timeout)

    def start(self) -> Dict[str, Any]:
        def do(j: Dict[str, Any]) -> Dict[str, Any]:
            self.backend.start()
            return {}
        return self._step("start", do)

    def unfence(self) -> Dict[str, Any]:
        return self._step("unfence", lambda j: self._unfence(j))

    def _unfence(self, j: Dict[str, Any]) -> Dict[str, Any]:
        f = j.get("steps", {}).get("fence") or {}
        k = self.cfg.kubernetes
        if f.get("method") == "unit" and f.get("was_active"):
            self.host.run(["systemctl", "start", k.apiserver_unit], timeout=120)
            return {"started": k.apiserver_unit}
        if f.get("method") == "manifest" and f.get("moved"):
            if os.path.isfile(f["moved"]) and not os.path.exists(k.manifest):
                os.replace(f["moved"], k.manifest)
            return {"restored": k.manifest}
        return {}

    def finish(self) -> Dict[str, Any]:
        res = self._step("finish", lambda j: {})
        j = self._mine()
        j["state"] = "done"
        self._save(j)
        self._drop_payload()
        markers.clear_restore(self.cfg, self.member.name, self.op)
        return res

    # ------------------------------------------------------------ rollback

    def rollback(self) -> Dict[str, Any]:
        """Undo whatever this op did here: old data dir back, conf back, etcd and apiserver as before."""
        j = self._mine()
        if j.get("state") == "rolled-back":
            markers.clear_restore(self.cfg, self.member.name, self.op)
            return {"step": "rollback", "member": self.member.name, "skipped": "already rolled back"}
        if j.get("state") == "done":
            raise RefusedError(f"{self.member.name}: restore {self.op} finished; nothing to roll back")
        steps = j.get("steps", {})
        did: List[str] = []
        self._stop_etcd()
        did.append("etcd stopped")
        moved = (steps.get("aside") or {}).get("moved") or (j.get("pending", {}).get("aside") or {}).get("target")
        restored_here = "restore" in steps or "restore" in j.get("pending", {})
        tmp = f"{self.data_dir}.restoring"
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)  # our own partial output
        if moved and os.path.lexists(moved):
            if os.path.lexists(self.data_dir):
                failed = _free_name(self.data_dir, "failed-restore")
                os.rename(self.data_dir, failed)
                did.append(f"restored data moved to {failed}")
            os.rename(moved, self.data_dir)
            did.append(f"{moved} moved back to {self.data_dir}")
        elif restored_here and os.path.lexists(self.data_dir):
            failed = _free_name(self.data_dir, "failed-restore")
            os.rename(self.data_dir, failed)
            did.append(f"no old data dir; restored data moved to {failed}")
        rep = steps.get("repair") or {}
        conf = self.cfg.conf_file(self.member.name)
        if rep.get("conf_saved") and os.path.isfile(os.path.join(self.work_dir, CONF_ORIG)):
            with open(os.path.join(self.work_dir, CONF_ORIG), "rb") as fh:
                write_atomic(conf, fh.read(), mode=0o644)
            did.append(f"{conf} restored")
        if j.get("was_running") and os.path.isdir(os.path.join(self.data_dir, "member")):
            self.backend.start()
            did.append("etcd started again")
        if "fence" in steps and "unfence" not in steps:
            self._unfence(j)
            did.append("apiserver unfenced")
        j["state"] = "rolled-back"
        j["rollback"] = did
        self._save(j)
        self._drop_payload()
        markers.clear_restore(self.cfg, self.member.name, self.op)
        return {"step": "rollback", "member": self.member.name, "did": did}

    # ------------------------------------------------------------ housekeeping

    def _drop_payload(self) -> None:
        """The snapshot copy is large and has served; the journal stays until the next restore."""
        for n in (SNAPSHOT, TAR_CONF, TAR_UNIT):
            try:
                os.unlink(os.path.join(self.work_dir, n))
            except FileNotFoundError:
                pass

    def _clear_work_dir(self) -> None:
        for n in os.listdir(self.work_dir):
            p = os.path.join(self.work_dir, n)
            if os.path.isfile(p) and not os.path.islink(p):
                os.unlink(p)

    def cleanup(self, keep: int, dry_run: bool) -> Dict[str, Any]:
        parent = os.path.dirname(self.data_dir) or "/"
        try:
            entries = os.listdir(parent)
        except FileNotFoundError:
            entries = []
        decisions = P.cleanup_plan(self.data_dir, entries, keep)
        removed = []
        for d in decisions:
            if not d.keep and not dry_run:
                shutil.rmtree(d.path)
                removed.append(d.path)
                log.info("removed %s: %s", d.path, d.reason)
        return {
            "member": self.member.name,
            "dry_run": dry_run,
            "decisions": [{"path": d.path, "keep": d.keep, "reason": d.reason} for d in decisions],
            "removed": removed,
        }


def _is_this_machine(host: str) -> bool:
    """``host`` is one of this machine's addresses or names. Addresses first: resolving our own
    name (getfqdn) can stall for the resolver's timeouts when DNS is down - during an outage,
    when the DNS server may well run on the cluster being restored."""
    import psutil

    for entries in psutil.net_if_addrs().values():
        if any(a.address.split("%")[0] == host for a in entries):
            return True
    from ..locality import machine_identity

    me = machine_identity()
    return host in me.addresses or host in me.names


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None
