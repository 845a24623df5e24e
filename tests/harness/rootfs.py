"""The cached Debian bookworm tree that every nspawn test host boots from.

Built once with debootstrap (50-110 s) into a temporary directory and renamed into place only when
complete, so a killed build never leaves a tree that looks finished. The tree carries a recipe
hash; it is rebuilt only when missing or when the recipe below changes.

The etcd releases the tests run on come as a second, small cached layer: ``/opt/etcd/<version>``
copied from this machine's ``/opt/etcd`` (laid out by ``packaging/install-deps.sh test``) into
``RELEASES_PREFIX-<key>``, where the key digests the versions and their binaries' sizes. Every
container mounts it above the base tree (overlayfs lowerdir=layer:base), so its root carries
/opt/etcd/<v> as ``[etcd] versions_dir`` expects. A cache without the layer, or with another
release list, gets a new layer (seconds: a copy, no debootstrap), and the base tree - shared with
other checkouts of this project on the machine - is never modified under them.

    python -m tests.harness.rootfs [--force]
"""
from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

BASE_DIR = "/var/lib/machines/etcd-agent-base"
SUITE = "bookworm"
# Everything the agent needs inside a host: systemd as PID 1, sshd, etcd, python3 for the venv,
# cron for the cron.d backup entry, tar for backups.
PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "iproute2", "etcd-server", "etcd-client",
    "openssh-server", "python3", "python3-venv", "ca-certificates", "cron", "tar",
    # `rpm -ivh --nodeps` of the product RPM inside a host, scriptlets against its own systemd
    "rpm",
)
# The agent's runtime dependencies, installed into a venv inside the tree; `wheel` lets
# `pip install --no-build-isolation` build the project's own source offline in the container.
DEPS_VENV = "/opt/etcd-agent-deps"
DEPS = (
    "cslab-etcd3==0.12.1", "psutil", "tenacity", "paramiko", "prometheus-client", "zstandard",
    "setuptools>=61", "wheel",
)
# Bump when the build steps change in a way the lists above do not show.
RECIPE_VERSION = 1
RECIPE_FILE = ".etcd-agent-recipe"
# The releases layer: <RELEASES_PREFIX>-<key>/opt/etcd/<version>/..., read-only once made.
RELEASES_PREFIX = "/var/lib/machines/etcd-agent-releases"
TREE_VERSIONS_DIR = "/opt/etcd"  # the product's default versions_dir, inside every container

# The chroot must not see the host's pip settings (find-links, certs, constraints).
CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}


@dataclass(frozen=True)
class BuildInfo:
    """What ensure_base() found or did."""

    path: str
    built: bool
    seconds: float
    size_bytes: int
    recipe: str


