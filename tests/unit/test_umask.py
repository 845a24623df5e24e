"""Every dir and file the agent creates has its own mode, whatever the umask (real files, real
`mkdir` through LocalHost; the process backend's start on real etcd is in
tests/integration/test_umask.py)."""
from __future__ import annotations

import os

from etcd_agent.config import load
from etcd_agent.hosts.local import LocalHost
from etcd_agent.member.local import LocalMember
from etcd_agent.member.process import ProcessBackend
from etcd_agent.member.systemd import SystemdBackend
from etcd_agent.state import bootstrap, markers, pins
from etcd_agent.topology import static_bootstrap
from tests.harness.modes import modes, umask


def config(tmp_path, manager: str = "process"):  # type: ignore[no-untyped-def]
    root = tmp_path / "root"
    p = tmp_path / "agent.toml"
    p.write_text(f"""
[cluster]
name = "c"
[[member]]
name = "m1"
host = "127.0.0.1"
[etcd]
service_manager = "{manager}"
data_dir = "{root}/var/lib/etcd/{{name}}.etcd"
conf_file = "{root}/etc/etcd/conf.d/{{name}}.conf"
unit_file = "{root}/etc/systemd/system/etcd.service"
run_dir = "{root}/run/etcd-agent"
[daemon]
state_dir = "{root}/var/lib/etcd-agent/state"
""")
    return load(str(p)), str(root)


def test_systemd_backend_creates_missing_conf_dirs_0755_under_umask_000(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg, root = config(tmp_path, "systemd")
    os.makedirs(root, mode=0o700)
    backend = SystemdBackend(cfg, "m1", LocalHost())
    with umask(0):
        assert backend.write_conf("ETCD_NAME=m1\n")
    assert modes(root) == {"etc": 0o755, "etc/etcd": 0o755, "etc/etcd/conf.d": 0o755, "etc/etcd/conf.d/m1.conf": 0o644}


def test_render_with_the_process_backend_under_umask_000(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg, root = config(tmp_path)
    os.makedirs(root, mode=0o700)
    m = cfg.member("m1")
    with umask(0):
        assert LocalMember(cfg, m, ProcessBackend(cfg, "m1")).render(static_bootstrap(cfg, m))
    assert modes(root) == {"etc": 0o755, "etc/etcd": 0o755, "etc/etcd/conf.d": 0o755, "etc/etcd/conf.d/m1.conf": 0o644}


def test_state_dir_and_files_private_under_umask_000(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg, root = config(tmp_path)
    os.makedirs(root, mode=0o700)
    with umask(0):
        markers.mark_left(cfg, "m1")
        bootstrap.remember(cfg, "m1", 0x1234, 0x5678)
        pins.write_pin(cfg, "m1", "3.5.26", {"binary": "/opt/etcd/3.5.26/etcd"}, "3.5.25")
        markers.write_restore(cfg, "m1", "op1", "/b/etcd-x.tar")
    got = modes(root)
    dirs = {k: v for k, v in got.items() if os.path.isdir(os.path.join(root, k))}
    files = {k: v for k, v in got.items() if k not in dirs}
    assert dirs == {"var": 0o700, "var/lib": 0o700, "var/lib/etcd-agent": 0o700, "var/lib/etcd-agent/state": 0o700}
    assert len(files) == 4 and set(files.values()) == {0o600}, files
