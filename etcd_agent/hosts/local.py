"""LocalHost: this machine, through subprocess (argv lists, no shell, timeouts)."""
from __future__ import annotations

import collections
import os
import select
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from typing import IO, Deque, Mapping, Optional, Sequence, Union

from etcd_agent.errors import CommandError, CommandTimedOut, HostUnreachable
from etcd_agent.fs import enlarge_pipe, fsync_dir, fsync_path, write_atomic
from etcd_agent.hosts.base import LineBuffer, Result


class LocalHost:
    """This machine."""

    def __init__(self, name: str = "localhost") -> None:
        self.name = name

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = True,
        input: Optional[bytes] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> Result:
        argv = tuple(str(a) for a in argv)
        full_env = None
        if env is not None:
            full_env = dict(os.environ)
            full_env.update(env)
        start = time.monotonic()
        try:
            proc = subprocess.run(
                argv,
                input=input,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=None if input is not None else subprocess.DEVNULL,
                timeout=timeout,
                env=full_env,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            res = Result(self.name, argv, -1, _text(exc.stdout), _text(exc.stderr), time.monotonic() - start)
            raise CommandTimedOut(f"{self.name}: `{res.command}` timed out after {timeout:g}s", res) from exc
        except OSError as exc:
            res = Result(self.name, argv, 127, "", str(exc), time.monotonic() - start)
            raise CommandError(f"{self.name}: cannot run `{res.command}`: {exc.strerror or exc}", res) from exc
        res = Result(self.name, argv, proc.returncode, _text(proc.stdout), _text(proc.stderr), time.monotonic() - start)
        return res.check() if check else res

    def read(self, path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def write_atomic(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        write_atomic(path, data, mode=mode)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def put(self, local_path: str, remote_path: str, *, mode: int = 0o600) -> None:
        directory = os.path.dirname(os.path.abspath(remote_path))
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(remote_path)}.", suffix=".tmp", dir=directory)
        os.close(fd)
        try:
            shutil.copyfile(local_path, tmp)
            os.chmod(tmp, mode)
            fsync_path(tmp)
            os.replace(tmp, remote_path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        fsync_dir(directory)

    def get(self, remote_path: str, local_path: str) -> None:
        shutil.copyfile(remote_path, local_path)

    def spawn(self, argv: Sequence[str]) -> "LocalSession":
        return LocalSession(self.name, argv)

    def spawn_stream(self, argv: Sequence[str]) -> "LocalSession":
        return LocalSession(self.name, argv, bulk=True)

    def close(self) -> None:
        pass


# how long closing a session waits for the end of its child's stderr (its last lines; only a
# process the child started and left holding the pipe makes it wait at all)
ERR_DRAIN_WAIT = 0.2


class PipeSession:
    """The caller's end of a session over pipes: ``stdin`` written, ``out_fd`` read by lines with
    a deadline. LocalSession's child process is one other end; the test harness's scripted hosts
    (threads on ``os.pipe()``) are another, speaking through the same code."""

    def __init__(self, where: str, stdin: IO[bytes], out_fd: int) -> None:
        self.where = where
        self._stdin = stdin
        self._out_fd = out_fd
        self._lines = LineBuffer(where, self._read_some)

    def _read_some(self, timeout: float) -> Optional[bytes]:
        ready, _w, _x = select.select([self._out_fd], [], [], timeout)
        if not ready:
            return None
        return os.read(self._out_fd, 65536)

    def send(self, data: Union[bytes, memoryview]) -> None:
        try:
            self._stdin.write(data)
            self._stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise HostUnreachable(f"{self.where}: session ended ({exc})") from None

    def close_input(self) -> None:
        try:
            self._stdin.close()
        except OSError:
            pass

    def recv_line(self, timeout: float, limit: int) -> bytes:
        return self._lines.line(timeout, limit)


class LocalSession(PipeSession):
    """A child process spoken to through pipes. Its own session (process group): a Ctrl-C in the
    operator's terminal reaches only the caller, which then decides (rolls back through it)."""

    def __init__(self, where: str, argv: Sequence[str], *, bulk: bool = False) -> None:
        """``bulk``: its stdin carries a stream (a restore's snapshot): a 1 MiB pipe, so this side
        wakes once per MiB rather than per 64 KiB."""
        try:
            self._proc = subprocess.Popen(
                [str(a) for a in argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, close_fds=True,
            )
        except OSError as exc:
            raise HostUnreachable(f"{where}: cannot start `{shlex.join(argv)}`: {exc.strerror or exc}") from None
        assert self._proc.stdin is not None and self._proc.stdout is not None and self._proc.stderr is not None
        if bulk:
            enlarge_pipe(self._proc.stdin.fileno())
        super().__init__(where, self._proc.stdin, self._proc.stdout.fileno())
        self._err: Deque[str] = collections.deque(maxlen=20)
        self._err_thread = threading.Thread(target=self._drain_stderr, name=f"stderr-{where}", daemon=True)
        self._err_thread.start()

    def _drain_stderr(self) -> None:
        """Read to the end of the child's stderr, then close it: this thread is its only reader
        and its closer. A process the child started may hold the pipe open after the child ended
        (no end of file until it ends too); closed from ``close`` under a blocked read, the read
        woke on a freed buffer (`ValueError: PyMemoryView_FromBuffer()`, a traceback in the
        operator's terminal)."""
        fh = self._proc.stderr
        assert fh is not None
        try:
            for raw in fh:
                self._err.append(raw.decode("utf-8", "replace").rstrip("\n"))
        finally:
            fh.close()

    def abort(self) -> None:
        """End the command now (SIGTERM to its pid: a receiver removes its temp file on the way out)."""
        try:
            self._proc.terminate()
        except OSError:
            pass

    def close(self, grace: float = 10.0) -> None:
        self.close_input()
        try:
            self._proc.wait(grace)
        except subprocess.TimeoutExpired:
            # still in a step: it ends once the step is done (a stuck one is stopped STOP_GRACE
            # after its input closed: node.server); reap it then
            threading.Thread(target=self._proc.wait, name=f"reap-{self.where}", daemon=True).start()
            return
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        # what it said last is read before anyone asks for it (stderr_tail); its drain thread
        # closes stderr at its end, later if a process it started still holds the pipe
        self._err_thread.join(ERR_DRAIN_WAIT)

    def exit_code(self) -> Optional[int]:
        return self._proc.poll()

    def stderr_tail(self) -> str:
        return " / ".join(list(self._err)[-3:])


def _text(data: "Optional[Union[bytes, str]]") -> str:
    if data is None:
        return ""
    if isinstance(data, str):
        return data
    return data.decode("utf-8", "replace")
