"""The agent as the RPM installs it: byte-compiled.

rpm.spec compiles every module at build time, so an installed agent never compiles one at
start. A checkout run with PYTHONDONTWRITEBYTECODE (set on these machines) compiles every
module it imports, in every process - the orchestrator and each `node serve` - on every run:
about 0.15 s a process here. A benchmark compares what operators run, so it byte-compiles the
checkout's package once before its first round (a source changed later is simply compiled
again by Python, never run stale).
"""
from __future__ import annotations

import compileall
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "etcd_agent")


def byte_compile() -> None:
    if not compileall.compile_dir(PACKAGE, quiet=1, workers=0):
        raise SystemExit(f"cannot byte-compile {PACKAGE}")