def recipe_hash() -> str:
    """A digest of everything that decides the tree's content."""
    doc = {
        "suite": SUITE, "packages": sorted(PACKAGES), "venv": DEPS_VENV, "deps": sorted(DEPS),
        "version": RECIPE_VERSION, "arch": platform.machine(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def read_recipe(path: str = BASE_DIR) -> Optional[Dict[str, object]]:
    """The recipe record of a finished tree, or None when there is none."""
    try:
        with open(os.path.join(path, RECIPE_FILE), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_current(path: str = BASE_DIR) -> bool:
    """True when the tree exists and was built from the current recipe."""
    rec = read_recipe(path)
    return rec is not None and rec.get("recipe") == recipe_hash()


def tree_size(path: str) -> int:
    """Bytes used by a tree, on its own filesystem only (`du -sxb`)."""
    out = subprocess.run(["du", "-sxb", path], capture_output=True, text=True, timeout=300)
    try:
        return int(out.stdout.split()[0])
    except (IndexError, ValueError):
        return 0


def mounts_under(path: str) -> List[str]:
    """Mount points at or below path, deepest first (so they can be unmounted in order)."""
    path = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            # mountinfo escapes blanks as octal; good enough for our own paths, which have none
            mnt = line.split()[4]
            if mnt == path or mnt.startswith(path + "/"):
                found.append(mnt)
    return sorted(set(found), key=len, reverse=True)


def remove_tree(path: str) -> None:
    """Delete a tree safely: unmount anything left inside first (a killed debootstrap leaves
    bind mounts of host device nodes), and never cross into another filesystem."""
    if not os.path.lexists(path):
        return
    for mnt in mounts_under(path):
        subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=60)
    if mounts_under(path):
        raise RuntimeError(f"refusing to delete {path}: still has mounts {mounts_under(path)}")
    subprocess.run(["rm", "-rf", "--one-file-system", path], check=True, timeout=600)


def _run(argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None) -> None:
    log.info("run: %s", " ".join(argv))
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"`{' '.join(argv)}` exited {proc.returncode}:\n{tail}")


def _chroot(root: str, argv: Sequence[str], timeout: float) -> None:
    _run(["chroot", root, *argv], timeout, env=CHROOT_ENV)


def _download_wheels(dest: str) -> None:
    """Fetch binary wheels for the tree's python (bookworm: CPython 3.11) with the host's pip."""
    arch = platform.machine()
    _run([
        sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", dest,
        "--implementation", "cp", "--python-version", "3.11", "--abi", "cp311",
        # bookworm has glibc 2.36; pip widens only manylinux2014 to older tags, so list the rest
        *[a for m in range(36, 16, -1) for a in ("--platform", f"manylinux_2_{m}_{arch}")],
        "--platform", f"manylinux2014_{arch}",
        *DEPS,
    ], timeout=900)


def _build(tmp: str) -> None:
    """All build steps, into tmp (which the caller renames into place)."""
    for tool in ("debootstrap", "chroot"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: apt-get install -y debootstrap systemd-container")
    _run(["debootstrap", "--variant=minbase", "--include=" + ",".join(PACKAGES), SUITE, tmp],
         timeout=1800)
    _chroot(tmp, ["apt-get", "clean"], 120)
    # the agent starts etcd, not the boot
    subprocess.run(["chroot", tmp, "systemctl", "disable", "etcd"], capture_output=True,
                   env=CHROOT_ENV, timeout=60)
    # a stale member dir overrides every --initial-cluster flag
    shutil.rmtree(os.path.join(tmp, "var/lib/etcd/default"), ignore_errors=True)
    # minbase has no /etc/hosts: etcd would resolve localhost through DNS
    with open(os.path.join(tmp, "etc/hosts"), "w", encoding="utf-8") as f:
        f.write("127.0.0.1 localhost\n::1 localhost\n")
    # hosts never query a resolver
    resolv = os.path.join(tmp, "etc/resolv.conf")
    if os.path.islink(resolv):
        os.unlink(resolv)
    open(resolv, "w").close()
    # each clone makes its own host keys (ssh-keygen -A); none may be shared between hosts
    for key in glob.glob(os.path.join(tmp, "etc/ssh/ssh_host_*")):
        os.unlink(key)
    os.makedirs(os.path.join(tmp, "root/.ssh"), mode=0o700, exist_ok=True)
    os.chmod(os.path.join(tmp, "root/.ssh"), 0o700)
    open(os.path.join(tmp, "etc/machine-id"), "w").close()

    # the deps venv, installed offline from wheels the host downloads
    wheels_rel = "tmp/etcd-agent-wheels"
    wheels = os.path.join(tmp, wheels_rel)
    os.makedirs(wheels)
    _download_wheels(wheels)
    _chroot(tmp, ["python3", "-m", "venv", DEPS_VENV], 300)
    _chroot(tmp, [DEPS_VENV + "/bin/pip", "install", "-q", "--no-index", "--find-links",
                  "/" + wheels_rel, *DEPS], 900)
    shutil.rmtree(wheels)
    # prove the venv imports what the agent needs before calling the tree complete
    _chroot(tmp, [DEPS_VENV + "/bin/python", "-c",
                  "import etcd3, psutil, tenacity, paramiko, prometheus_client, zstandard"], 120)


def releases_key(versions: Sequence[str], source_dir: str) -> str:
    """What decides the releases layer: each version and its files (sizes; a link counts as its
    target). Fails the test, naming the fix, when a release is not installed here."""
    from .releases import release

    parts = []
    for v in versions:
        release(v, source_dir)
        d = os.path.join(source_dir, v)
        files = []
        for name in sorted(os.listdir(d)):
            p = os.path.join(d, name)
            files.append(f"{name}->{os.readlink(p)}" if os.path.islink(p) else f"{name}:{os.path.getsize(p)}")
        parts.append(f"{v}[{','.join(files)}]")
    return ";".join(parts)


# Beds of other sessions hold the base tree shared for a whole tier (~10 min): wait that out, not more.
LAYER_LOCK_TIMEOUT = 1800.0


def _lock_exclusive(f: "IO[str]", what: str, timeout: float) -> None:
    """flock(LOCK_EX) within ``timeout`` seconds, saying once that it waits."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: still held (shared by a running bed?) after {timeout:.0f} s") from None
            if not said:
                log.warning("waiting for %s (a bed of another session holds it)", what)
                said = True
            time.sleep(0.5)


@dataclass(frozen=True)
class ReleasesLayer:
    """The cached /opt/etcd layer the containers mount above the base tree."""

    path: str
    versions: Tuple[str, ...]
    built: bool
    seconds: float


def _check_in_tree(base: str, layer: str, versions: Sequence[str]) -> None:
    """Every binary of the layer reports its version when run in the base tree (chroot into a
    temporary overlay of both, so 3.4's links resolve to the tree's own /usr/bin/etcd)."""
    from .releases import parse_reported, version_argv

    work = tempfile.mkdtemp(prefix=".releases-check-", dir=os.path.dirname(layer))
    root, upper, wd = (os.path.join(work, d) for d in ("root", "upper", "work"))
    for d in (root, upper, wd):
        os.makedirs(d)
    opts = f"lowerdir={layer}:{base},upperdir={upper},workdir={wd}"
    _run(["mount", "-t", "overlay", "overlay", "-o", opts, root], timeout=30)
    try:
        for v in versions:
            for name in sorted(os.listdir(os.path.join(layer, TREE_VERSIONS_DIR.lstrip("/"), v))):
                inner = f"{TREE_VERSIONS_DIR}/{v}/{name}"
                res = subprocess.run(["chroot", root, *version_argv(inner)], capture_output=True, text=True,
                                     timeout=60, env={**CHROOT_ENV, "ETCDCTL_API": "3"})
                got = parse_reported(res.stdout)
                if got != v:
                    raise RuntimeError(f"{inner} reports {got or 'nothing'} in the base tree, not {v}: {res.stderr.strip()[:200]}")
    finally:
        subprocess.run(["umount", root], capture_output=True, timeout=60)
        remove_tree(work)


def ensure_releases_layer(versions: Optional[Sequence[str]] = None, source_dir: Optional[str] = None,
                          base: str = BASE_DIR, prefix: str = RELEASES_PREFIX) -> ReleasesLayer:
    """The releases layer for ``versions`` (default: every release of packaging/etcd-test-releases),
    made from ``source_dir`` (default /opt/etcd) when missing. Made under the base tree's exclusive
    lock (so never while a bed is up: beds hold it shared), in a temporary dir renamed into place
    once every binary was seen to report its version inside the tree; layers of other keys are
    removed then (no bed can be using them)."""
    from . import releases as rel

    vs = tuple(versions if versions is not None else rel.ALL)
    src = source_dir or rel.VERSIONS_DIR
    key = hashlib.sha256(releases_key(vs, src).encode()).hexdigest()[:12]
    path = f"{prefix}-{key}"
    if os.path.isfile(os.path.join(path, RECIPE_FILE)):
        return ReleasesLayer(path, vs, False, 0.0)
    parent, name = os.path.dirname(path), os.path.basename(path)
    os.makedirs(parent, exist_ok=True)
    with open(lock_path(base), "a") as lockf:
        _lock_exclusive(lockf, lock_path(base), LAYER_LOCK_TIMEOUT)
        if os.path.isfile(os.path.join(path, RECIPE_FILE)):
            return ReleasesLayer(path, vs, False, 0.0)
        t0 = time.monotonic()
        for stale in glob.glob(f"{prefix}-*") + glob.glob(os.path.join(parent, f".{os.path.basename(prefix)}-*")):
            if stale != path:
                log.info("removing releases layer %s (another release list)", stale)
                remove_tree(stale)
        if os.path.lexists(path):
            remove_tree(path)  # no record: an interrupted layer
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        try:
            dest = os.path.join(tmp, TREE_VERSIONS_DIR.lstrip("/"))
            os.makedirs(dest)
            for v in vs:
                shutil.copytree(os.path.join(src, v), os.path.join(dest, v), symlinks=True)
            _check_in_tree(base, tmp, vs)
            with open(os.path.join(tmp, RECIPE_FILE), "w", encoding="utf-8") as f:
                json.dump({"releases": releases_key(vs, src), "versions": list(vs),
                           "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f)
            os.chmod(tmp, 0o755)
            os.rename(tmp, path)
        except BaseException:
            remove_tree(tmp)
            raise
        return ReleasesLayer(path, vs, True, time.monotonic() - t0)


def lock_path(path: str = BASE_DIR) -> str:
    """The lock file of a tree: builders hold it exclusively, running beds shared."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")


def ensure_base(force: bool = False, path: str = BASE_DIR) -> BuildInfo:
    """Return the base tree, building it first when missing, outdated or forced."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    name = os.path.basename(path)
    # one builder at a time, and never while a bed has overlays on the tree (they hold it
    # shared); a second caller waits and then finds the tree current
    with open(lock_path(path), "a") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        want = recipe_hash()
        if not force and is_current(path):
            rec = read_recipe(path) or {}
            size = rec.get("size_bytes")
            return BuildInfo(path, False, 0.0, size if isinstance(size, int) else 0, want)
        # leftovers of builds that were killed
        for stale in glob.glob(os.path.join(parent, f".{name}.tmp-*")) + \
                glob.glob(os.path.join(parent, f".{name}.old-*")):
            log.info("removing stale %s", stale)
            remove_tree(stale)
        t0 = time.monotonic()
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        try:
            _build(tmp)
            os.chmod(tmp, 0o755)
            seconds = time.monotonic() - t0
            size = tree_size(tmp)
            with open(os.path.join(tmp, RECIPE_FILE), "w", encoding="utf-8") as f:
                json.dump({"recipe": want, "seconds": round(seconds, 1), "size_bytes": size,
                           "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f)
            old = None
            if os.path.lexists(path):
                old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
                os.rename(path, os.path.join(old, "tree"))
            os.rename(tmp, path)
            if old is not None:
                remove_tree(old)
        except BaseException:
            remove_tree(tmp)
            raise
        return BuildInfo(path, True, seconds, size, want)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.rootfs",
                                     description="Build the cached nspawn base tree if needed.")
    parser.add_argument("--force", action="store_true", help="rebuild even when current")
    parser.add_argument("--path", default=BASE_DIR)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    if os.geteuid() != 0:
        print("rootfs: needs root (debootstrap, chroot)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    info = ensure_base(force=args.force, path=args.path)
    what = "built" if info.built else "current, reused"
    print(f"rootfs: {info.path} {what} (recipe {info.recipe}) in {time.monotonic() - t0:.1f} s, "
          f"{info.size_bytes / 1e6:.0f} MB")
    layer = ensure_releases_layer(base=args.path)
    print(f"rootfs: etcd releases {', '.join(layer.versions)} in {layer.path} "
          f"({'made in %.1f s' % layer.seconds if layer.built else 'cached'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
