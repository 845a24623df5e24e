"""The processes serving one member, whatever started them: found by what they hold on this host.

The agent's own record of what runs - the process backend's pid file, systemd's MainPID - misses
an etcd whose pid file was lost, one a killed restore started before it wrote the pid file, and
one started by hand. A restore that trusted it moved data dirs from under live etcds and then
reported the old cluster as restored. So a member's serving processes are found on the host
itself (psutil, /proc): an etcd with files open under the data dir or working in it, or whose
command line (``--data-dir``) or environment (``ETCD_DATA_DIR``) names it; and any process at all
listening on the member's client or peer ports.

Only a process that is provably this member's etcd as this agent runs it (``Server.ours``) is
ever signalled: on the process backend, the configured etcd binary with no flags and this
member's ``ETCD_NAME`` and ``ETCD_DATA_DIR`` (what ``ProcessBackend.start`` gives it); on systemd,
the unit's MainPID. Anything else is named (pid and command line) and left alone.
"""
from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple
from urllib.parse import urlsplit

from etcd_agent.config import Config
from etcd_agent.errors import OperationFailed
from etcd_agent.member.process import exited, stop_by_escalation
from etcd_agent.proctime import start_ticks
from etcd_agent.topology import listen_client_urls

if TYPE_CHECKING:  # pragma: no cover
    import psutil

log = logging.getLogger(__name__)

MAX_COMMAND = 2000  # characters of a command line quoted in a sentence
MAX_FDS = 100_000  # open files looked at per process: more, and the rest is not read
TERM_WAIT = 30.0  # seconds an etcd has to exit on SIGTERM (it closes its db within ~10 ms)
WILDCARD = ("0.0.0.0", "::")


@dataclass(frozen=True)
class Spots:
    """What marks a process as serving one member on this host."""

    member: str
    data_dir: str  # without a trailing slash
    ports: Tuple[Tuple[str, int], ...]  # (host of the URL, port): client, loopback client, peer
    binary: str  # the etcd this agent starts for the member (its pinned release's)


@dataclass(frozen=True)
class Server:
    """One process serving a member: what it runs and how it was found."""

    pid: int  # 0: a listening socket whose process this agent cannot see
    command: str  # its command line, as ps shows it (bounded)
    how: Tuple[str, ...]  # "has <file> open", "listens on 127.0.0.1:2379", ...
    ours: bool  # provably this member's etcd as this agent runs it: may be stopped
    holds_data: bool  # has files open under the data dir (what serving from it means)
    started: Optional[int] = None  # its start ticks (``proctime``): the same process when it is signalled

    def sentence(self) -> str:
        who = f"pid {self.pid} ({self.command})" if self.pid else "a process this agent cannot see"
        return f"{who} {'; '.join(self.how)}"


def refusal(server: Server, kind: str) -> str:
    """Why a restore will not go on while ``server`` (not ours) serves the member: one sentence."""
    return f"{server.sentence()}, and this agent did not start it ({kind} backend): stop it, then restore again"


def spots_for(cfg: Config, member: str, data_dir: str) -> Spots:
    m = cfg.member(member)
    ports: List[Tuple[str, int]] = []
    for url in [*listen_client_urls(m), m.peer_url]:
        u = urlsplit(url)
        if u.port is not None:
            ports.append((u.hostname or "", u.port))
    return Spots(member=member, data_dir=data_dir.rstrip("/"), ports=tuple(ports), binary=cfg.etcd.binary)


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top + "/")


def _address_matches(listening: str, host: str) -> bool:
    """Whether a socket bound to ``listening`` takes the member's ``host``'s connections."""
    if listening in WILDCARD or listening == host:
        return True
    try:
        ip = ipaddress.ip_address(listening)
    except ValueError:
        return False
    if host == "localhost":
        return ip.is_loopback
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True  # a name: which addresses it has is not known here, the port decides
    return False


