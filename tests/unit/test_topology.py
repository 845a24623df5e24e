"""Pure topology: initial-cluster strings, the incremental walk, rendered files."""
from etcd_agent import topology
from etcd_agent.config import parse_text

# etcd's clustering docs name the members infra0..infra2
DOC = """
[cluster]
name = "docs"
token = "etcd-cluster-1"
bootstrap = "incremental"
[[member]]
name = "infra0"
host = "10.0.1.10"
[[member]]
name = "infra1"
host = "10.0.1.11"
[[member]]
name = "infra2"
host = "10.0.1.12"
"""


def cfg(text=DOC):
    c, errors = parse_text(text)
    assert errors == []
    return c


def test_static_bootstrap_lists_everyone_with_state_new():
    c = cfg(DOC.replace("incremental", "static"))
    b = topology.static_bootstrap(c, c.member("infra1"))
    assert b.state == "new"
    assert b.token == "etcd-cluster-1"
    assert b.initial_cluster == (
        "infra0=http://10.0.1.10:2380,infra1=http://10.0.1.11:2380,infra2=http://10.0.1.12:2380"
    )


def test_incremental_walk_is_the_documented_one():
    walk = topology.incremental_walk(cfg())
    assert [(b.member, b.state) for b in walk] == [("infra0", "new"), ("infra1", "existing"), ("infra2", "existing")]
    assert walk[0].initial_cluster == "infra0=http://10.0.1.10:2380"
    assert walk[1].initial_cluster == "infra0=http://10.0.1.10:2380,infra1=http://10.0.1.11:2380"
    assert walk[2].initial_cluster.count("=") == 3


def test_join_takes_the_live_member_list_and_replaces_an_unstarted_entry():
    c = cfg()
    me = c.member("infra2")
    # etcd lists an added-but-unstarted member with an empty name: it must not appear twice
    existing = [("infra0", "http://10.0.1.10:2380"), ("", "http://10.0.1.12:2380")]
    b = topology.join_bootstrap(c, me, existing)
    assert b.initial_cluster == "infra0=http://10.0.1.10:2380,infra2=http://10.0.1.12:2380"
    assert b.state == "existing"


def test_conf_renders_and_parses_back():
    c = cfg()
    m = c.member("infra1")
    text = topology.render_conf(c, m, topology.incremental_walk(c)[1])
    env = topology.parse_conf(text)
    assert env["ETCD_NAME"] == "infra1"
    assert env["ETCD_DATA_DIR"] == "/var/lib/etcd/default.etcd"
    assert env["ETCD_LISTEN_CLIENT_URLS"] == "http://10.0.1.11:2379,http://127.0.0.1:2379"
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] == "http://10.0.1.11:2379"
    assert env["ETCD_LISTEN_PEER_URLS"] == env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == "http://10.0.1.11:2380"
    assert env["ETCD_INITIAL_CLUSTER_STATE"] == "existing"
    assert not any(k.startswith(("ETCD_CERT", "ETCD_PEER")) for k in env)


def test_tls_vars(tmp_path):
    for f in ("ca", "crt", "key"):
        (tmp_path / f).write_text("x")
    c = cfg(DOC + f'[tls]\nclient_ca="{tmp_path}/ca"\nclient_cert="{tmp_path}/crt"\nclient_key="{tmp_path}/key"\n'
            f'peer_ca="{tmp_path}/ca"\npeer_cert="{tmp_path}/crt"\npeer_key="{tmp_path}/key"\n')
    m = c.member("infra0")
    env = topology.conf_vars(c, m, topology.static_bootstrap(c, m))
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] == "https://10.0.1.10:2379"
    assert env["ETCD_INITIAL_CLUSTER"].startswith("infra0=https://10.0.1.10:2380")
    assert env["ETCD_CLIENT_CERT_AUTH"] == "true" and env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    assert env["ETCD_TRUSTED_CA_FILE"] == f"{tmp_path}/ca"


def test_unit_text():
    c = cfg()
    unit = topology.render_unit(c, c.member("infra0"), "/usr/bin/etcd")
    for line in ("Type=notify", "User=etcd", "EnvironmentFile=/etc/etcd/etcd.conf", "ExecStart=/usr/bin/etcd",
                 "Restart=on-failure", "LimitNOFILE=65536", "WantedBy=multi-user.target"):
        assert line in unit.splitlines()


def test_parse_conf_handles_quotes_and_comments():
    assert topology.parse_conf('# x\nA="1 2"\nexport B=3\n\nC=\'x\'\nbad line\n') == {"A": "1 2", "B": "3", "C": "x"}
