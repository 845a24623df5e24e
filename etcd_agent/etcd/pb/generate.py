"""Regenerate the ``*_pb2`` modules of this package from the vendored ``.proto`` files.

    python -m etcd_agent.etcd.pb.generate            # in place (commit the result)

Needs ``grpcio-tools`` (the test extra). The checked-in modules are generated with
grpcio-tools 1.80.1 (protoc 31.1, gencode 6.31.1): the oldest protobuf runtime the agent runs on
is 6.33 (Python 3.9, EL9), and protobuf refuses gencode newer than its runtime, while a 7.x runtime
loads 6.x gencode. Generate with the Python 3.9 venv's grpcio-tools (``.venv39``).
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from typing import Dict, List

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# protoc runs from the repository root, so the files are known to the descriptor pool as
# "etcd_agent/etcd/pb/rpc.proto" (not etcd3's "rpc.proto") and import each other as modules of
# this package
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(PACKAGE_DIR)))
PROTOS = ("kv.proto", "auth.proto", "rpc.proto")
OUTPUTS = tuple(f"{p[: -len('.proto')]}_pb2{ext}" for p in PROTOS for ext in (".py", ".pyi"))

# what differs between grpcio-tools releases for the same .proto: the version protoc stamps
_STAMPS = (
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^    \d+,\n    \d+,\n    \d+,\n    '[^']*',\n    '(?P<file>[^']*)'\n\)$", re.M),
)


def generate(out_dir: str) -> Dict[str, str]:
    """Run protoc on the vendored files into ``out_dir``; the generated texts by file name."""
    from grpc_tools import protoc  # type: ignore[import-untyped]  # no stubs; a test/dev dependency

    rel = os.path.relpath(PACKAGE_DIR, ROOT)
    # the stubs come from mypy-protobuf, not protoc's own --pyi_out: its output depends on its
    # pinned version only, where --pyi_out's changes with the protoc of each grpcio-tools release
    plugin = os.path.join(os.path.dirname(sys.executable), "protoc-gen-mypy")
    args: List[str] = ["protoc", f"-I{ROOT}", f"--plugin=protoc-gen-mypy={plugin}",
                       f"--python_out={out_dir}", f"--mypy_out={out_dir}"]
    args += [os.path.join(rel, p) for p in PROTOS]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed ({rc}): {' '.join(args)}")
    out = {}
    for name in OUTPUTS:
        with open(os.path.join(out_dir, rel, name)) as fh:
            out[name] = fh.read()
    return out


def unstamped(text: str) -> str:
    """``text`` without the generator's version stamps: what must not drift."""
    text = _STAMPS[0].sub("# Protobuf Python Version: (stamp)", text)
    return _STAMPS[1].sub(r"    (stamp),\n    '\g<file>'\n)", text)


def checked_in() -> Dict[str, str]:
    out = {}
    for name in OUTPUTS:
        with open(os.path.join(PACKAGE_DIR, name)) as fh:
            out[name] = fh.read()
    return out


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generate(tmp).items():
            with open(os.path.join(PACKAGE_DIR, name), "w") as fh:
                fh.write(text)
            print(os.path.join(os.path.relpath(PACKAGE_DIR, ROOT), name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
