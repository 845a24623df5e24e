"""A real S3 server for tests: Ceph's RADOS Gateway on a one-node Ceph (mon + memstore OSD).

The Python form of ../shared/testbed/rgw_up.sh and rgw_down.sh (README section 7 there says what
is proven on these machines), as netns.py is of netns_up.sh: the repo stays self-contained and the
daemons are this process's children, so they are stopped and reaped by PID, never by name.

Everything lives under the bed's directory (config, keys, mon store, logs, admin sockets); nothing
in /etc/ceph or /var/lib/ceph is read or written. Pools have size 1, auth (cephx) is on, the OSD
keeps its data in RAM (memstore).

Ports: each bed claims a block of ``BLOCK`` consecutive ports from ``FIRST_PORT`` on (the mon, ten
messenger ports for the OSD, the S3 port last) by an exclusive flock on a file named after the
block, held for the bed's life. The script picks the first block nothing listens on, which two
beds starting at once (two xdist workers, two worktrees) would both pick; the flock makes the pick
exclusive, and a block where anything else listens (a bed of rgw_up.sh, which takes no flock) is
skipped as before.

Measured here: up() ~6 s (the first write's pool creation included), idle RSS ~140 MiB (mon ~39,
OSD ~52, radosgw ~47 MiB). Faults for tests: ``pause()`` (SIGSTOP: TCP still accepted, no answer),
``stop_gateway()`` / ``start_gateway()`` (refused, then back on the same port with the same data).

Debian packages: ceph-mon ceph-osd radosgw (``packaging/install-deps.sh test``).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import IO, TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Set, Union

import psutil
import pytest

from etcd_agent.waiting import NotYet, poll

if TYPE_CHECKING:  # pragma: no cover
    from etcd_agent.config import Config

log = logging.getLogger(__name__)

BINARIES = ("/usr/bin/ceph-mon", "/usr/bin/ceph-osd", "/usr/bin/radosgw", "/usr/bin/radosgw-admin",
            "/usr/bin/ceph", "/usr/bin/ceph-authtool", "/usr/bin/monmaptool")
FIRST_PORT = 16789
BLOCK = 12  # mon, OSD messenger ports mon+1..mon+10, S3 on mon+11
LAST_PORT = 30000
LOCK_DIR = os.path.join(tempfile.gettempdir(), "etcd-agent-rgw-ports")  # beside demo_ports' lock
DAEMONS = ("rgw", "osd", "mon")  # the stop order: gateway first, mon last (the OSD reports to it)
USER = "testbed"


def missing_binaries() -> List[str]:
    return [b for b in BINARIES if not os.access(b, os.X_OK)]


def _listening_ports() -> Set[int]:
    return {c.laddr.port for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and isinstance(c.laddr, tuple) and c.laddr}


def _alive(proc: "Optional[subprocess.Popen[bytes]]") -> bool:
    return proc is not None and proc.poll() is None


TomlValue = Union[str, int, float, bool]


def remote_table(rgw: "RgwBed", bucket: str, **keys: TomlValue) -> str:
    """A ``[backup.remote]`` table copying to ``bucket`` of ``rgw``: enabled, path style, the bed's
    keys, then ``keys`` (each overrides or adds one: ``secret_key="wrong"``, ``prefix="p/"``)."""
    fields: Dict[str, TomlValue] = {"enabled": True, "endpoint": rgw.endpoint, "bucket": bucket,
                                    "access_key": rgw.access_key, "secret_key": rgw.secret_key,
                                    "addressing_style": "path", **keys}
    return "[backup.remote]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in fields.items())


def rgw_config_text(rgw: "RgwBed", bucket: str, *, backup_dir: Optional[str] = None, **keys: TomlValue) -> str:
    """A whole agent config: cluster prod1 of one member m1 on 127.0.0.1, its backups in
    ``backup_dir`` (else the default), copying as ``remote_table`` says."""
    backup = f"[backup]\ndir = {_toml(backup_dir)}\n" if backup_dir is not None else ""
    return ('[cluster]\nname = "prod1"\n[[member]]\nname = "m1"\nhost = "127.0.0.1"\n' + backup
            + remote_table(rgw, bucket, **keys))


def rgw_config(rgw: "RgwBed", bucket: str, *, backup_dir: Optional[str] = None, **keys: TomlValue) -> "Config":
    """``rgw_config_text`` parsed (it must be valid)."""
    from etcd_agent.config import parse_text

    cfg, errors = parse_text(rgw_config_text(rgw, bucket, backup_dir=backup_dir, **keys))
    assert not errors and cfg is not None, errors
    return cfg


def on_agent_clients(monkeypatch: pytest.MonkeyPatch, event: str, handler: Callable[..., Any]) -> None:
    """``handler`` registered for botocore's ``event`` (``before-call.s3.GetObject``,
    ``before-parameter-build.s3.UploadPart`` ...) on every S3 client the agent makes from now on
    (``etcd_agent.bucket.client._client``), until the test ends: to count or watch the agent's
    requests, hold one, or answer one in the store's place (a before-call handler's return value
    is the response). Called again, the handlers add up."""
    from etcd_agent.bucket import client as remotebucket

    made = remotebucket._client

    def hooked(*args: Any, **kwargs: Any) -> Any:
        client = made(*args, **kwargs)
        client.meta.events.register(event, handler)
        return client

    monkeypatch.setattr(remotebucket, "_client", hooked)


def _toml(v: TomlValue) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)  # a JSON string or number is a TOML one


def session_bed(tmp_path_factory: pytest.TempPathFactory, name: str, addr: str) -> Iterator[RgwBed]:
    """The body of a session fixture: a bed in the session's temp dir, up, yielded, down."""
    missing = missing_binaries()
    if missing:  # a real component like etcd: missing is an install failure, never a skip
        pytest.fail(f"Ceph is not installed (missing {', '.join(missing)}): run `packaging/install-deps.sh test`",
                    pytrace=False)
    bed = RgwBed(str(tmp_path_factory.mktemp(name)), addr=addr)
    bed.up()
    try:
        yield bed
    finally:
        bed.down()  # raises if a daemon or a listening port was left


