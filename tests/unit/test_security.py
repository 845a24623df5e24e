"""Secrets in files others can read: warned about by `config validate`, `status` and the daemon
(real files and modes; `backup` on real etcd is in tests/integration/test_security_warnings.py)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from etcd_agent.config import load, security_warnings
from tests.harness.loopback import free_port_pairs

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def run(*args: str) -> "subprocess.CompletedProcess[str]":
    return subprocess.run([sys.executable, "-m", "etcd_agent.cli.main", *args], capture_output=True, text=True,
                          timeout=60)


def write(tmp_path, remote: str, mode: int, ssh: str = "") -> str:  # type: ignore[no-untyped-def]
    (c, p), = free_port_pairs(1)  # nothing listens there: status finds the member down
    path = tmp_path / "agent.toml"
    path.write_text(f"""
[cluster]
name = "c"
[[member]]
name = "a"
host = "127.0.0.1"
client_url = "http://127.0.0.1:{c}"
peer_url = "http://127.0.0.1:{p}"
[etcd]
service_manager = "process"
data_dir = "{tmp_path}/data/{{name}}.etcd"
conf_file = "{tmp_path}/conf/{{name}}.conf"
run_dir = "{tmp_path}/run"
[backup]
dir = "{tmp_path}/backups"
[daemon]
state_dir = "{tmp_path}/state"
[backup.remote]
{remote}
{ssh}
""")
    os.chmod(path, mode)
    return str(path)


INLINE = f'access_key = "AKIAEXAMPLE"\nsecret_key = "{SECRET}"'


def inline_warning(path: str, mode: str) -> str:
    return (f"config file {path} holds [backup.remote] access_key/secret_key and is readable by group/others "
            f"(mode {mode}): run `chmod 600 {path}`, or move the keys to a credentials_file of mode 0600")


def test_validate_warns_about_inline_keys_others_can_read_exit_0(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path, INLINE, 0o644)
    res = run("-c", path, "config", "validate")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[1:] == [f"warning: {inline_warning(path, '0644')}"]
    assert SECRET not in res.stdout + res.stderr and "AKIAEXAMPLE" not in res.stdout + res.stderr
    res = run("-c", path, "--json", "config", "validate")
    assert json.loads(res.stdout)["warnings"] == [inline_warning(path, "0644")]
    os.chmod(path, 0o640)  # group-readable is readable too
    assert run("-c", path, "config", "validate").stdout.splitlines()[1:] == [f"warning: {inline_warning(path, '0640')}"]
    os.chmod(path, 0o600)
    res = run("-c", path, "config", "validate")
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 1 and "warning" not in res.stdout + res.stderr


def test_a_readable_config_without_secrets_is_fine_a_writable_one_is_not(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path, "", 0o644)
    assert security_warnings(load(path)) == []
    os.chmod(path, 0o666)
    assert security_warnings(load(path)) == [
        f"config file {path} is writable by group/others (mode 0666): whoever can write it decides what the agent "
        f"runs; run `chmod go-w {path}`"]


def test_credentials_file_and_ssh_key_open_to_others(tmp_path) -> None:  # type: ignore[no-untyped-def]
    creds = tmp_path / "s3-credentials"
    creds.write_text(f"[default]\naws_access_key_id = AKIAEXAMPLE\naws_secret_access_key = {SECRET}\n")
    key = tmp_path / "id_ed25519"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    os.chmod(creds, 0o644)
    os.chmod(key, 0o644)
    path = write(tmp_path, f'credentials_file = "{creds}"', 0o644, f'[ssh]\nidentity_file = "{key}"')
    assert security_warnings(load(path)) == [
        f"backup.remote.credentials_file {creds} is open to group/others (mode 0644): it holds the S3 secret key "
        f"and remote copies refuse it; run `chmod 600 {creds}`",
        f"ssh.identity_file {key} is readable by group/others (mode 0644): it is the private key that logs in to "
        f"every master as root; run `chmod 600 {key}`",
    ]
    os.chmod(creds, 0o600)
    os.chmod(key, 0o600)
    assert security_warnings(load(path)) == []


def test_status_prints_the_warning(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path, INLINE, 0o644)
    res = run("-c", path, "status", "--timeout", "0.5")
    assert res.returncode == 1  # the member is down; the warning is said all the same
    assert res.stdout.splitlines()[-1] == f"warning: {inline_warning(path, '0644')}"
    assert SECRET not in res.stdout + res.stderr
    res = run("-c", path, "--json", "status", "--timeout", "0.5")
    assert json.loads(res.stdout)["warnings"] == [inline_warning(path, "0644")]


def test_daemon_logs_the_warning_at_start_and_on_reload(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    from etcd_agent.daemon.loop import Daemon

    path = write(tmp_path, INLINE, 0o644)
    with caplog.at_level(logging.WARNING, logger="etcd_agent"):
        d = Daemon(path, member="a")
        assert [r.getMessage() for r in caplog.records] == [inline_warning(path, "0644")]
        caplog.clear()
        os.chmod(path, 0o600)
        d.reload()
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        os.chmod(path, 0o604)
        d.reload()
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [inline_warning(path, "0604")]
    assert SECRET not in caplog.text
