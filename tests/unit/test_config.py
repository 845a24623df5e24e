"""Config parsing and validation: every problem at once, never a silent default."""
import dataclasses

import pytest

from etcd_agent.config import load, parse_text
from etcd_agent.config.sample import SAMPLE
from etcd_agent.errors import ConfigError
from etcd_agent.locality import MachineIdentity, local_member

GOOD = """
[cluster]
name = "c"
token = "t1"
[[member]]
name = "a"
host = "10.0.0.1"
[[member]]
name = "b"
host = "10.0.0.2"
"""


def test_sample_validates_and_matches_shipped_default():
    cfg, errors = parse_text(SAMPLE)
    assert errors == []
    assert [m.name for m in cfg.members] == ["master1", "master2", "master3"]
    with open("conf/agent.toml") as fh:
        assert fh.read() == SAMPLE, "conf/agent.toml drifted from `etcd-agent config sample`"


def test_defaults_resolve_urls():
    cfg, errors = parse_text(GOOD)
    assert errors == []
    a = cfg.member("a")
    assert (a.client_url, a.peer_url, a.ssh_host) == ("http://10.0.0.1:2379", "http://10.0.0.1:2380", "10.0.0.1")
    assert cfg.etcd.data_dir == "/var/lib/etcd/default.etcd"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cluster.name = "x"  # type: ignore[misc]


def test_five_mistakes_are_all_reported():
    text = """
[cluster]
name = "c"
bootstrap = "sometimes"
colour = "blue"
[[member]]
name = "a;rm -rf /"
host = "10.0.0.1"
[[member]]
name = "b"
host = "10.0.0.999"
[[member]]
name = "c"
host = "10.0.0.3"
peer_url = "http://10.0.0.1:2380"
[tls]
client_ca = "/nonexistent/ca.crt"
client_cert = "/nonexistent/c.crt"
client_key = "/nonexistent/c.key"
"""
    cfg, errors = parse_text(text)
    joined = "\n".join(errors)
    assert "unknown key 'colour'" in joined
    assert "bootstrap must be one of static, incremental" in joined
    assert "not a safe identifier" in joined
    assert "'10.0.0.999' is not a valid IP address" in joined
    assert "duplicate peer_url" in joined
    assert "tls.client_ca: file /nonexistent/ca.crt does not exist" in joined
    assert len(errors) >= 5


def test_wrong_types_and_unknown_sections():
    cfg, errors = parse_text('[cluster]\nname = 3\n[clutser]\nx=1\n[[member]]\nname="a"\nhost="h"\n[etcd]\nclient_port="2379"\n')
    assert cfg is None
    assert "cluster.name: expected a string, got 3" in errors
    assert "unknown section [clutser]" in errors
    assert any("etcd.client_port: expected an integer" in e for e in errors)


def test_missing_member_keys_and_no_members():
    _, errors = parse_text("[cluster]\nname='c'\n")
    assert any("no [[member]]" in e for e in errors)
    _, errors = parse_text("[[member]]\nname='a'\n")
    assert any("missing required key 'host'" in e for e in errors)


def test_url_scheme_must_match_tls(tmp_path):
    for f in ("ca", "crt", "key"):
        (tmp_path / f).write_text("x")
    text = GOOD + f'[tls]\nclient_ca="{tmp_path}/ca"\nclient_cert="{tmp_path}/crt"\nclient_key="{tmp_path}/key"\n'
    cfg, errors = parse_text(text)
    assert errors == []
    assert cfg.member("a").client_url == "https://10.0.0.1:2379"
    _, errors = parse_text(text.replace('host = "10.0.0.2"', 'host = "10.0.0.2"\nclient_url = "http://10.0.0.2:2379"'))
    assert any("must use https" in e for e in errors)


def test_malformed_urls():
    for url, why in (("10.0.0.1:2380", "must start with http"), ("http://10.0.0.1", "no port"), ("http://:2380", "no valid host"), ("http://h:2380/x", "scheme://host:port only")):
        _, errors = parse_text(GOOD.replace('host = "10.0.0.2"', f'host = "10.0.0.2"\npeer_url = "{url}"'))
        assert any(why in e for e in errors), (url, errors)


def test_shell_metacharacters_in_paths_are_refused():
    _, errors = parse_text(GOOD + '[etcd]\ndata_dir = "/var/lib/etcd; rm -rf /"\n')
    assert any("etcd.data_dir" in e for e in errors)