class RgwBed:
    """One Ceph cluster with one radosgw; ``up()`` / ``down()``, or a context manager.

    ``addr`` is where S3 is served (the mon and OSD stay on loopback): 127.0.0.1, or a bridge
    address (a NetnsBed's ``gateway``) so that namespace hosts reach it."""

    def __init__(self, workdir: str, *, addr: str = "127.0.0.1", store_bytes: int = 2 << 30) -> None:
        self.dir = os.path.abspath(workdir)
        self.addr = addr
        # the OSD's memstore: what the store holds, in RAM. Full (past the OSD's full ratio, 95 %),
        # Ceph blocks writes and the gateway stops answering: a bench chain and its checkpoints
        # near 2 GiB need more
        self.store_bytes = store_bytes
        self.conf = os.path.join(self.dir, "ceph.conf")
        self.mon_port = 0
        self.port = 0
        self.access_key = ""
        self.secret_key = ""
        self.start_seconds = 0.0  # how long up() took
        self.procs: Dict[str, "subprocess.Popen[bytes]"] = {}
        self._lock: Optional[IO[str]] = None
        self._buckets = 0
        self._fresh: List[str] = []  # buckets new_bucket() made since begin_test()
        self._paused = False

    # ------------------------------------------------------------------ what tests use

    @property
    def endpoint(self) -> str:
        return f"http://{self.addr}:{self.port}"

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client of the test's own (path style; ``config`` adds botocore Config
        fields, e.g. ``read_timeout=2, retries={"max_attempts": 1}``)."""
        import boto3
        from botocore.config import Config as BotoConfig

        fields: Dict[str, Any] = {"s3": {"addressing_style": "path"}}
        fields.update(config)
        return boto3.session.Session(
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
        ).client("s3", endpoint_url=self.endpoint, region_name="us-east-1", config=BotoConfig(**fields))

    def new_bucket(self, name: Optional[str] = None) -> str:
        """A fresh, empty bucket (a unique name unless ``name`` is given)."""
        if name is None:
            self._buckets += 1
            name = f"t{self._buckets}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        self._fresh.append(name)
        return name

    def begin_test(self) -> None:
        """A test starts: buckets made so far belong to wider-scoped fixtures and are kept."""
        self._fresh = []

    def after_test(self) -> None:
        """A test ended: the gateway serves again (``heal``), and the buckets ``new_bucket`` made
        since ``begin_test`` (the test's own and its function fixtures') are emptied and removed:
        the OSD keeps every byte in RAM for the whole session."""
        self.heal()
        buckets, self._fresh = self._fresh, []
        s3 = self.client()
        for bucket in buckets:
            try:
                for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
                    for up in page.get("Uploads", []):
                        s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                    keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                    if keys:
                        s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
                s3.delete_bucket(Bucket=bucket)
            except s3.exceptions.NoSuchBucket:
                pass  # the test removed it itself

    def pause(self) -> None:
        """SIGSTOP radosgw: a hung gateway; the kernel still accepts TCP connections for it."""
        os.kill(self._gateway().pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        os.kill(self._gateway().pid, signal.SIGCONT)
        self._paused = False

    def stop_gateway(self) -> None:
        """radosgw down (an outage: connections refused); the data stays in the cluster."""
        self._stop("rgw")

    def start_gateway(self, timeout: float = 60.0) -> None:
        """radosgw up again on the same address and port, serving the same data."""
        if _alive(self.procs.get("rgw")):
            return
        self._start("rgw", "/usr/bin/radosgw", "-n", "client.rgw.gw")
        self._wait_http(timeout)

    def heal(self) -> None:
        """Whatever a test did to the gateway (paused, stopped), it serves again."""
        if _alive(self.procs.get("rgw")):
            self.resume()  # SIGCONT: harmless to a gateway that runs
        self.start_gateway()

    def rss_bytes(self) -> Dict[str, int]:
        """Resident memory of each daemon."""
        out = {}
        for name, proc in self.procs.items():
            if _alive(proc):
                out[name] = psutil.Process(proc.pid).memory_info().rss
        return out

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "RgwBed":
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def up(self, timeout: float = 120.0) -> "RgwBed":
        t0 = time.monotonic()
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"Ceph is not installed (missing {', '.join(missing)}); "
                               "run `packaging/install-deps.sh test`")
        os.makedirs(self.dir, exist_ok=True)
        if os.listdir(self.dir):
            raise RuntimeError(f"{self.dir} is not empty; an RGW bed needs a directory of its own")
        self._claim_ports()
        try:
            self._make_cluster()
            self._start("mon", "/usr/bin/ceph-mon", "-i", "a")
            self._wait_port(self.mon_port, "127.0.0.1", timeout, "the mon")
            osd_uuid = str(uuid.uuid4())
            self._ceph("osd", "new", osd_uuid, "0")
            self._run("/usr/bin/ceph-osd", "-c", self.conf, "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
            self._start("osd", "/usr/bin/ceph-osd", "-i", "0")
            poll(self._osd_up, timeout=timeout, what="the OSD up", interval=0.3, transient=(NotYet,))
            self._start("rgw", "/usr/bin/radosgw", "-n", "client.rgw.gw")
            self._wait_http(timeout)
            user = json.loads(self._run("/usr/bin/radosgw-admin", "-c", self.conf, "user", "create",
                                        f"--uid={USER}", "--display-name=test bed"))
            self.access_key = user["keys"][0]["access_key"]
            self.secret_key = user["keys"][0]["secret_key"]
            with open(os.path.join(self.dir, "s3.env"), "w") as fh:
                fh.write(f"AWS_ACCESS_KEY_ID={self.access_key}\nAWS_SECRET_ACCESS_KEY={self.secret_key}\n"
                         f"S3_ENDPOINT={self.endpoint}\n")
            self._warm_up()
        except BaseException:
            log.error("RGW bed in %s failed to start; logs in %s/log", self.dir, self.dir)
            self.down()
            raise
        self.start_seconds = time.monotonic() - t0
        log.info("RGW bed up in %.1f s: S3 on %s (mon 127.0.0.1:%d)", self.start_seconds, self.endpoint,
                 self.mon_port)
        return self

    def down(self) -> None:
        """Every daemon stopped (SIGTERM, then SIGKILL after 10 s) and reaped, the port block
        released; the logs are kept, the stores removed. Raises if anything was left."""
        for name in DAEMONS:
            self._stop(name)
        left = [f"{n} (pid {p.pid})" for n, p in self.procs.items() if _alive(p)]
        ports = range(self.mon_port, self.mon_port + BLOCK) if self.mon_port else range(0)
        listening = sorted(set(ports) & _listening_ports())
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        for sub in ("mon", "osd", "rgw"):
            shutil.rmtree(os.path.join(self.dir, sub), ignore_errors=True)
        if left or listening:
            raise RuntimeError(f"RGW bed {self.dir} left {', '.join(left) or 'no process'}, "
                               f"ports still listening: {listening or 'none'}")

    # ------------------------------------------------------------------ internals

    def _gateway(self) -> "subprocess.Popen[bytes]":
        proc = self.procs.get("rgw")
        if not _alive(proc):
            raise RuntimeError("radosgw is not running")
        assert proc is not None
        return proc

    def _claim_ports(self) -> None:
        os.makedirs(LOCK_DIR, exist_ok=True)
        for base in range(FIRST_PORT, LAST_PORT - BLOCK, BLOCK):
            lock = open(os.path.join(LOCK_DIR, f"ports-{base}.lock"), "a+")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            if set(range(base, base + BLOCK)) & _listening_ports():
                lock.close()
                continue
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()}: {self.dir}\n")
            lock.flush()
            self._lock, self.mon_port, self.port = lock, base, base + BLOCK - 1
            return
        raise RuntimeError(f"no free block of {BLOCK} ports in {FIRST_PORT}-{LAST_PORT}")

    def _make_cluster(self) -> None:
        d = self.dir
        for sub in ("run", "log", "mon", "osd/0", "rgw", "crash"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        fsid = str(uuid.uuid4())
        mon = self.mon_port
        with open(self.conf, "w") as fh:
            fh.write(_CONF.format(fsid=fsid, mon=mon, lo=mon + 1, hi=mon + 10, d=d, addr=self.addr,
                                  port=self.port, store=self.store_bytes))
        at = "/usr/bin/ceph-authtool"
        keys = {
            "admin.keyring": ("client.admin", ["mon", "allow *", "osd", "allow *", "mgr", "allow *"]),
            "osd/0/keyring": ("osd.0", ["mon", "allow profile osd", "osd", "allow *", "mgr", "allow profile osd"]),
            "rgw/keyring": ("client.rgw.gw", ["mon", "allow rw", "osd", "allow rwx", "mgr", "allow rw"]),
        }
        for path, (name, caps) in keys.items():
            argv = [at, "--create-keyring", os.path.join(d, path), "--gen-key", "-n", name]
            for i in range(0, len(caps), 2):
                argv += ["--cap", caps[i], caps[i + 1]]
            self._run(*argv)
        mon_keyring = os.path.join(d, "mon", "keyring")
        self._run(at, "--create-keyring", mon_keyring, "--gen-key", "-n", "mon.", "--cap", "mon", "allow *")
        for path in keys:
            self._run(at, mon_keyring, "--import-keyring", os.path.join(d, path))
        monmap = os.path.join(d, "monmap")
        self._run("/usr/bin/monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{mon}]", monmap)
        self._run("/usr/bin/ceph-mon", "-c", self.conf, "--mkfs", "-i", "a", "--monmap", monmap,
                  "--keyring", mon_keyring)

    def _warm_up(self) -> None:
        """The first object written creates RGW's data pools (~5 s): paid here, in the start-up,
        not by whichever test writes first."""
        s3 = self.client()
        s3.create_bucket(Bucket="warm-up")
        s3.put_object(Bucket="warm-up", Key="k", Body=b"x")
        s3.delete_object(Bucket="warm-up", Key="k")
        s3.delete_bucket(Bucket="warm-up")

    def _run(self, *argv: str, timeout: float = 60.0) -> str:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return proc.stdout

    def _ceph(self, *args: str) -> str:
        return self._run("/usr/bin/ceph", "-c", self.conf, "--connect-timeout", "10", *args)

    def _start(self, name: str, *argv: str) -> None:
        """A daemon in the foreground (-f) of a session of its own, as this process's child."""
        with open(os.path.join(self.dir, "log", f"{name}.out"), "ab") as out:
            proc = subprocess.Popen([*argv, "-c", self.conf, "-f"], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        with open(os.path.join(self.dir, "run", f"{name}.pid"), "w") as fh:
            fh.write(f"{proc.pid}\n")

    def _stop(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGCONT)  # a paused daemon would not act on SIGTERM
        if name == "rgw":
            self._paused = False
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("RGW bed: %s (pid %d) ignored SIGTERM for 10 s, sending SIGKILL", name, proc.pid)
            proc.kill()
            proc.wait(timeout=10)

    def _osd_up(self) -> bool:
        if not _alive(self.procs.get("osd")):
            raise RuntimeError(f"ceph-osd exited; see {self.dir}/log")
        try:
            stat = json.loads(self._ceph("osd", "stat", "-f", "json"))
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            raise NotYet(str(exc)) from exc
        return int(stat.get("num_up_osds", 0)) == 1

    def _wait_port(self, port: int, addr: str, timeout: float, what: str) -> None:
        def listening() -> bool:
            return port in _listening_ports()

        poll(listening, timeout=timeout, what=f"{what} listening on {addr}:{port}", interval=0.1)

    def _wait_http(self, timeout: float) -> None:
        def answers() -> bool:
            if not _alive(self.procs.get("rgw")):
                raise RuntimeError(f"radosgw exited; see {self.dir}/log")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=2):
                    return True
            except urllib.error.HTTPError:
                return True  # an S3 error document is an answer
            except OSError as exc:
                raise NotYet(str(exc)) from exc

        poll(answers, timeout=timeout, what=f"S3 on {self.endpoint}", interval=0.2, transient=(NotYet,))


