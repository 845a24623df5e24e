"""A real S3-compatible HTTP server on loopback for tests: moto's standalone server in a subprocess.

moto (``moto[server]``, on PyPI) speaks the S3 REST protocol over HTTP, including multipart
uploads, x-amz-checksum-sha256 and MD5 ETags, and needs no binary download or root. Running it as
its own process keeps its memory out of the test's RSS measurements and lets it be killed by PID.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import IO, Optional


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """``start()`` / ``stop()``; ``endpoint`` is http://127.0.0.1:PORT."""

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self.port = 0
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self._log: Optional[IO[bytes]] = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "S3Server":
        for _ in range(3):  # the free port may be taken between probe and bind
            self.port = _free_port()
            self._log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ, AWS_ACCESS_KEY_ID="unused", AWS_SECRET_ACCESS_KEY="unused"),
            )
            if self._wait_ready(timeout):
                return self
            self.stop()
        raise RuntimeError(f"moto server did not start; see {self.log_path}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=2) as resp:
                    if resp.status < 500:
                        return True
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
