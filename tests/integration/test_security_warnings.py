"""`backup` on real etcd says when the config exposes the S3 keys it holds, without the keys."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

AGENT = os.path.join(os.path.dirname(sys.executable), "etcd-agent")
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def test_backup_warns_about_a_world_readable_config_with_inline_keys(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    c = cluster_factory(1, extra=f'[backup.remote]\naccess_key = "AKIAEXAMPLE"\nsecret_key = "{SECRET}"\n')
    c.start_static()
    os.chmod(c.config_path, 0o644)
    res = subprocess.run([AGENT, "-c", c.config_path, "backup", "--member", "m1"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    warning = (f"config file {c.config_path} holds [backup.remote] access_key/secret_key and is readable by "
               f"group/others (mode 0644): run `chmod 600 {c.config_path}`, or move the keys to a credentials_file "
               f"of mode 0600")
    warned = [line.split(": ", 1)[1] for line in res.stderr.splitlines() if " WARNING etcd_agent.cli.backup: " in line]
    assert warned == [warning], res.stderr
    assert SECRET not in res.stdout + res.stderr
    os.chmod(c.config_path, 0o600)
    res = subprocess.run([AGENT, "-c", c.config_path, "backup", "--member", "m1"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "holds [backup.remote]" not in res.stderr, res.stderr