def _listeners(spots: Spots) -> Dict[int, List[str]]:
    """pid (0: not visible) -> "listens on ..." for every socket listening on the member's ports."""
    import psutil

    out: Dict[int, List[str]] = {}
    try:
        conns = psutil.net_connections(kind="inet")
    except psutil.Error as exc:
        raise OperationFailed(f"{spots.member}: the sockets listening on this host cannot be listed ({exc})") from None
    for c in conns:
        if c.status != psutil.CONN_LISTEN or not c.laddr:
            continue
        ip, port = c.laddr.ip, c.laddr.port
        if any(port == p and _address_matches(ip, h) for h, p in spots.ports):
            where = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            out.setdefault(c.pid or 0, []).append(f"listens on {where}")
    return out


def listened(spots: Spots) -> bool:
    """Whether anything listens on the member's ports: the quick look (sockets only) before a
    start, where the full one would cost its 0.1-0.4 s of downtime every time."""
    return bool(_listeners(spots))


def _is_etcd(proc: "psutil.Process") -> bool:
    import psutil

    try:
        cmd = proc.cmdline()
        exe = proc.exe()
    except (psutil.Error, OSError):
        return False
    names = {os.path.basename(exe)} | ({os.path.basename(cmd[0])} if cmd else set())
    return any(etcd_name(n) for n in names)


def etcd_name(name: str) -> bool:
    """etcd, or a release's copy of it (etcd-3.5.16); never this agent (etcd-agent) nor etcd's
    tools (etcdctl, etcdutl)."""
    return name == "etcd" or (name.startswith(("etcd-", "etcd_")) and not name.startswith("etcd-agent"))


def _data_marks(proc: "psutil.Process", data_dir: str, names: Set[str]) -> Tuple[List[str], bool]:
    """How an etcd process names or holds ``data_dir`` (``names``: it and the path the config
    gives it); and whether it holds files under it."""
    import psutil

    marks: List[str] = []
    held = ""
    try:
        fds = os.listdir(f"/proc/{proc.pid}/fd")[:MAX_FDS]
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
        except OSError:
            continue
        if _under(target, data_dir):
            held = target
            if target.endswith("/member/snap/db"):
                break  # the file that says it most plainly
    if held:
        marks.append(f"has {held} open")
    try:
        if _under(proc.cwd(), data_dir):
            marks.append(f"works in {proc.cwd()}")
        cmd = proc.cmdline()
        for i, a in enumerate(cmd):
            named = a.split("=", 1)[1] if a.startswith("--data-dir=") else (
                cmd[i + 1] if a == "--data-dir" and i + 1 < len(cmd) else None)
            if named is not None and os.path.normpath(os.path.join(proc.cwd(), named)) in names:
                marks.append(f"runs with --data-dir {named}")
        env = proc.environ().get("ETCD_DATA_DIR")
        if env is not None and os.path.normpath(env) in names:
            marks.append(f"has ETCD_DATA_DIR={env}")
    except (psutil.Error, OSError):
        pass
    return marks, bool(held)


def _ours(proc: "psutil.Process", spots: Spots, kind: str, main_pid: Optional[int]) -> bool:
    """Provably this member's etcd as this agent runs it (see the module's docstring)."""
    import psutil

    if kind == "systemd":
        return main_pid is not None and proc.pid == main_pid
    try:
        cmd = proc.cmdline()
        env = proc.environ()
    except (psutil.Error, OSError):
        return False  # what cannot be read is not proven
    return (len(cmd) == 1 and os.path.basename(cmd[0]) == os.path.basename(spots.binary)
            and env.get("ETCD_NAME") == spots.member
            and os.path.normpath(env.get("ETCD_DATA_DIR", "")) == spots.data_dir)


def _command(proc: "psutil.Process") -> str:
    import psutil

    try:
        text = " ".join(proc.cmdline()) or f"[{proc.name()}]"
    except (psutil.Error, OSError):
        text = "?"
    return text if len(text) <= MAX_COMMAND else text[:MAX_COMMAND] + "..."


