"""The built RPM, inspected with rpm itself: files, modes, config flags, dependencies, scriptlets,
a relocated venv without build paths, and units that `systemd-analyze verify` accepts silently."""
from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tarfile
from typing import Callable, Dict, List

import pytest

from tests.harness.rpmbuild import BuiltRpm, file_table, requires, rpm_query, scriptlets

from .conftest import REPO

pytestmark = pytest.mark.systemd

UNITS = ("etcd-agent.service", "etcd-agent-backup.service", "etcd-agent-backup.timer")
UNITDIR = "/usr/lib/systemd/system"


@pytest.fixture(scope="module")
def rpm(rpm_build: Callable[[str], BuiltRpm]) -> BuiltRpm:
    return rpm_build("1")


@pytest.fixture(scope="module")
def files(rpm: BuiltRpm) -> Dict[str, Dict[str, str]]:
    return file_table(rpm.path)


@pytest.fixture(scope="module")
def payload(rpm: BuiltRpm, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The package's files unpacked (rpm2archive: the payload as a tarball) into a scratch tree."""
    root = str(tmp_path_factory.mktemp("payload"))
    with open(rpm.path, "rb") as src:
        archive = subprocess.run(["rpm2archive", "-"], stdin=src, capture_output=True,
                                 check=True, timeout=300).stdout
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():  # our own build, but never write outside root
            assert not member.name.startswith("/") and ".." not in member.name.split("/")
        tar.extractall(root)
    return root


def test_expected_files_and_nothing_rendered(files: Dict[str, Dict[str, str]]) -> None:
    for path in ("/opt/etcd-agent/bin/etcd-agent", "/opt/etcd-agent/pyvenv.cfg",
                 "/usr/bin/etcd-agent", "/etc/etcd-agent/agent.toml", "/etc/cron.d/etcd-agent",
                 "/var/lib/etcd_backup", *(f"{UNITDIR}/{u}" for u in UNITS)):
        assert path in files, path
    assert files["/usr/bin/etcd-agent"]["link"] == "/opt/etcd-agent/bin/etcd-agent"
    # etcd.conf / etcd.service are the agent's output, never package files
    assert not [f for f in files if f.startswith("/etc/etcd/") or f.endswith("/etcd.service")]
    # no build-id links or debug files that could clash with the distro's packages
    assert not [f for f in files if "/.build-id/" in f or f.startswith("/usr/lib/debug")]
    # the venv carries no installer of its own and every module of the agent is byte-compiled
    assert not [f for f in files if re.search(r"/site-packages/pip/", f)]
    site = [f for f in files if "/site-packages/etcd_agent/" in f]
    sources = [f for f in site if f.endswith(".py")]
    assert sources
    for src in sources:
        d, name = os.path.split(src)
        assert any(f.startswith(f"{d}/__pycache__/{name[:-3]}.cpython-") for f in site), src


def test_modes_owners_and_config_flags(rpm: BuiltRpm, files: Dict[str, Dict[str, str]]) -> None:
    backup = files["/var/lib/etcd_backup"]
    assert backup["mode"] == "40700" and backup["user"] == backup["group"] == "root"
    for conf, mode in (("/etc/etcd-agent/agent.toml", "100640"), ("/etc/cron.d/etcd-agent", "100644")):
        # c = %config, n = noreplace: an upgrade keeps the operator's edits
        assert set(files[conf]["flags"]) >= {"c", "n"}, conf
        assert files[conf]["mode"] == mode, conf  # agent.toml may hold the S3 keys
        assert files[conf]["user"] == files[conf]["group"] == "root", conf
    for unit in UNITS:
        assert files[f"{UNITDIR}/{unit}"]["mode"] == "100644"
        assert "c" not in files[f"{UNITDIR}/{unit}"]["flags"]
    assert files["/opt/etcd-agent/bin/etcd-agent"]["mode"] == "100755"
    configs = sorted(rpm_query(rpm.path, "--configfiles").split())
    assert configs == ["/etc/cron.d/etcd-agent", "/etc/etcd-agent/agent.toml"]


def test_requires_only_python3_and_systemd(rpm: BuiltRpm) -> None:
    names = set()
    for req in requires(rpm.path):
        if req.startswith("rpmlib("):
            continue
        names.add(req.split()[0])
        if req.startswith("python(abi)"):
            assert req == f"python(abi) = {rpm.python}"
    # /bin/sh: the scriptlets' interpreter, added by rpm itself
    assert names == {"python3", "python(abi)", "systemd", "/bin/sh"}
    # nothing from the bundled wheels leaks into the distro's dependency graph
    provides = [p for p in rpm_query(rpm.path, "--provides").split("\n") if p.strip()]
    assert all(p.startswith("etcd-agent") for p in provides), provides


def test_scriptlets(rpm: BuiltRpm) -> None:
    s = scriptlets(rpm.path)
    pre = s["preinstall"]
    assert "getent group etcd" in pre and "groupadd -r etcd" in pre
    assert "getent passwd etcd" in pre and "useradd -r -g etcd" in pre
    assert f'!= "{rpm.python}"' in pre  # refuses a python3 of another version
    # %systemd_post: the agent only (cron.d is the default backup schedule, not the timer)
    assert "etcd-agent.service" in s["postinstall"]
    assert "etcd-agent-backup.timer" not in s["postinstall"]
    # %systemd_preun stops and disables every unit on erase; %postun restarts the agent on upgrade
    for unit in UNITS:
        assert unit in s["preuninstall"], unit
    assert "etcd-agent.service" in s["postuninstall"]
    assert "restart" in s["postuninstall"]


def test_venv_is_relocated(rpm: BuiltRpm, payload: str) -> None:
    venv = os.path.join(payload, "opt/etcd-agent")
    with open(os.path.join(venv, "bin/etcd-agent"), encoding="utf-8") as f:
        assert f.readline().strip() == "#!/opt/etcd-agent/bin/python"
    assert os.readlink(os.path.join(venv, "bin/python3")) == rpm.python_target
    with open(os.path.join(venv, "pyvenv.cfg"), encoding="utf-8") as f:
        cfg = dict(line.split(" = ", 1) for line in f.read().splitlines() if " = " in line)
    assert cfg["home"] == os.path.dirname(rpm.python_target)
    assert cfg["include-system-site-packages"] == "false"
    assert os.path.isdir(os.path.join(venv, f"lib/python{rpm.python}/site-packages/etcd3"))
    # no file, .pyc included, remembers where it was built
    found = subprocess.run(["grep", "-rl", "BUILDROOT", venv], capture_output=True, text=True)
    assert found.stdout == "", found.stdout


def test_units_pass_systemd_analyze_verify(payload: str, tmp_path: "os.PathLike[str]") -> None:
    """Strict: exit 0 and empty stderr (unknown keys only warn). ExecStart is checked for
    existence, so this copy points it at /bin/true; the e2e test verifies the installed units."""
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze missing (apt-get install -y systemd)")
    copies: List[str] = []
    for unit in UNITS:
        with open(os.path.join(payload, UNITDIR.lstrip("/"), unit), encoding="utf-8") as f:
            text = f.read()
        text = re.sub(r"^ExecStart=/usr/bin/etcd-agent\b", "ExecStart=/bin/true", text, flags=re.M)
        dest = os.path.join(str(tmp_path), unit)
        with open(dest, "w", encoding="utf-8") as f:
            f.write(text)
        copies.append(dest)
    res = subprocess.run(["systemd-analyze", "verify", *copies], capture_output=True, text=True,
                         timeout=60, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                          "SYSTEMD_LOG_COLOR": "0"})
    assert res.returncode == 0 and res.stderr == "", res.stderr


def test_spec_builds_units_of_the_tree(files: Dict[str, Dict[str, str]]) -> None:
    """Every unit in systemd/ except the agent-rendered etcd.service is packaged."""
    shipped = {os.path.basename(f) for f in files if f.startswith(UNITDIR + "/")}
    in_tree = {u for u in os.listdir(os.path.join(REPO, "systemd")) if u != "etcd.service"}
    assert shipped == in_tree
