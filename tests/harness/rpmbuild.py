"""Build the product RPM with packaging/build-rpm.sh and query it with rpm (no root needed).

The build script caches wheels under build/ (the first build downloads them), so a test session
pays one download at most; every build goes to a directory the caller chooses.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_SCRIPT = os.path.join(REPO, "packaging", "build-rpm.sh")
# what the script prints last: "build-rpm: PATH (41.9 MB, Python 3.11 -> /usr/bin/python3) ..."
_SUMMARY = re.compile(r"^build-rpm: (\S+\.rpm) \(([\d.]+) MB, Python (\S+) -> (\S+)\) "
                      r"built in ([\d.]+) s$", re.M)


@dataclass(frozen=True)
class BuiltRpm:
    """One package the build script produced, with the figures it printed."""

    path: str
    release: str
    seconds: float
    size_bytes: int
    python: str        # the venv's Python version, e.g. "3.11"
    python_target: str  # the interpreter the installed venv runs on


def build_rpm(release: str, dist_dir: str, timeout: float = 900.0) -> BuiltRpm:
    """Run the one build command; raise with its output's tail when it fails."""
    env = dict(os.environ, RPM_RELEASE=release, DIST_DIR=dist_dir)
    t0 = time.monotonic()
    proc = subprocess.run([BUILD_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-30:])
        raise RuntimeError(f"build-rpm.sh exited {proc.returncode}:\n{tail}")
    m = _SUMMARY.search(proc.stdout)
    if m is None:
        raise RuntimeError(f"build-rpm.sh printed no summary:\n{proc.stdout}\n{proc.stderr}")
    path = m.group(1)
    return BuiltRpm(path=path, release=release, seconds=seconds,
                    size_bytes=os.path.getsize(path), python=m.group(3),
                    python_target=m.group(4))


def rpm_query(path: str, *args: str) -> str:
    """`rpm -qp ARGS PATH`'s stdout (Debian's rpm warns about alien on stderr: ignored)."""
    proc = subprocess.run(["rpm", "-qp", *args, path], capture_output=True, text=True,
                          timeout=120, check=True)
    return proc.stdout


def file_table(path: str) -> Dict[str, Dict[str, str]]:
    """Every file of the package: name -> mode (octal), flags, user, group, link target."""
    qf = "[%{FILENAMES}\t%{FILEMODES:octal}\t%{FILEFLAGS:fflags}\t%{FILEUSERNAME}\t" \
         "%{FILEGROUPNAME}\t%{FILELINKTOS}\n]"
    table: Dict[str, Dict[str, str]] = {}
    for line in rpm_query(path, "--qf", qf).splitlines():
        name, mode, flags, user, group, link = line.split("\t")
        table[name] = {"mode": mode, "flags": flags, "user": user, "group": group, "link": link}
    return table


def scriptlets(path: str) -> Dict[str, str]:
    """`rpm -qp --scripts` split into its sections: preinstall, postinstall, preuninstall, ..."""
    sections: Dict[str, List[str]] = {}
    current = None
    for line in rpm_query(path, "--scripts").splitlines():
        m = re.match(r"^(\w+) (?:scriptlet|program) \(using (\S+)\):", line)
        if m:
            current = m.group(1)
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


def requires(path: str) -> List[str]:
    """The package's Requires, one string each (duplicates of Requires(post) etc. folded)."""
    return sorted({r.strip() for r in rpm_query(path, "-R").splitlines() if r.strip()})