def test_shared_host_needs_name_placeholder():
    text = GOOD.replace("10.0.0.2", "10.0.0.1").replace('name = "b"\nhost = "10.0.0.1"', 'name = "b"\nhost = "10.0.0.1"\nclient_url="http://10.0.0.1:3379"\npeer_url="http://10.0.0.1:3380"')
    _, errors = parse_text(text)
    assert any("{name} placeholder" in e for e in errors)


def test_local_member_resolution():
    cfg, _ = parse_text(GOOD)
    me = MachineIdentity(("node-x",), ("127.0.0.1", "10.0.0.2"))
    assert local_member(cfg, me).name == "b"
    assert local_member(cfg, MachineIdentity(("a",), ())).name == "a"
    with pytest.raises(ConfigError, match="local member not found"):
        local_member(cfg, MachineIdentity(("z",), ("192.0.2.1",)))
    _, errors = parse_text(GOOD + '[local]\nname = "zz"\n')
    assert any("local member not found" in e for e in errors)


def test_load_errors_are_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load(str(tmp_path / "missing.toml"))
    p = tmp_path / "bad.toml"
    p.write_text("[cluster\n")
    with pytest.raises(ConfigError) as ei:
        load(str(p))
    assert "not valid TOML" in ei.value.details[0]


# ---------------------------------------------------------------- values that type-check but must not pass

CTL = """
[cluster]
name = "c"
token = "t\\u2028x"
[[member]]
name = "a"
host = "10.0.0.1\\r"
[[member]]
name = "b"
host = "10.0.0.2"
client_url = "http://10.0.0.2:2379\\n"
[etcd]
data_dir = "/var/lib/etcd\\n"
user = "etcd\\u202e"
[backup.remote]
access_key = "AKIA\\tX"
secret_key = "s3cr\\u0000et"
"""


def test_control_characters_are_one_error_per_value_and_never_echoed():
    cfg, errors = parse_text(CTL)
    why = "a value must be one line of printable text"
    assert cfg is None
    assert sorted(errors) == sorted([
        f"cluster.token: contains a control character (U+2028); {why}",
        f"member 'a'.host: contains a control character (carriage return); {why}",
        # urlsplit strips a trailing newline: only this check stops it reaching etcd.conf
        f"member 'b'.client_url: contains a control character (newline); {why}",
        f"etcd.data_dir: contains a control character (newline); {why}",
        f"etcd.user: contains a control character (U+202E); {why}",
        f"backup.remote.access_key: contains a control character (tab); {why}",
        f"backup.remote.secret_key: contains a control character (NUL); {why}",
    ])
    assert not any("s3cr" in e or "AKIA" in e for e in errors)


def _keys_of_type(wanted: type):
    """(table, key) of every config key whose type is ``wanted`` (or Optional of it)."""
    import typing

    from etcd_agent.config import SECTIONS, RemoteSection

    tables = [*SECTIONS.items(), ("backup.remote", RemoteSection)]
    for table, cls in tables:
        for key, hint in typing.get_type_hints(cls).items():
            args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            if args == [wanted]:
                yield table, key


def test_every_float_key_refuses_nan_and_infinity():
    keys = list(_keys_of_type(float))
    assert ("backup", "space_margin") in keys and len(keys) >= 8
    for table, key in keys:
        for value in ("nan", "inf", "-inf", "+nan"):
            _, errors = parse_text(GOOD + f"[{table}]\n{key} = {value}\n")
            shown = {"nan": "nan", "+nan": "nan", "inf": "inf", "-inf": "-inf"}[value]
            assert errors == [f"{table}.{key}: must be a finite number, got {shown}"], (table, key, value, errors)


def test_every_numeric_key_refuses_integers_beyond_64_bits():
    keys = list(_keys_of_type(int)) + list(_keys_of_type(float))
    assert ("daemon", "lock_ttl") in keys and ("etcd", "client_port") in keys
    for table, key in keys:
        for value in (2**63, -(2**63) - 1, 10**400):
            _, errors = parse_text(GOOD + f"[{table}]\n{key} = {value}\n")
            assert errors == [f"{table}.{key}: is out of range: more than a 64-bit integer holds"], (table, key)
    _, errors = parse_text(GOOD + "[daemon]\nlock_ttl = " + "9" * 5000 + "\n")
    assert len(errors) == 1 and errors[0].startswith("not valid TOML: Exceeds the limit"), errors


