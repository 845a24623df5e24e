"""The demo's generated config keeps everything the agent writes under the demo's dir.

A path of the config left at its default is a master's machine-wide place: two demos in two dirs
would share it (issue 24: a restore in one demo's clone made every later demo report conf-drift).
``configured_paths`` lists every path of the config, so a path section added later without the
demo setting it fails here."""
from etcd_agent.cluster.demo import demo_config_text
from etcd_agent.config import load
from etcd_agent.config.paths import READ, configured_paths


def test_every_path_the_agent_writes_is_under_the_demo_dir(tmp_path) -> None:
    d = str(tmp_path / "demo")
    cfg = load(f"{d}/agent.toml", text=demo_config_text(d, 3, "/usr/bin/etcd", "/usr/bin/etcdctl"))  # validated
    written = [(k, v) for k, v, kind in configured_paths(cfg) if kind != READ]
    assert written, "configured_paths lists nothing the agent writes?"
    outside = [(k, v) for k, v in written if v is None or not v.startswith(d + "/")]
    assert outside == [], f"the demo leaves these to machine-wide defaults (or unset): {outside}"


def test_continuous_backup_on_with_short_segments_and_etcdutl_when_given(tmp_path) -> None:
    d = str(tmp_path / "demo")
    cfg = load(f"{d}/agent.toml", text=demo_config_text(d, 3, "/opt/etcd/3.5.16/etcd", "/opt/etcd/3.5.16/etcdctl",
                                                        "/opt/etcd/3.5.16/etcdutl"))
    assert cfg.backup.delta.enabled and cfg.backup.delta.close_seconds <= 2  # a rehearsal waits seconds, not 5+
    assert cfg.etcd.etcdutl == "/opt/etcd/3.5.16/etcdutl"  # what a point-in-time restore replays with
    bare = load(f"{d}/agent.toml", text=demo_config_text(d, 3, "/usr/bin/etcd", "/usr/bin/etcdctl"))
    assert bare.etcd.etcdutl is None  # etcd 3.4: none to name, and none invented
