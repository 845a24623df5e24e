#!/usr/bin/env python3
"""Copy etcd's .proto files into etcd_agent/etcd/pb/, with the edits the agent needs.

    packaging/vendor-etcd-protos.py GIT_DIR REF      e.g. /work/.mirror/etcd-io+etcd/repo v3.5.16

Reads api/etcdserverpb/rpc.proto, api/mvccpb/kv.proto and api/authpb/auth.proto at REF from a
git dir of etcd-io/etcd (a bare clone is enough) and applies, to each file, exactly the edits
listed in etcd_agent/etcd/pb/README.md. Every edit must match the text it expects: a release
whose files differ there stops the script instead of being vendored half-edited. Then run
`python -m etcd_agent.etcd.pb.generate` and commit the .proto and the generated modules together.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Callable, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "etcd_agent", "etcd", "pb")

# (path in etcd, file written here, the package it gets)
FILES = [
    ("api/mvccpb/kv.proto", "kv.proto", "mvccpb"),
    ("api/authpb/auth.proto", "auth.proto", "authpb"),
    ("api/etcdserverpb/rpc.proto", "rpc.proto", "etcdserverpb"),
]
IMPORTS = {
    'import "etcd/api/mvccpb/kv.proto";': 'import "etcd_agent/etcd/pb/kv.proto";',
    'import "etcd/api/authpb/auth.proto";': 'import "etcd_agent/etcd/pb/auth.proto";',
}


def _sub(pattern: str, repl: str, text: str, *, flags: int = 0, at_least: int = 1) -> str:
    out, n = re.subn(pattern, repl, text, flags=flags)
    if n < at_least:
        raise SystemExit(f"vendor-etcd-protos: expected {pattern!r} at least {at_least} time(s), found {n}")
    return out


def edit(text: str, package: str) -> str:
    # 1. the proto package is renamed: etcd3's stale stubs register etcdserverpb/mvccpb/authpb in
    #    protobuf's one global descriptor pool, and a second definition of the same names fails
    #    at import. The wire format carries field numbers only, so the rename changes no byte sent.
    text = _sub(rf"^package {package};$", f"package etcdagent.{package};", text, flags=re.M)
    # 2. gogoproto (Go code generation options) is dropped: its import and its file options
    text = _sub(r'^import "gogoproto/gogo\.proto";\n', "", text, flags=re.M)
    text = _sub(r"^option \(gogoproto\.\w+\) = \w+;\n", "", text, flags=re.M)
    if "gogoproto" in text:
        raise SystemExit("vendor-etcd-protos: a gogoproto option is left (a field option?): edit the script")
    if package == "etcdserverpb":
        # 3. the grpc-gateway HTTP annotations are dropped: their import and every option block
        text = _sub(r'^// for grpc-gateway\nimport "google/api/annotations\.proto";\n', "", text, flags=re.M)
        # (one level of nested braces: additional_bindings); the rpc keeps an empty body
        text = _sub(r"^ *option \(google\.api\.http\) = \{(?:[^{}]|\{[^{}]*\})*\};\n", "", text, flags=re.M,
                    at_least=30)
        if "google.api" in text:
            raise SystemExit("vendor-etcd-protos: a google.api reference is left: edit the script")
        # 4. the imports of kv.proto and auth.proto name their place here
        for old, new in IMPORTS.items():
            if old not in text:
                raise SystemExit(f"vendor-etcd-protos: {old} not found")
            text = text.replace(old, new)
    return text


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    git_dir, ref = argv
    commit = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", f"{ref}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    show: Callable[[str], str] = lambda path: subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], check=True, capture_output=True, text=True
    ).stdout
    done: List[Tuple[str, str]] = []
    for src, dst, package in FILES:
        text = f"// Vendored from etcd-io/etcd {ref} ({commit}) {src}; edited: see README.md.\n" + edit(
            show(src), package
        )
        with open(os.path.join(OUT, dst), "w") as fh:
            fh.write(text)
        done.append((src, dst))
    with open(os.path.join(OUT, "LICENSE"), "w") as fh:
        fh.write(show("LICENSE"))
    for src, dst in done:
        print(f"{src} -> etcd_agent/etcd/pb/{dst}")
    print(f"from {ref} = {commit}; now: python -m etcd_agent.etcd.pb.generate")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
