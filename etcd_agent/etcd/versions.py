"""Pure etcd version skew rules for rolling upgrades. No I/O.

etcd supports upgrading one minor version at a time, member by member, within a major version;
it never supports a downgrade through a plain binary swap. Some minor steps need a minimum patch
release first (3.5 -> 3.6 only from 3.5.26: earlier 3.5 patches can fail to rejoin a mixed
3.5/3.6 cluster). A longer jump is refused with the path of single steps that would get there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

_VERSION_RE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+]([0-9A-Za-z.+-]+))?$")

# (major, minor) -> the lowest patch of that minor that may step to the next minor
MIN_PATCH_BEFORE_NEXT_MINOR: Dict[Tuple[int, int], int] = {(3, 5): 26}


@dataclass(frozen=True, order=True)
class Version:
    major: int
    minor: int
    patch: int = 0
    pre: str = ""  # e.g. "rc.1": ignored for ordering decisions, kept for printing

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}" + (f"-{self.pre}" if self.pre else "")

    @property
    def minor_line(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def key(self) -> Tuple[int, int, int]:
        return (self.major, self.minor, self.patch)


def parse(text: str) -> Version:
    """``3.5.1`` / ``v3.5.1`` / ``3.5`` / ``3.6.0-rc.1`` -> Version; ValueError otherwise."""
    m = _VERSION_RE.match(text.strip())
    if not m:
        raise ValueError(f"not an etcd version: {text!r}")
    return Version(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), m.group(4) or "")


@dataclass(frozen=True)
class StepCheck:
    """Whether ``current -> target`` is one allowed step; ``path`` shows the way when it is not."""

    ok: bool
    reason: str
    path: Tuple[str, ...] = ()

    def path_text(self) -> str:
        return " -> ".join(self.path)


def _min_patch(major: int, minor: int) -> int:
    return MIN_PATCH_BEFORE_NEXT_MINOR.get((major, minor), 0)


def check_step(current: Version, target: Version) -> StepCheck:
    """Is ``current -> target`` one supported upgrade step (for every member of a cluster)?"""
    if current.major != target.major:
        return StepCheck(False, f"{current} -> {target} changes the major version; etcd does not support that")
    if target.key < current.key:
        return StepCheck(False, f"{current} -> {target} is a downgrade; etcd upgrades only go forward "
                                "(restore a backup taken on the old version instead)")
    if target.key == current.key:
        return StepCheck(True, f"already on {target}", (str(current),))
    if target.minor == current.minor:
        return StepCheck(True, f"patch upgrade {current} -> {target}", (str(current), str(target)))
    path = tuple(upgrade_path(current, target))
    if target.minor > current.minor + 1:
        return StepCheck(False, f"{current} -> {target} skips a minor version; upgrade one minor at a time", path)
    need = _min_patch(current.major, current.minor)
    if current.patch < need:
        return StepCheck(
            False,
            f"{current} -> {target} needs {current.minor_line}.{need} or later first",
            path,
        )
    return StepCheck(True, f"minor upgrade {current} -> {target}", (str(current), str(target)))


def upgrade_path(current: Version, target: Version) -> List[str]:
    """The single steps from ``current`` to ``target`` (same major, forward), as printable hops.

    Intermediate hops are the minimum patch a following step needs (``3.5.26``), or the minor
    line (``3.4.x``: any patch, the latest is best) when there is no minimum.
    """
    if current.major != target.major or target.key < current.key:
        return []
    hops = [str(current)]
    major, minor, patch = current.major, current.minor, current.patch
    while minor < target.minor:
        need = _min_patch(major, minor)
        if patch < need:
            patch = need
            hops.append(f"{major}.{minor}.{need}")
        minor += 1
        if minor == target.minor:
            break
        need_next = _min_patch(major, minor)
        patch = need_next
        hops.append(f"{major}.{minor}.{need_next}" if need_next else f"{major}.{minor}.x")
    if hops[-1] != str(target):
        hops.append(str(target))
    return hops


@dataclass(frozen=True)
class ClusterCheck:
    """The verdict for a whole cluster: the step it takes and which members still need it."""

    ok: bool
    reason: str
    path: Tuple[str, ...]
    to_upgrade: Tuple[str, ...]

    def path_text(self) -> str:
        return " -> ".join(self.path)


def check_cluster(member_versions: Sequence[Tuple[str, str]], target: str) -> ClusterCheck:
    """``(member, version)`` pairs and a target -> may the cluster roll to ``target`` now?

    A cluster half-way through an earlier run of the same upgrade (some members on ``target``,
    the rest on one older version) may resume; any other mix is refused.
    """
    t = parse(target)
    parsed = [(name, parse(v)) for name, v in member_versions]
    if not parsed:
        return ClusterCheck(False, "no member versions known", (), ())
    older = sorted({v.key for _n, v in parsed if v.key != t.key})
    if len(older) > 1:
        shown = ", ".join(f"{n}={v}" for n, v in parsed)
        return ClusterCheck(False, f"members run different older versions ({shown}); "
                                   "bring them to one version first", (), ())
    todo = tuple(n for n, v in parsed if v.key != t.key)
    if not todo:
        return ClusterCheck(True, f"every member already runs {t}", (str(t),), ())
    current = next(v for _n, v in parsed if v.key == older[0])
    step = check_step(current, t)
    return ClusterCheck(step.ok, step.reason, step.path, todo if step.ok else ())


@dataclass(frozen=True)
class HopPlan:
    """The releases one run passes through, in order (``hops[-1]`` is the target)."""

    ok: bool
    reason: str
    hops: Tuple[str, ...]

    def path_text(self, current: str) -> str:
        return " -> ".join((current,) + self.hops)


def plan_hops(current: str, target: str, via: Sequence[str] = ()) -> HopPlan:
    """The single steps from ``current`` to ``target`` through the operator's ``via`` releases
    (each a concrete version, ascending), adding the hops the skew rules require where they
    name a concrete release (``3.5.26``); a required hop that names only a minor line (``3.5.x``)
    must be chosen by the operator (``--via``), since only they know which release they trust."""
    cur = parse(current)
    stops = [parse(v) for v in via] + [parse(target)]
    if stops[-1].key < cur.key:
        return HopPlan(False, check_step(cur, stops[-1]).reason, ())
    if stops[-1].key == cur.key and len(stops) == 1:
        return HopPlan(True, f"already on {cur}: no hops", ())
    for a, b in zip([cur] + stops, stops):
        if b.key <= a.key:
            return HopPlan(False, f"--via releases must ascend from {cur} to {stops[-1]}: {a} -> {b} does not", ())
    hops: List[str] = []
    at = cur
    for stop in stops:
        step = check_step(at, stop)
        if step.ok:
            hops.append(str(stop))
            at = stop
            continue
        path = upgrade_path(at, stop)
        if not path:
            return HopPlan(False, step.reason, ())
        for hop in path[1:]:
            if hop.endswith(".x"):
                return HopPlan(False, f"{step.reason}; the path {' -> '.join(path)} passes through a {hop} release: "
                                      f"choose it with --via {hop[:-2]}.N (a release installed on every master)", ())
            nxt = parse(hop)
            inner = check_step(at, nxt)
            if not inner.ok:
                return HopPlan(False, inner.reason, ())
            hops.append(str(nxt))
            at = nxt
    return HopPlan(True, f"{len(hops)} hop{'s' if len(hops) != 1 else ''}: {' -> '.join([str(cur)] + hops)}", tuple(hops))


def parse_version(text: Optional[str]) -> Optional[Tuple[int, int, int]]:
    """``"3.4.23"`` -> (3, 4, 23); None when unreadable."""
    if not text:
        return None
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


# etcdutl gained --bump-revision/--mark-compacted in 3.5.10 (etcd PR 16165); 3.5.0-3.5.9 reject
# them as unknown flags, so a plain "3.5+" check would fail every restore on those releases.
BUMP_MIN_ETCDUTL = (3, 5, 10)


def can_bump(facts_or_version: Optional[str]) -> bool:
    """``--bump-revision``/``--mark-compacted`` need etcdutl 3.5.10+ (etcdctl 3.4 has neither)."""
    v = parse_version(facts_or_version)
    return v is not None and v >= BUMP_MIN_ETCDUTL