def find(spots: Spots, kind: str, main_pid: Optional[int] = None) -> List[Server]:
    """Every process serving the member on this host (this process excepted), by pid."""
    import psutil

    listening = _listeners(spots)
    found: List[Server] = [Server(pid=0, command="?", how=tuple(listening.pop(0)), ours=False, holds_data=False)
                           ] if 0 in listening else []
    data_dir = os.path.realpath(spots.data_dir)
    names = {data_dir, os.path.normpath(spots.data_dir)}
    seen: Set[int] = set()
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue  # it has exited: it holds nothing
            marks, held = _data_marks(proc, data_dir, names) if _is_etcd(proc) else ([], False)
            marks += listening.get(proc.pid, [])
            if not marks:
                continue
            seen.add(proc.pid)
            found.append(Server(pid=proc.pid, command=_command(proc), how=tuple(marks),
                                ours=_ours(proc, spots, kind, main_pid), holds_data=held, started=start_ticks(proc.pid)))
        except (psutil.Error, OSError):
            continue  # gone while looked at
    for pid, marks in listening.items():  # a listener that went while the processes were listed
        if pid and pid not in seen:
            found.append(Server(pid=pid, command="?", how=tuple(marks), ours=False, holds_data=False))
    return sorted(found, key=lambda s: s.pid)


def stop(server: Server, spots: Spots, kind: str, main_pid: Optional[int] = None) -> None:
    """Stop one of ``ours`` by escalation (TERM, wait, KILL), after checking it is still that
    process and still ours; it has exited when this returns (OperationFailed if it would not)."""
    import psutil

    if not server.ours:
        raise OperationFailed(f"{spots.member}: not stopping {server.sentence()}: this agent did not start it")
    try:
        proc = psutil.Process(server.pid)
        if start_ticks(server.pid) != server.started or not _ours(proc, spots, kind, main_pid):
            return  # that process is gone; its pid now names another
        log.warning("%s: stopping etcd pid %d, which serves this member without the agent's record of it (%s)",
                    spots.member, server.pid, server.command)
        stop_by_escalation(proc, spots.member, TERM_WAIT, lambda: exited(proc))
    except psutil.NoSuchProcess:
        return
    except psutil.Error as exc:
        raise OperationFailed(f"{spots.member}: cannot stop {server.sentence()}: {exc}") from None


def clear(spots: Spots, kind: str, main_pid: Optional[int] = None) -> List[Server]:
    """Nothing serves the member any more: every one of ``ours`` stopped, then looked for again;
    anything still serving it (not ours, or one that came back) fails naming it, and the caller
    moves nothing. The ones stopped."""
    servers = find(spots, kind, main_pid)
    ours = [s for s in servers if s.ours]
    for s in ours:
        stop(s, spots, kind, main_pid)
    # looked for again only after a stop (a scan takes 0.1-0.4 s, and this runs while etcd is down)
    left = find(spots, kind, main_pid) if ours else servers
    if left:
        raise OperationFailed(f"{spots.member}: {'; '.join(s.sentence() for s in left)}: this agent did not start "
                              f"{'it' if len(left) == 1 else 'them'}, so does not stop "
                              f"{'it' if len(left) == 1 else 'them'}, and moves nothing of this member's")
    return ours


def served_by(spots: Spots, kind: str, pid: Optional[int]) -> Server:
    """The member is served by ``pid`` alone (the etcd the backend runs), from its data dir; else
    OperationFailed naming what serves it instead."""
    if pid is None:
        raise OperationFailed(f"{spots.member}: the etcd this restore started does not run")
    servers = find(spots, kind, pid)
    others = [s for s in servers if s.pid != pid]
    if others:
        raise OperationFailed(f"{spots.member}: the restored etcd is pid {pid}, yet "
                              f"{'; '.join(s.sentence() for s in others)}")
    me = next((s for s in servers if s.pid == pid), None)
    if me is None or not me.holds_data:
        raise OperationFailed(f"{spots.member}: the etcd this restore started (pid {pid}) holds nothing open under "
                              f"{spots.data_dir}: it does not serve the restored data")
    return me