def test_deep_nesting_is_one_error_not_a_traceback():
    for text in ("x = " + "[" * 100_000, "x = " + "{a = " * 100_000):
        assert parse_text(GOOD + text) == (None, ["not valid TOML: values nested too deeply"])
    # tomllib builds deep table headers without recursing (the value is then a deep table, which
    # must not be repr'd); tomli (Python < 3.11) recurses: either way one error
    deep = "[cluster.name" + ".a" * 50_000 + "]\n"
    _, errors = parse_text(deep + '[[member]]\nname = "a"\nhost = "h"\n')
    assert errors in (["cluster.name: expected a string, got a table"], ["not valid TOML: values nested too deeply"])
def test_durations_are_bounded():
    _, errors = parse_text(GOOD + "[daemon]\ninterval = 1e300\nlock_ttl = 9999999999\n[etcd]\nstart_timeout = 0.0\n")
    assert sorted(errors) == [
        "daemon.interval must be at most 604800 seconds (7 days)",
        "daemon.lock_ttl must be at most 604800 seconds (7 days)",
        "etcd.start_timeout must be > 0 seconds",
    ]


NOT_NORMAL = ("is not normalised (no '.' or '..' components, no '//', no trailing '/'): "
              "write the path exactly as the agent should use it")


@pytest.mark.parametrize("table,key,value,message", [
    # found by testing: each of these validated
    ("etcd", "data_dir", "/usr/lib", "etcd.data_dir '/usr/lib' is inside /usr, which belongs to the system; "
     "give the agent a place of its own (e.g. /var/lib/etcd/default.etcd)"),
    ("etcd", "data_dir", "/etc/.", f"etcd.data_dir '/etc/.' {NOT_NORMAL}"),
    ("etcd", "data_dir", "/var/lib/etcd/../../../etc", f"etcd.data_dir '/var/lib/etcd/../../../etc' {NOT_NORMAL}"),
    ("backup", "dir", "/", "backup.dir '/' is a system directory; give the agent a directory of its own "
     "(e.g. /var/lib/etcd_backup)"),
    ("backup", "dir", "/etc", "backup.dir '/etc' is a system directory; give the agent a directory of its own "
     "(e.g. /var/lib/etcd_backup)"),
    ("backup", "dir", "/tmp", "backup.dir '/tmp' is a system directory; give the agent a directory of its own "
     "(e.g. /var/lib/etcd_backup)"),
    # and their relatives
    ("etcd", "data_dir", "/var/lib/etcd/", f"etcd.data_dir '/var/lib/etcd/' {NOT_NORMAL}"),
    ("etcd", "data_dir", "/var//lib/etcd", f"etcd.data_dir '/var//lib/etcd' {NOT_NORMAL}"),
    ("etcd", "data_dir", "//var/lib/etcd", f"etcd.data_dir '//var/lib/etcd' {NOT_NORMAL}"),
    ("etcd", "data_dir", "var/lib/etcd", "etcd.data_dir 'var/lib/etcd' must be an absolute path of plain characters"),
    ("etcd", "data_dir", "/var/lib", "etcd.data_dir '/var/lib' is a system directory; give the agent a directory "
     "of its own (e.g. /var/lib/etcd/default.etcd)"),
    ("etcd", "data_dir", "/etc/etcd/data", "etcd.data_dir '/etc/etcd/data' is inside /etc, which belongs to the "
     "system; give the agent a place of its own (e.g. /var/lib/etcd/default.etcd)"),
    ("backup", "dir", "/var/tmp", "backup.dir '/var/tmp' is a system directory; give the agent a directory of its "
     "own (e.g. /var/lib/etcd_backup)"),
    ("backup", "dir", "/home", "backup.dir '/home' is a system directory; give the agent a directory of its own "
     "(e.g. /var/lib/etcd_backup)"),
    ("backup", "dir", "/boot/backups", "backup.dir '/boot/backups' is inside /boot, which belongs to the system; "
     "give the agent a place of its own (e.g. /var/lib/etcd_backup)"),
    ("daemon", "state_dir", "/lib64/agent", "daemon.state_dir '/lib64/agent' is inside /lib64, which belongs to the "
     "system; give the agent a place of its own (e.g. /var/lib/etcd-agent)"),
    ("daemon", "state_dir", "/proc/self", "daemon.state_dir '/proc/self' is inside /proc, which belongs to the "
     "system; give the agent a place of its own (e.g. /var/lib/etcd-agent)"),
    ("etcd", "run_dir", "/run", "etcd.run_dir '/run' is a system directory; give the agent a directory of its own "
     "(e.g. /run/etcd-agent)"),
    ("kubernetes", "manifest_aside_dir", "/etc", "kubernetes.manifest_aside_dir '/etc' is a system directory; give "
     "the agent a directory of its own (e.g. /etc/kubernetes/manifests-aside)"),
    ("etcd", "conf_file", "/etc/passwd", "etcd.conf_file '/etc/passwd' is directly in /etc, a system directory; the "
     "agent writes this file, so give it a directory of its own (e.g. /etc/etcd/etcd.conf)"),
    ("etcd", "unit_file", "/usr/lib/systemd/system/etcd.service", "etcd.unit_file "
     "'/usr/lib/systemd/system/etcd.service' is inside /usr, which belongs to the system; give the agent a place "
     "of its own (e.g. /etc/systemd/system/etcd.service)"),
    ("kubernetes", "manifest", "/etc/shadow", "kubernetes.manifest '/etc/shadow' is directly in /etc, a system "
     "directory; the agent writes this file, so give it a directory of its own "
     "(e.g. /etc/kubernetes/manifests/kube-apiserver.yaml)"),
    ("backup", "metrics_file", "/tmp/etcd.prom", "backup.metrics_file '/tmp/etcd.prom' is directly in /tmp, a system "
     "directory; the agent writes this file, so give it a directory of its own "
     "(e.g. /var/lib/node_exporter/textfile_collector/etcd_agent_backup.prom)"),
    ("etcd", "binary", "/usr/bin/../bin/etcd", f"etcd.binary '/usr/bin/../bin/etcd' {NOT_NORMAL}"),
    ("ssh", "known_hosts", "/etc/etcd-agent/./known_hosts", f"ssh.known_hosts '/etc/etcd-agent/./known_hosts' {NOT_NORMAL}"),
])
def test_paths_are_normalised_and_the_agents_own(table, key, value, message):
    _, errors = parse_text(GOOD + f'[{table}]\n{key} = "{value}"\n')
    assert errors == [message]


