"""LocalHost: real subprocesses and files in a temp dir (no fakes)."""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import psutil
import pytest

from etcd_agent.errors import CommandError, CommandTimedOut
from etcd_agent.fs import write_atomic
from etcd_agent.hosts.local import LocalHost


@pytest.fixture
def host() -> LocalHost:
    return LocalHost("me")


def test_result_carries_exit_code_and_streams(host: LocalHost) -> None:
    res = host.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10, check=False)
    assert (res.returncode, res.stdout, res.stderr, res.host) == (3, "out\n", "err\n", "me")
    assert not res.ok and res.argv == ("sh", "-c", "echo out; echo err >&2; exit 3")
    assert host.run(["true"], timeout=10).ok


def test_command_error_carries_the_result(host: LocalHost) -> None:
    with pytest.raises(CommandError) as ei:
        host.run(["sh", "-c", "echo first >&2; echo boom >&2; exit 7"], timeout=10)
    err = ei.value
    assert err.result.returncode == 7 and err.result.stderr == "first\nboom\n"
    assert "exited 7" in str(err) and "boom" in str(err) and err.exit_code == 1


def test_missing_program_is_a_command_error(host: LocalHost) -> None:
    with pytest.raises(CommandError) as ei:
        host.run(["/nonexistent/program", "x"], timeout=10)
    assert ei.value.result.returncode == 127 and not isinstance(ei.value, CommandTimedOut)


def test_timeout_kills_and_keeps_partial_output(host: LocalHost) -> None:
    start = time.monotonic()
    with pytest.raises(CommandTimedOut) as ei:
        host.run(["sh", "-c", "echo partial; exec sleep 29.5731"], timeout=0.5)
    assert time.monotonic() - start < 3.0
    res = ei.value.result
    assert res.returncode == -1 and res.stdout == "partial\n"
    assert isinstance(ei.value, CommandError)  # callers catching CommandError see timeouts too
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "29.5731"]]


def test_argv_is_not_shell_interpreted(host: LocalHost, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    args = ["a b", "$(touch %s)" % marker, "; touch %s" % marker, "*", ""]
    res = host.run(["printf", "%s\\0", *args], timeout=10)
    assert res.stdout.split("\0")[:-1] == args and not marker.exists()


def test_input_and_env(host: LocalHost) -> None:
    assert host.run(["cat"], timeout=10, input=b"abc\x00def").stdout == "abc\x00def"
    assert host.run(["cat"], timeout=5).stdout == ""  # stdin is /dev/null, not ours
    res = host.run(["sh", "-c", 'printf %s "$EA_X"'], timeout=10, env={"EA_X": "v $(id)"})
    assert res.stdout == "v $(id)"


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o644])
def test_write_atomic_sets_mode_and_leaves_no_temp(host: LocalHost, tmp_path: Path, mode: int) -> None:
    p = tmp_path / "etcd.conf"
    old = os.umask(0o077)  # the mode must not depend on the umask
    try:
        host.write_atomic(str(p), b"ETCD_NAME=a\n", mode=mode)
    finally:
        os.umask(old)
    assert p.read_bytes() == b"ETCD_NAME=a\n"
    assert stat.S_IMODE(p.stat().st_mode) == mode
    assert os.listdir(tmp_path) == ["etcd.conf"]


def test_write_atomic_replaces_and_cleans_up_on_failure(tmp_path: Path) -> None:
    p = tmp_path / "f"
    write_atomic(str(p), b"one")
    ino = p.stat().st_ino
    write_atomic(str(p), b"two")
    assert p.read_bytes() == b"two" and p.stat().st_ino != ino  # a new file renamed over the old
    with pytest.raises(TypeError):
        write_atomic(str(p), "not bytes")  # type: ignore[arg-type]
    assert p.read_bytes() == b"two" and os.listdir(tmp_path) == ["f"]
    with pytest.raises(FileNotFoundError):
        write_atomic(str(tmp_path / "no" / "dir" / "f"), b"x")


def test_read_exists_put_get(host: LocalHost, tmp_path: Path) -> None:
    src = tmp_path / "src.db"
    src.write_bytes(os.urandom(70000))
    dst = tmp_path / "dst.db"
    assert not host.exists(str(dst))
    host.put(str(src), str(dst))
    assert host.exists(str(dst)) and host.read(str(dst)) == src.read_bytes()
    assert stat.S_IMODE(dst.stat().st_mode) == 0o600
    back = tmp_path / "back.db"
    host.get(str(dst), str(back))
    assert back.read_bytes() == src.read_bytes()
    with pytest.raises(FileNotFoundError):
        host.read(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        host.put(str(tmp_path / "missing"), str(tmp_path / "x"))
    assert sorted(os.listdir(tmp_path)) == ["back.db", "dst.db", "src.db"]


def test_a_session_closed_while_its_stderr_is_read_raises_nothing_in_any_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LocalSession.close`` closed the child's stderr while the thread draining it was still
    reading (a process the child started holds the pipe open: no end of file when the child
    ends): `ValueError: PyMemoryView_FromBuffer(): info->buf must not be NULL` printed as a
    traceback in `restore --dry-run` (seen in CI). No exception in any thread; what the child
    said before it ended is kept."""
    import sys
    import threading

    from etcd_agent.hosts.local import LocalSession

    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(repr(args.exc_value)))
    late = "import sys, time\ntime.sleep(0.3)\nsys.stderr.write('late\\n')\n"
    script = (f"import subprocess, sys\nsys.stderr.write('early\\n')\nsys.stderr.flush()\n"
              f"subprocess.Popen([sys.executable, '-c', {late!r}])\n")
    sessions = [LocalSession("here", [sys.executable, "-c", script]) for _ in range(3)]
    for s in sessions:
        s.close()
    time.sleep(1.0)  # the grandchildren write and end: the drain threads wake
    assert raised == []
    assert all("early" in s.stderr_tail() for s in sessions), [s.stderr_tail() for s in sessions]