# rgw_up.sh's configuration, and: the mon commits map changes every 50 ms instead of every second
# (RGW creates its six pools one command after another at start and on the first write: 15 s of
# a 21 s start-up, now ~1 s); RGW's garbage collector frees deleted objects' tails within seconds
# instead of hours (tests delete and overwrite; the OSD holds data in RAM).
_CONF = """[global]
fsid = {fsid}
mon_host = [v2:127.0.0.1:{mon}]
mon_initial_members = a
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_msgr1 = false
ms_bind_msgr2 = true
ms_bind_ipv6 = false
ms_bind_port_min = {lo}
ms_bind_port_max = {hi}
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
run_dir = {d}/run
crash_dir = {d}/crash
log_file = {d}/log/$name.log
mon_cluster_log_file = {d}/log/cluster.log
keyring = {d}/admin.keyring
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_max_pg_per_osd = 500
[mon]
mon_data = {d}/mon/$id
paxos_propose_interval = 0.05
paxos_min_wait = 0.01
mon_memory_target = 134217728
rocksdb_cache_size = 33554432
[osd]
osd_data = {d}/osd/$id
keyring = {d}/osd/$id/keyring
osd_objectstore = memstore
memstore_device_bytes = {store}
osd_memory_target = 939524096
osd_crush_initial_weight = 1
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 1
osd_map_cache_size = 50
[client.rgw.gw]
keyring = {d}/rgw/keyring
rgw_data = {d}/rgw
rgw_frontends = beast endpoint={addr}:{port}
rgw_thread_pool_size = 32
rgw_enable_usage_log = false
rgw_gc_obj_min_wait = 5
rgw_gc_processor_period = 10
"""
