"""The Host interface: one way to run commands and move files, local or remote.

Local and SSH hosts are twins behind this protocol; the logic above never branches on which one
it holds. Commands are argv lists, never shell strings; every call has a timeout; failures raise
typed errors that carry the ``Result``.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence, Tuple

from ..errors import CommandError


@dataclass(frozen=True)
class Result:
    """What one command did."""

    host: str
    argv: Tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def check(self) -> "Result":
        """Raise CommandError unless the command exited 0."""
        if self.returncode != 0:
            tail = (self.stderr.strip() or self.stdout.strip()).splitlines()[-3:]
            raise CommandError(
                f"{self.host}: `{self.command}` exited {self.returncode}"
                + (f": {' / '.join(tail)}" if tail else ""),
                self,
            )
        return self


class Host(Protocol):
    """A machine the agent can act on."""

    name: str

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = True,
        input: Optional[bytes] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> Result:
        """Run ``argv`` (no shell); raise CommandError on failure when ``check``,
        CommandTimedOut after ``timeout`` seconds (the command is killed)."""
        ...

    def read(self, path: str) -> bytes:
        """The whole content of a (small) file; FileNotFoundError if it is missing."""
        ...

    def write_atomic(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Write via a temporary file in the same dir, fsync, rename: readers never see half."""
        ...

    def exists(self, path: str) -> bool:
        ...

    def put(self, local_path: str, remote_path: str, *, mode: int = 0o600) -> None:
        """Copy a local file to this host (atomically, same rules as write_atomic)."""
        ...

    def get(self, remote_path: str, local_path: str) -> None:
        """Copy a file from this host to a local path."""
        ...

    def close(self) -> None:
        ...
