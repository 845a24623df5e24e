"""LocalHost: this machine, through subprocess (argv lists, no shell, timeouts)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Mapping, Optional, Sequence, Union

from ..errors import CommandError, CommandTimedOut
from ..fs import fsync_dir, write_atomic
from .base import Result


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
            raise CommandTimedOut(f"{self.name}: `{res.command}` timed out after {timeout:g}s", res)
        except OSError as exc:
            res = Result(self.name, argv, 127, "", str(exc), time.monotonic() - start)
            raise CommandError(f"{self.name}: cannot run `{res.command}`: {exc.strerror or exc}", res)
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
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, remote_path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        fsync_dir(directory)

    def get(self, remote_path: str, local_path: str) -> None:
        shutil.copyfile(remote_path, local_path)

    def close(self) -> None:
        pass


def _text(data: "Optional[Union[bytes, str]]") -> str:
    if data is None:
        return ""
    if isinstance(data, str):
        return data
    return data.decode("utf-8", "replace")