@pytest.mark.parametrize("table,key,value", [
    ("etcd", "data_dir", "/var/lib/etcd"),          # kubeadm's
    ("etcd", "data_dir", "/var/lib/etcd/{name}.etcd"),
    ("etcd", "data_dir", "/srv/etcd"),
    ("etcd", "data_dir", "/home/etcd/data"),
    ("backup", "dir", "/var/backups/etcd"),
    ("backup", "dir", "/tmp/etcd-agent-test/backups"),  # below /tmp: the test tiers live there
    ("etcd", "binary", "/usr/bin/etcd"),              # read, never written: /usr is fine
    ("etcd", "versions_dir", "/usr/local/etcd"),
    ("etcd", "unit_file", "/run/systemd/system/etcd.service"),
    ("kubernetes", "manifest_aside_dir", "/etc/kubernetes/manifests-aside"),
])
def test_ordinary_places_pass(table, key, value):
    assert parse_text(GOOD + f'[{table}]\n{key} = "{value}"\n')[1] == []


def test_a_system_dir_reached_through_name_is_refused_per_member():
    # fine for member "a" (/var/a), not for member "lib"
    _, errors = parse_text(GOOD.replace('name = "b"', 'name = "lib"') + '[etcd]\ndata_dir = "/var/{name}"\n')
    assert errors == ["etcd.data_dir '/var/lib' is a system directory; give the agent a directory of its own "
                      "(e.g. /var/lib/etcd/default.etcd)"]


def test_data_backup_and_state_dirs_do_not_overlap():
    _, errors = parse_text(GOOD + '[backup]\ndir = "/var/lib/etcd"\n[daemon]\nstate_dir = "/var/lib/etcd/default.etcd/agent"\n')
    assert sorted(errors) == sorted([
        "etcd.data_dir '/var/lib/etcd/default.etcd' and backup.dir '/var/lib/etcd' overlap (one holds the other); "
        "give each a directory of its own",
        "etcd.data_dir '/var/lib/etcd/default.etcd' and daemon.state_dir '/var/lib/etcd/default.etcd/agent' overlap "
        "(one holds the other); give each a directory of its own",
        "backup.dir '/var/lib/etcd' and daemon.state_dir '/var/lib/etcd/default.etcd/agent' overlap (one holds the "
        "other); give each a directory of its own",
    ])
    # a common prefix is not an overlap
    assert parse_text(GOOD + '[backup]\ndir = "/var/lib/etcd.backup"\n[etcd]\ndata_dir = "/var/lib/etcd"\n')[1] == []


