"""The CLI contract: fast --help, no tracebacks, documented exit codes."""
import json
import os
import subprocess
import sys

from etcd_agent.cli.main import main
from etcd_agent.config.sample import SAMPLE


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "etcd_agent.cli.main", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_help_does_not_import_grpc_or_paramiko():
    code = ("import sys\nfrom etcd_agent.cli.main import build_parser\nbuild_parser()\n"
            "bad = [m for m in ('grpc', 'etcd3', 'paramiko', 'psutil') if m in sys.modules]\nprint(bad)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr


def test_sample_pipes_into_validate():
    res = run("config", "validate", "-", stdin=run("config", "sample").stdout)
    assert res.returncode == 0, res.stderr
    assert "valid (3 members" in res.stdout


def test_invalid_config_lists_every_problem_exit_2(tmp_path):
    bad = SAMPLE.replace('bootstrap = "static"', 'bootstrap = "later"\ncolor = 1').replace('host = "10.0.0.12"', 'host = "10.0.0.300"')
    res = run("config", "validate", "-", stdin=bad)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.count("\n  - ") == 3, res.stderr


def test_missing_config_is_one_line_exit_2(tmp_path):
    res = run("-c", str(tmp_path / "nope.toml"), "status")
    assert res.returncode == 2
    assert res.stderr.strip().startswith("etcd-agent: error: config file")
    assert "Traceback" not in res.stderr
    res = run("-c", str(tmp_path / "nope.toml"), "--json", "status")
    assert json.loads(res.stdout)["error"] == "ConfigError"


def test_bad_usage_exit_2():
    res = run("no-such-command")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert main(["demo", "--members", "x"]) == 2


def test_render_prints_both_files(tmp_path):
    p = tmp_path / "a.toml"
    p.write_text(SAMPLE)
    res = run("-c", str(p), "render", "--member", "master2")
    assert res.returncode == 0, res.stderr
    assert "ETCD_NAME=master2" in res.stdout and "[Service]" in res.stdout
    res = run("-c", str(p), "render", "--member", "nobody")
    assert res.returncode == 2 and "no member named 'nobody'" in res.stderr


def test_main_gives_the_callers_umask_back():
    # main runs under 0077 (tests/integration/test_umask.py reads it from /proc of a running
    # agent and of the etcd it starts); an in-process caller keeps its own afterwards
    old = os.umask(0o002)
    try:
        assert main(["config", "sample"]) == 0
        assert os.umask(0o002) == 0o002
    finally:
        os.umask(old)
