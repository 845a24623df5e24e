"""One host's restore steps, run on that host inside its ``etcd-agent node serve`` session.

Every step is idempotent and journaled (``restore.journal``): a step already recorded is not
done again, so re-running a crashed restore resumes it. Steps that move data record their
intention first ("pending"). Nothing here deletes old data: the data dir is renamed aside, and a
failed restore's output is renamed aside too. Every step that changes anything runs only in a
session that holds this host's operation lock (``NodeContext.require_lock``), so a second
orchestrator can never drive this host while the first one's session lives.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pwd
import shutil
import time
from typing import Callable, List, Optional, Tuple

from etcd_agent.config import Config, Member
from etcd_agent.errors import AgentError, OperationFailed, RefusedError
from etcd_agent.etcd.tools import ETCDCTL_ENV, snapshot_restore_argv
from etcd_agent.fs import ensure_private_dir, makedirs, write_atomic
from etcd_agent.hosts.base import Result
from etcd_agent.hosts.local import LocalHost
from etcd_agent.member import serving
from etcd_agent.member.dblock import db_locked
from etcd_agent.member.local import LocalMember, backend_for
from etcd_agent.member.process import etcd_owner
from etcd_agent.node import replies as R
from etcd_agent.restore.host import journal as J
from etcd_agent.restore.host import survey, undo
from etcd_agent.restore.host.conf import restore_conf_values, rewrite_conf
from etcd_agent.restore.host.facts import NodeFacts, work_dir_for
from etcd_agent.restore.host.priority import yielding
from etcd_agent.restore.host.receive import RECEIVED, SNAPSHOT, Landed, land_file, still_sound
from etcd_agent.restore.host.setaside import cleanup_set_aside, free_name
from etcd_agent.safejson import UnsafeJson, loads
from etcd_agent.state import bootstrap, lineage, markers
from etcd_agent.state.pins import pinned_config
from etcd_agent.topology import EXISTING, Bootstrap, parse_conf, render_conf
from etcd_agent.waiting import poll

log = logging.getLogger(__name__)

MAX_RECORD = 64 << 10  # received.json: a few hundred bytes
HALT_TIMEOUT = 30.0  # seconds `halt` waits for etcd to close its db
HALT_POLL = 0.01


class NodeRestore:
    """The restore of one member on this host."""

    def __init__(self, cfg: Config, member: str, op: Optional[str] = None) -> None:
        # The member's release after a rolling upgrade (its version pin), not agent.toml's
        # binaries: the pre-check reports what really runs here, `snapshot restore` uses that
        # release's etcdutl, and the process backend starts the pinned etcd - not the old one.
        self.cfg = pinned_config(cfg, member)
        self.member: Member = cfg.member(member)
        self.op = op
        self.data_dir = cfg.data_dir(member).rstrip("/")
        self.work_dir = work_dir_for(self.data_dir, member)
        self.journal_path = J.path_in(self.work_dir)
        self.host = LocalHost(member)
        self.backend = backend_for(self.cfg, member)
        self.spots = serving.spots_for(self.cfg, member, self.data_dir)

    def servers(self) -> List[serving.Server]:
        """What serves this member on this host, whatever started it (``member.serving``)."""
        return serving.find(self.spots, self.backend.kind, self._main_pid())

    def _main_pid(self) -> Optional[int]:
        return self.backend.pid() if self.backend.kind == "systemd" else None

    # ------------------------------------------------------------ journal

    def journal(self) -> Optional[J.Journal]:
        return J.load(self.journal_path)

    def mine(self) -> J.Journal:
        """The journal of this op; refused when another (or no) restore is journaled."""
        j = self.journal()
        if j is None or j.op != self.op:
            raise RefusedError(
                f"{self.member.name}: no journal of restore {self.op} in {self.work_dir}"
                + (f" (it holds {j.op})" if j else "")
            )
        return j

    def _step(self, name: str, fn: Callable[[J.Journal], R.StepReply],
              again: Callable[[], Optional[str]] = lambda: None) -> R.StepReply:
        """Run ``fn(journal)`` unless ``name`` is journaled already; journal its reply. A journaled
        step runs again when ``again()`` gives a reason (what the journal cannot tell: whether a
        process it started still runs); the reply then says that reason."""
        j = self.mine()
        if not j.open:
            raise RefusedError(f"{self.member.name}: restore {self.op} is {j.state} already")
        prev = j.steps.get(name)
        if prev is not None:
            why = again()
            if why is not None:
                fn(j)
                log.info("%s: restore %s: %s again: %s", self.member.name, self.op, name, why)
            return dataclasses.replace(prev, step=name, member=self.member.name,
                                       skipped=why or prev.skipped or "already done")
        result = dataclasses.replace(fn(j), step=name, member=self.member.name, at=time.time())
        j.steps[name] = result
        j.pending.pop(name, None)
        J.save(self.journal_path, j)
        log.info("%s: restore %s: %s done", self.member.name, self.op, name)
        return result

    def _pending(self, j: J.Journal, name: str, info: J.Pending) -> None:
        j.pending[name] = info
        J.save(self.journal_path, j)

    # ------------------------------------------------------------ precheck (read-only)

    def precheck(self) -> NodeFacts:
        return survey.facts(self)

    # ------------------------------------------------------------ steps

    def begin(self, *, token: str, initial_cluster: str, sha256: Optional[str], size: int, backup: str,
              bump: Optional[int], fence_owner: bool, new_cluster: bool) -> R.StepReply:
        """Create the work dir and the journal (or find this op's journal: resume)."""
        ensure_private_dir(self.work_dir)  # the snapshot lands here: 0700, or refused if found open
        j = self.journal()
        if j is not None and j.op != self.op:
            if j.open:
                raise RefusedError(f"{self.member.name}: unfinished restore {j.op} journaled in {self.work_dir}")
            self._clear_work_dir()
            j = None
        # before anything is touched: the daemon must not heal what this restore stops on purpose
        markers.write_restore(self.cfg, self.member.name, str(self.op), backup)
        if j is None:
            j = J.Journal(op=str(self.op), member=self.member.name, backup=backup, token=token,
                          initial_cluster=initial_cluster, sha256=sha256, size=size, bump=bump,
                          fence_owner=fence_owner, new_cluster=new_cluster,
                          was_running=self.backend.is_active() or any(s.ours for s in self.servers()))
            J.save(self.journal_path, j)
        return self._step("begin", lambda j: R.BeginReply(was_running=j.was_running))

    def fence(self) -> R.StepReply:
        def do(j: J.Journal) -> R.StepReply:
            k = self.cfg.kubernetes
            if k.fence == "none" or not j.fence_owner:
                return R.FenceReply(method="none")
            if k.fence == "unit":
                active = self.host.run(["systemctl", "is-active", k.apiserver_unit], timeout=30, check=False).stdout.strip()
                was = active in ("active", "activating", "reloading")
                if was:
                    self.host.run(["systemctl", "stop", k.apiserver_unit], timeout=120)
                return R.FenceReply(method="unit", was_active=was)
            aside = os.path.join(k.manifest_aside_dir, os.path.basename(k.manifest))
            if os.path.isfile(k.manifest):
                makedirs(k.manifest_aside_dir, 0o700)
                os.replace(k.manifest, aside)
                return R.FenceReply(method="manifest", moved=aside)
            return R.FenceReply(method="manifest", moved=aside if os.path.isfile(aside) else None)
        return self._step("fence", do)

    def halt(self) -> R.StepReply:
        """A follower's first half of ``stop``: etcd is asked to stop (SIGTERM, or a systemd stop
        job) and waited for only until it has closed its db (``member.dblock``), not until it
        exits. etcd 3.5 then spends up to a second closing its peer server; the leader, stopped
        next, finds these members gone, stops at once without trying to hand over leadership,
        and its exit ends their wait too. ``stop`` follows and waits for the exit: nothing of
        the data is moved while any process lives. Where the lock cannot be seen here (it was
        not seen held before the signal), this waits for the exit, as ``stop`` does."""
        def do(j: J.Journal) -> R.StepReply:
            if j.done("stop"):
                # a resumed restore: this member stopped in the run that was cut off (it was
                # the leader then, so it had no halt); the etcd running now, if any, is the
                # restored one its own `start` began - never signal it
                return R.HaltReply(how="stopped earlier in this restore")
            if not self.backend.is_active():
                # no pid file (lost, or a killed run's etcd that never got one), yet an etcd of
                # ours may serve: stopped like any other, its data not moved from under it
                strays = [s for s in self.servers() if s.ours]
                if not strays:
                    return R.HaltReply(how="not running")
                self._pending(j, "halt", J.Pending())  # from here on, rollback starts it again
                t = time.monotonic()
                for s in strays:
                    serving.stop(s, self.spots, self.backend.kind)
                return R.HaltReply(how=f"exited: {', '.join(f'pid {s.pid}' for s in strays)}, running without "
                                       "a pid file", waited=time.monotonic() - t)
            seen = db_locked(self.data_dir)
            self._pending(j, "halt", J.Pending())  # from here on, rollback starts it again
            t = time.monotonic()
            self.backend.signal_stop()
            if seen is not True:
                self.backend.stop(30.0)
                return R.HaltReply(how=f"exited (its db lock {'not held' if seen is False else 'unreadable'} "
                                       "before the signal)", waited=time.monotonic() - t)
            try:
                poll(lambda: db_locked(self.data_dir) is not True, timeout=HALT_TIMEOUT, interval=HALT_POLL,
                     what="the member's db closed")
            except OperationFailed:  # `stop` waits for the exit (and kills a process that ignores its signal)
                return R.HaltReply(how=f"db still open after {HALT_TIMEOUT:.0f}s", waited=time.monotonic() - t)
            return R.HaltReply(how="db closed", waited=time.monotonic() - t)
        return self._step("halt", do)

    def stop(self) -> R.StepReply:
        def do(j: J.Journal) -> R.StepReply:
            self.backend.stop(30.0)
            if self.backend.is_active():
                raise OperationFailed(f"{self.member.name}: etcd still running after stop ({self.backend.describe()})")
            # whatever else serves this member: ours stopped, anything else named and refused
            strays = serving.clear(self.spots, self.backend.kind)
            return R.StopReply(strays=tuple(s.sentence() for s in strays))
        return self._step("stop", do)

    def aside(self) -> R.StepReply:
        def do(j: J.Journal) -> R.StepReply:
            pend = j.pending.get("aside")
            if pend and pend.target and not os.path.lexists(self.data_dir) and os.path.lexists(pend.target):
                return R.AsideReply(moved=pend.target)  # moved before a crash, not journaled yet
            live = self.servers()
            if self.backend.is_active() or live:
                # something started etcd again since `stop` (a supervisor that is not hands-off):
                # never move a live member's data from under it
                why = "; ".join(s.sentence() for s in live) or self.backend.describe()
                raise OperationFailed(f"{self.member.name}: etcd runs again ({why}); its data dir is not moved")
            if not os.path.lexists(self.data_dir):
                return R.AsideReply(moved=None)
            target = free_name(self.data_dir, "pre-restore")
            self._pending(j, "aside", J.Pending(target=target))
            os.rename(self.data_dir, target)
            log.warning("%s: data dir %s set aside as %s", self.member.name, self.data_dir, target)
            return R.AsideReply(moved=target)
        return self._step("aside", do)

    def receive(self, sender_sha256: Optional[str], copy_from: Optional[Tuple[str, int]] = None) -> R.StepReply:
        """The shipped snapshot is complete and is what was sent: the receiver hashed it as it
        wrote it (``received.json``); that hash must be the sender's and, when the journal holds
        the manifest's claim, that one too. Nothing is read twice. ``copy_from`` (path, offset):
        the snapshot is on this host already (the restoring master's own members): copied here
        with the receiver's checks first (``receive.land_file``); the orchestrator compares its
        hash with what it ships to the others."""
        def do(j: J.Journal) -> R.StepReply:
            if copy_from is not None:
                path, offset = copy_from
                yielding(lambda: land_file(self.cfg, self.member.name, j.op, path, offset, j.size))
            rec = self._received()
            if sender_sha256 is not None and rec.sha256 != sender_sha256:
                self._drop_payload()
                raise OperationFailed(f"{self.member.name}: received snapshot sha256 {rec.sha256[:16]}... is not "
                                      f"what was sent ({sender_sha256[:16]}...); removed")
            if j.sha256 is not None and j.sha256 != rec.sha256:
                self._drop_payload()
                raise OperationFailed(f"{self.member.name}: the snapshot's sha256 {rec.sha256[:16]}... is not the "
                                      f"manifest's {j.sha256[:16]}...; removed")
            j.sha256 = rec.sha256
            return R.ReceiveReply(sha256=rec.sha256, size=rec.size, how=rec.codec)
        return self._step("receive", do)

    def _received(self) -> Landed:
        path = os.path.join(self.work_dir, SNAPSHOT)
        try:
            with open(os.path.join(self.work_dir, RECEIVED), "rb") as fh:
                rec = Landed.from_json(loads(fh.read(MAX_RECORD + 1), max_bytes=MAX_RECORD), f"{self.member.name}: {RECEIVED}")
            st = os.stat(path)
        except (OSError, UnsafeJson):
            raise OperationFailed(f"{self.member.name}: no complete snapshot was shipped to {path}") from None
        if (rec.size, rec.ino, rec.mtime_ns) != (st.st_size, st.st_ino, st.st_mtime_ns):
            raise OperationFailed(f"{self.member.name}: {path} changed since it was received")
        try:
            return still_sound(self.work_dir, rec, f"{self.member.name}: {path}")
        except (OSError, AgentError) as exc:
            self._drop_payload()
            why = exc.message if isinstance(exc, AgentError) else (exc.strerror or str(exc))
            raise OperationFailed(f"{self.member.name}: the snapshot received before this host restarted is not "
                                  f"what landed ({why}); removed. Roll this restore back (`etcd-agent restore "
                                  "rollback --yes`) and restore again") from None

    def restore(self) -> R.StepReply:
        """``snapshot restore`` into ``<data dir>.restoring`` while etcd still serves from the data
        dir (nothing of the live member is touched): the long part of a restore is no downtime.
        ``install`` moves it into place once etcd is stopped and its data set aside."""
        def do(j: J.Journal) -> R.StepReply:
            tmp = f"{self.data_dir}.restoring"
            pend = j.pending.get("restore")
            if pend and pend.argv is not None and os.path.isdir(tmp):
                return R.RestoreReply(argv=pend.argv, output=tmp)  # finished before a crash
            if pend and pend.argv is not None:
                raise OperationFailed(f"{self.member.name}: {tmp}, restored before the agent was cut off, is gone, and "
                                      "the snapshot it came from was removed once restored; roll this restore back "
                                      "(`etcd-agent restore rollback --yes`) and restore again")
            landed = self._received()  # still the bytes that were checked on arrival (size, inode, mtime)
            snap = os.path.join(self.work_dir, SNAPSHOT)
            if os.path.lexists(tmp):
                if not (pend and pend.output == tmp):
                    raise OperationFailed(f"{self.member.name}: {tmp} exists and was not made by this restore; "
                                          "not deleting it (move it away, then re-run)")
                shutil.rmtree(tmp)  # our own partial output of an interrupted attempt
            self._pending(j, "restore", J.Pending(output=tmp))
            argv = snapshot_restore_argv(
                self.cfg, snapshot=snap, name=self.member.name, initial_cluster=j.initial_cluster,
                token=j.token, peer_url=self.member.peer_url, data_dir=tmp, bump_revision=j.bump,
                # the receiver checked etcd's trailer as these bytes landed: not read back again
                skip_hash_check=landed.trailer_checked,
            )
            def run() -> Result:
                return self.host.run(argv, timeout=1800, check=False, env=ETCDCTL_ENV)

            # copied from a file here: this master's own member, beside the ship (see restore.host.priority)
            res = yielding(run) if landed.codec == "file" else run()
            if not res.ok:
                if os.path.lexists(tmp):
                    shutil.rmtree(tmp)
                tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-2:]
                raise OperationFailed(f"{self.member.name}: snapshot restore failed (exit {res.returncode}): {' / '.join(tail)}")
            os.chmod(tmp, 0o700)
            self._pending(j, "restore", J.Pending(output=tmp, argv=tuple(argv)))
            # it has served: deleted now, its pages (never fsynced) mostly go unwritten
            self._drop_payload()
            return R.RestoreReply(argv=tuple(argv), output=tmp)
        return self._step("restore", do)

    def install(self) -> R.StepReply:
        """The restored data (staged by ``restore``) into the data dir's place: a rename."""
        def do(j: J.Journal) -> R.StepReply:
            tmp = f"{self.data_dir}.restoring"
            if "install" in j.pending and os.path.isdir(self.data_dir) and not os.path.lexists(tmp):
                return R.InstallReply(installed=self.data_dir)  # renamed before a crash
            if os.path.lexists(self.data_dir):
                raise OperationFailed(f"{self.member.name}: {self.data_dir} reappeared after it was set aside; not touching it")
            if not j.done("restore") or not os.path.isdir(tmp):
                raise OperationFailed(f"{self.member.name}: no restored data staged in {tmp}")
            if self.backend.is_active():
                raise OperationFailed(f"{self.member.name}: etcd runs again ({self.backend.describe()}); "
                                      "the restored data is not moved in")
            self._pending(j, "install", J.Pending(staged=tmp))
            os.rename(tmp, self.data_dir)
            return R.InstallReply(installed=self.data_dir)
        return self._step("install", do)

    def chown(self) -> R.StepReply:
        def do(j: J.Journal) -> R.StepReply:
            owner = etcd_owner(self.cfg)
            if owner is None:
                return R.ChownReply(skipped=f"etcd runs as this agent's user ({pwd.getpwuid(os.geteuid()).pw_name})")
            spec = f"{self.cfg.etcd.user}:{self.cfg.etcd.group}"
            self.host.run(["chown", "-R", spec, self.data_dir], timeout=600)
            return R.ChownReply(owner=spec)
        return self._step("chown", do)

    def repair(self) -> R.StepReply:
        """etcd.conf (and etcd.service) present and naming this member in the restored cluster.

        Rendered, never copied: a missing conf or unit is written from the agent's own templates
        for this host; an archive's etcd.conf/etcd.service never becomes live config. An existing
        conf keeps its other lines (the host's own tuning) and gets the identity keys rewritten."""
        def do(j: J.Journal) -> R.StepReply:
            conf = self.cfg.conf_file(self.member.name)
            boot = Bootstrap(self.member.name, EXISTING, j.initial_cluster, j.token)
            values = restore_conf_values(self.cfg, self.member, boot)
            try:
                with open(conf, encoding="utf-8") as fh:
                    old: Optional[str] = fh.read()
            except FileNotFoundError:
                old = None
            if old is None:
                makedirs(os.path.dirname(conf) or "/", 0o755)  # not 0777 under umask 000
                write_atomic(conf, render_conf(self.cfg, self.member, boot).encode(), mode=0o644)
                rep = R.RepairReply(conf="missing: rendered from the agent's config", conf_created=True)
            elif all(parse_conf(old).get(k) == v for k, v in values.items()):
                rep = R.RepairReply(conf="kept")
            else:
                write_atomic(os.path.join(self.work_dir, undo.CONF_ORIG), old.encode(), mode=0o600)
                write_atomic(conf, rewrite_conf(old, values).encode(), mode=0o644)
                rep = R.RepairReply(conf="identity/cluster keys rewritten (original kept for rollback)", conf_saved=True)
            unit = self.cfg.etcd.unit_file
            if self.cfg.etcd.service_manager != "systemd":
                return rep
            if os.path.isfile(unit):
                return dataclasses.replace(rep, unit="kept")
            write_atomic(unit, LocalMember(self.cfg, self.member).unit_text().encode(), mode=0o644)
            self.host.run(["systemctl", "daemon-reload"], timeout=60)
            return dataclasses.replace(rep, unit="missing: rendered from the agent's template", unit_created=True)
        return self._step("repair", do)

    def start(self) -> R.StepReply:
        def do(j: J.Journal) -> R.StepReply:
            if not self.backend.is_active() and serving.listened(self.spots):
                # an etcd of ours on the restored data without the backend's record of it: this
                # op's own, started by a run cut off before it wrote the pid file. Stopped, so the
                # one started now serves, recorded (anything not ours: refused, named)
                serving.clear(self.spots, self.backend.kind, self._main_pid())
            self.backend.start()
            return R.StepReply()

        def gone() -> Optional[str]:
            # a resume: this member started on its restored data, then its etcd went (the host
            # rebooted, the process died). Its data is the restored one: start it again, rather
            # than wait for a member that will not come and roll every member back for it
            return None if self.backend.is_active() else "done before; etcd was not running: started again"
        return self._step("start", do, again=gone)

    def serving(self, min_revision: Optional[int]) -> R.ServingReply:
        """The restored member is what serves (``survey.restored_serving``). Read-only, not
        journaled: a resumed restore checks again."""
        return survey.restored_serving(self, min_revision)

    def unfence(self) -> R.StepReply:
        return self._step("unfence", self._unfence)

    def _unfence(self, j: J.Journal) -> R.UnfenceReply:
        f = j.record(R.FenceReply) or R.FenceReply()
        k = self.cfg.kubernetes
        if f.method == "unit" and f.was_active:
            self.host.run(["systemctl", "start", k.apiserver_unit], timeout=120)
            return R.UnfenceReply(started=k.apiserver_unit)
        if f.method == "manifest" and f.moved is not None:
            if os.path.isfile(f.moved) and not os.path.exists(k.manifest):
                os.replace(f.moved, k.manifest)
            return R.UnfenceReply(restored=k.manifest)
        return R.UnfenceReply()

    def finish(self, *, member_id: Optional[str], cluster_id: Optional[str], ancestors: List[str]) -> R.StepReply:
        """Mark the journal done, record what this member now is (its new id, the new token) and
        where its data came from (``ancestors``: the snapshot's member ids), drop the payload."""
        res = self._step("finish", lambda j: R.StepReply())
        j = self.mine()
        j.state = J.DONE
        J.save(self.journal_path, j)
        if member_id and cluster_id:
            bootstrap.remember(self.cfg, self.member.name, int(cluster_id, 16), int(member_id, 16), token=j.token)
        lineage.record(self.cfg, ancestors, j.op)
        self._record_boundary(j, cluster_id)
        self._drop_payload()
        markers.clear_restore(self.cfg, self.member.name, self.op)
        return res

    def _record_boundary(self, j: J.Journal, cluster_id: Optional[str]) -> None:
        """The restore as a boundary of this host's backup history (``backup.boundaries``). A
        failure to record it fails nothing: the restore is done."""
        from etcd_agent.backup import boundaries

        aside = j.record(R.AsideReply)
        name, sha256, to_revision = boundaries.source_of(j.backup, j.sha256)
        chain = boundaries.chain_of(self.cfg.backup.dir, name, j.op) if name and to_revision is not None else None
        b = boundaries.Boundary(op=j.op, time=j.created, from_backup=name, from_sha256=sha256,
                                set_aside=tuple(p for p in [aside.moved if aside else None] if p),
                                cluster_id=cluster_id, chain_id=chain, to_revision=to_revision)
        try:
            ensure_private_dir(self.cfg.backup.dir)
            boundaries.record(self.cfg.backup.dir, b)
        except (OSError, AgentError) as exc:
            log.warning("%s: could not record the restore in %s: %s", self.member.name, self.cfg.backup.dir, exc)

    # ------------------------------------------------------------ rollback

    def rollback(self) -> R.RollbackReply:
        """Undo whatever this op did here: old data dir back, conf back, etcd and apiserver as
        before; then report what is true now (running or not), not what was intended."""
        j = self.mine()
        if j.state == J.ROLLED_BACK:
            markers.clear_restore(self.cfg, self.member.name, self.op)
            return R.RollbackReply(step="rollback", member=self.member.name, skipped="already rolled back",
                                 running=self.backend.is_active())
        if j.state == J.DONE:
            raise RefusedError(f"{self.member.name}: restore {self.op} finished; nothing to roll back")
        did: List[str] = []
        self._rollback_data(j, did)
        self._rollback_files(j, did)
        if j.was_running and os.path.isdir(os.path.join(self.data_dir, "member")) and not self.backend.is_active():
            try:
                self.backend.start()
                did.append("etcd started again")
            except AgentError as exc:
                did.append(f"etcd NOT started again: {exc.message}")
        if j.done("fence") and not j.done("unfence") and self._unfence(j) != R.UnfenceReply():  # nothing was fenced
            did.append("apiserver unfenced")
        j.state = J.ROLLED_BACK
        j.rollback = did
        J.save(self.journal_path, j)
        self._drop_payload()
        markers.clear_restore(self.cfg, self.member.name, self.op)
        return R.RollbackReply(step="rollback", member=self.member.name, did=tuple(did), running=self.backend.is_active(),
                             was_running=j.was_running)

    def _rollback_data(self, j: J.Journal, did: List[str]) -> None:
        undo.data(j, did, self.data_dir, self.backend)

    def _rollback_files(self, j: J.Journal, did: List[str]) -> None:
        undo.files(j, did, self.cfg, self.member.name, self.work_dir, self.host)

    # ------------------------------------------------------------ housekeeping

    def _drop_payload(self) -> None:
        undo.drop_payload(self.work_dir)

    def _clear_work_dir(self) -> None:
        undo.clear_work_dir(self.work_dir)

    def cleanup(self, keep: int, dry_run: bool) -> R.CleanupReply:
        return cleanup_set_aside(self.data_dir, self.member.name, keep, dry_run)