def test_encrypt_to_is_a_list_of_age_recipients():
    from etcd_agent.age import generate_identity

    r1, r2 = generate_identity()[1], generate_identity()[1]
    cfg, errors = parse_text(GOOD + f'[backup]\nencrypt_to = ["{r1}", "{r2}"]\n')
    assert errors == [] and cfg.backup.encrypt_to == (r1, r2)
    assert parse_text(GOOD)[0].backup.encrypt_to == ()
    secret = generate_identity()[0]
    for value, message in ((f'"{r1}"', f"backup.encrypt_to: expected a list of strings, got {r1!r}"),
                           (f'"{secret}"', "backup.encrypt_to: expected a list of strings, got <hidden>"),
                           (f'["{r1}", 3]', "backup.encrypt_to: expected a list of strings, got an array"),
                           ('["age1\\u0085x"]', "backup.encrypt_to: entry 0 contains a control character (U+0085); "
                                                "a value must be one line of printable text")):
        _, errors = parse_text(GOOD + f"[backup]\nencrypt_to = {value}\n")
        assert errors == [message], errors


def test_encrypt_to_every_problem_at_once_and_never_a_secret():
    from etcd_agent.age import generate_identity

    secret, good = generate_identity()
    typo = good[:-1] + ("q" if good[-1] != "q" else "p")
    many = ", ".join(f'"{generate_identity()[1]}"' for _ in range(21))
    _, errors = parse_text(GOOD + f'[backup]\ncompression = "zstd"\nencrypt_to = ["{good}", "{secret}", "{typo}"]\n')
    assert len(errors) == 3, errors
    assert errors[0].startswith("backup.encrypt_to[1] is an age SECRET key, not a recipient")
    assert errors[1].startswith("backup.encrypt_to[2] ") and "bad checksum" in errors[1]
    assert errors[2].startswith("backup.compression = 'zstd' cannot go with backup.encrypt_to")
    assert not any(secret in e or secret.lower() in e for e in errors)
    _, errors = parse_text(GOOD + f"[backup]\nencrypt_to = [{many}]\n")
    assert errors == ["backup.encrypt_to lists 21 recipients; at most 20 are supported"]


def test_every_compression_an_existing_config_names_still_loads():
    """An upgraded agent must keep taking the backups an existing config asks for: gzip included
    (written as before, spooled; zstd is what the README recommends)."""
    for comp in ("none", "zstd", "gzip"):
        _, errors = parse_text(GOOD + f'[backup]\ncompression = "{comp}"\n')
        assert errors == [], (comp, errors)
    _, errors = parse_text(GOOD + '[backup]\ncompression = "bzip2"\n')
    assert len(errors) == 1 and "backup.compression must be one of none, zstd, gzip" in errors[0], errors


def test_drill_section_defaults_and_every_mistake():
    cfg, errors = parse_text(GOOD)
    assert errors == [] and cfg.drill.every == 0 and cfg.drill.dir == "/var/lib/etcd-agent-drill"
    assert (cfg.drill.nice, cfg.drill.ionice, cfg.drill.gomaxprocs, cfg.drill.sample_keys) == (10, "idle", 1, 100)
    cfg, errors = parse_text(GOOD + '[drill]\nevery = 86400\nionice = "best-effort:7"\nmetrics_file = '
                             '"/var/lib/node_exporter/textfile_collector/etcd_agent_drill.prom"\n')
    assert errors == [] and cfg.drill.every == 86400.0
    _, errors = parse_text(GOOD + '[drill]\nevery = 30\nnice = 20\nionice = "realtime"\ngomaxprocs = -1\n'
                           'sample_keys = 1000000\ntimeout = 0\ndir = "/var/lib"\ncolour = 1\n')
    assert sorted(errors) == sorted([
        "drill: unknown key 'colour'",
        "drill.every must be 0 (no scheduled drills) or 60 to 604800 seconds, got 30",
        "drill.nice must be 0 to 19, got 20",
        "drill.ionice must be idle, none or best-effort:N (N 0-7), got 'realtime'",
        "drill.gomaxprocs must be 0 (all cores) to 1024, got -1",
        "drill.sample_keys must be 0 to 100000, got 1000000",
        "drill.timeout must be > 0 seconds",
        "drill.dir '/var/lib' is a system directory; give the agent a directory of its own "
        "(e.g. /var/lib/etcd-agent-drill)",
    ])
    # the drill removes what it leaves in its dir: never the backups or the data
    _, errors = parse_text(GOOD + '[drill]\ndir = "/var/lib/etcd_backup/drill"\n')
    assert errors == ["backup.dir '/var/lib/etcd_backup' and drill.dir '/var/lib/etcd_backup/drill' overlap "
                      "(one holds the other); give each a directory of its own"]


