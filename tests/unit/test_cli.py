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


def test_a_config_that_is_not_a_regular_file_is_one_line_exit_2_never_a_hang(tmp_path):
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    (tmp_path / "dev.toml").symlink_to("/dev/null")
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "big.toml").write_text("# " + "x" * (1 << 20) + "\n")
    (tmp_path / "latin1.toml").write_bytes(b'[cluster]\nname = "caf\xe9"\n')
    cases = {
        str(fifo): "is a FIFO, not a regular file",
        "/dev/zero": "is a character device, not a regular file",
        str(tmp_path / "dev.toml"): "is a character device, not a regular file",
        str(tmp_path / "dir.toml"): "is a directory, not a regular file",
        str(tmp_path / "big.toml"): "is larger than 1 MiB",
        str(tmp_path / "latin1.toml"): "is not UTF-8 text (at byte offset 21)",
    }
    for path, why in cases.items():
        for args in (["config", "validate"], ["status"]):
            res = run("-c", path, *args)  # a hang fails on run()'s timeout
            assert (res.returncode, res.stderr) == (2, f"etcd-agent: error: config file {path} {why}\n"), (path, args)
    with open("/dev/zero", "rb") as zero:
        res = subprocess.run([sys.executable, "-m", "etcd_agent.cli.main", "config", "validate", "-"], stdin=zero,
                             capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stderr) == (2, "etcd-agent: error: <stdin> is larger than 1 MiB\n")


def test_parse_errors_are_one_line_each_exit_2(tmp_path):
    p = tmp_path / "agent.toml"
    for body, detail in (("x = " + "[" * 100_000, "not valid TOML: values nested too deeply"),
                         (SAMPLE + "[backup]\nspace_margin = nan\n", None),
                         (SAMPLE.replace('name = "k8s-etcd"', 'name = "k8s-etcd\\n"'), None)):
        p.write_text(body)
        res = run("-c", str(p), "config", "validate")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        lines = res.stderr.splitlines()
        assert lines[0] == f"etcd-agent: error: {p}: 1 problem in the config" and len(lines) == 2, res.stderr
        if detail:
            assert lines[1] == f"  - {detail}"
    assert lines[1] == ("  - cluster.name: contains a control character (newline); "
                        "a value must be one line of printable text")


def test_backup_waits_as_long_as_a_restore_does_and_refuses_a_bad_wait(tmp_path):
    from etcd_agent.cli.backup import BACKUP_WAIT
    from etcd_agent.cli.main import build_parser
    from etcd_agent.state.locks import SHORT_WAIT

    assert BACKUP_WAIT == SHORT_WAIT
    assert build_parser().parse_args(["backup"]).wait == SHORT_WAIT
    p = tmp_path / "a.toml"
    p.write_text(SAMPLE)
    for bad in ("-1", "3601"):
        res = run("-c", str(p), "backup", "--wait", bad)
        assert res.returncode == 2 and "--wait must be between 0 and 3600 seconds" in res.stderr, res.stderr
