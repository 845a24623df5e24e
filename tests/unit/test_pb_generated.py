"""The generated etcd messages (etcd_agent/etcd/pb): what is checked in is what the vendored
.proto files make, and they live beside etcd3's stale stubs in one process."""
import subprocess
import sys

from etcd_agent.etcd.pb import generate


def test_checked_in_modules_match_the_vendored_protos(tmp_path):
    fresh = generate.generate(str(tmp_path))
    checked = generate.checked_in()
    assert sorted(fresh) == sorted(checked) == sorted(generate.OUTPUTS)
    for name in generate.OUTPUTS:
        assert generate.unstamped(fresh[name]) == generate.unstamped(checked[name]), (
            f"etcd_agent/etcd/pb/{name} differs from what its .proto makes: "
            "run `.venv39/bin/python -m etcd_agent.etcd.pb.generate` and commit the result"
        )


def test_only_the_version_stamp_is_set_aside():
    text = generate.checked_in()["kv_pb2.py"]
    assert "# Protobuf Python Version: 6.31.1" in text  # the gencode every runtime here loads
    assert generate.unstamped(text) != text
    assert generate.unstamped(text.replace("KeyValue", "KeyValve")) != generate.unstamped(text)


def test_imports_beside_etcd3_in_one_process():
    # a fresh interpreter: the descriptor pool is per process, and both orders must work
    for first, second in (("etcd3", "etcd_agent.etcd.pb.rpc_pb2"), ("etcd_agent.etcd.pb.rpc_pb2", "etcd3")):
        code = (
            f"import importlib; importlib.import_module({first!r}); importlib.import_module({second!r})\n"
            "from etcd3.etcdrpc import rpc_pb2 as old\n"
            "from etcd_agent.etcd.pb import rpc_pb2 as new\n"
            "assert old.DESCRIPTOR.package == 'etcdserverpb'\n"
            "assert new.DESCRIPTOR.package == 'etcdagent.etcdserverpb'\n"
            "m = new.Member(ID=1, name='a', isLearner=True)\n"
            "assert old.Member.FromString(m.SerializeToString()).name == 'a'\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