def test_ssh_stream_names_what_carries_the_snapshot_and_nothing_else():
    for stream in ("auto", "openssh", "paramiko"):
        cfg, errors = parse_text(GOOD + f'[ssh]\nstream = "{stream}"\n')
        assert errors == [] and cfg.ssh.stream == stream, (stream, errors)
    assert parse_text(GOOD)[0].ssh.stream == "auto"
    _, errors = parse_text(GOOD + '[ssh]\nstream = "scp"\n')
    assert len(errors) == 1 and "ssh.stream must be one of auto, openssh, paramiko" in errors[0], errors


@pytest.mark.parametrize("linked", ["backup.dir", "etcd.data_dir"])
def test_dirs_are_compared_after_resolving_links(tmp_path, linked):
    """A backup dir that is a link into the data dir would go aside with it at the next restore
    (and `restore cleanup` would delete it): refused however the paths are spelt, either way round."""
    outer, inner = tmp_path / "outer", tmp_path / "outer" / "inner"
    inner.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(inner)
    data, backup = (outer, link) if linked == "backup.dir" else (link, outer)
    _, errors = parse_text(GOOD + f'[etcd]\ndata_dir = "{data}"\n[backup]\ndir = "{backup}"\n')
    assert errors == [f"etcd.data_dir {str(data)!r} and backup.dir {str(backup)!r} overlap once links are resolved "
                      f"({linked} is {str(inner)!r}); give each a directory of its own"]
    # links that lead apart pass
    apart = tmp_path / "apart"
    apart.mkdir()
    other = tmp_path / "other_link"
    other.symlink_to(apart)
    assert parse_text(GOOD + f'[etcd]\ndata_dir = "{outer}"\n[backup]\ndir = "{other}"\n')[1] == []


def test_config_validate_names_a_backup_dir_linked_into_the_data_dir(tmp_path, capsys):
    from etcd_agent.cli.main import main

    data = tmp_path / "etcd" / "{name}"
    (tmp_path / "etcd" / "a" / "b").mkdir(parents=True)
    link = tmp_path / "etcd_backup"
    link.symlink_to(tmp_path / "etcd" / "a" / "b")
    conf = tmp_path / "agent.toml"
    conf.write_text(GOOD + f'[etcd]\ndata_dir = "{data}"\n[backup]\ndir = "{link}"\n')
    assert main(["config", "validate", str(conf)]) == 2
    err = capsys.readouterr().err
    assert f"etcd.data_dir {str(tmp_path / 'etcd' / 'a')!r} and backup.dir {str(link)!r} overlap once links" in err
    assert "Traceback" not in err


def test_config_validation_for_remote() -> None:
    text = """
[[member]]
name = "m1"
host = "127.0.0.1"
[backup.remote]
enabled = true
endpoint = "https://user:pw@oss.example.com/x"
access_key = "AKIAONLY"
addressing_style = "sideways"
verify = "hope"
part_size_mb = 1
keep_last = 0
"""
    _, errors = parse_text(text)
    joined = "\n".join(errors)
    for expected in (
        "backup.remote.endpoint", "backup.remote.bucket is required", "given together",
        "addressing_style", "backup.remote.verify", "part_size_mb", "backup.remote.keep_last",
    ):
        assert expected in joined, (expected, errors)
    assert "pw" not in joined and "AKIAONLY" not in joined
    _, errors = parse_text(text.replace("part_size_mb = 1", "part_size_mb = 1\nsecret_key = 7\nbogus = 1"))
    assert "backup.remote.secret_key: expected a string, got <hidden>" in errors
    assert "backup.remote: unknown key 'bogus'" in errors
