"""The rooms' layering is written twice - for readers in docs/architecture.md, for import-linter in
pyproject.toml (which `make test` runs) - and the two must say the same thing."""
from __future__ import annotations

import os
import re
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.9/3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _doc_layers() -> list:
    text = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()
    m = re.search(r"```layers\n(.*?)```", text, re.S)
    assert m, "docs/architecture.md has no ```layers block"
    return [line.strip() for line in m.group(1).splitlines() if line.strip()]


def _contract_layers() -> list:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in cfg["contracts"] if c["type"] == "layers"]
    return [" | ".join(p.strip().removeprefix("etcd_agent.") for p in layer.split("|")) for layer in layers]


def test_the_documented_layers_are_the_contract() -> None:
    assert _doc_layers() == _contract_layers()


def test_every_room_of_the_package_has_a_layer() -> None:
    named = {room for layer in _contract_layers() for room in (p.strip() for p in layer.split("|"))}
    pkg = os.path.join(ROOT, "etcd_agent")
    rooms = set()
    for name in os.listdir(pkg):
        path = os.path.join(pkg, name)
        if name.startswith(("_", ".")):
            continue
        if os.path.isdir(path) and name != "restore":
            rooms.add(name)
        elif name.endswith(".py"):
            rooms.add(name[:-3])
    rooms |= {"restore." + n for n in os.listdir(os.path.join(pkg, "restore"))
              if os.path.isdir(os.path.join(pkg, "restore", n)) and not n.startswith("_")}
    assert rooms - named == set(), "rooms without a layer (add them to both lists)"
