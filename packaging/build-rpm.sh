#!/usr/bin/env bash
# packaging/build-rpm.sh - build dist/etcd-agent-VERSION-RELEASE.ARCH.rpm from this checkout.
#
#   packaging/build-rpm.sh [--release N] [--python PATH] [--target-python PATH] [--dist DIR]
#   (env: RPM_RELEASE, PYTHON, TARGET_PYTHON, DIST_DIR; `make rpm` runs it)
#
# 1. Downloads the wheels of packaging/requirements.lock for PYTHON's version into a cache under
#    build/wheels/ (the only network step; a warm cache needs none) and builds the project wheel.
# 2. rpmbuild -bb rpm.spec: %install creates /opt/etcd-agent offline from those wheels only.
# The venv runs on TARGET_PYTHON (default /usr/bin/python3; PYTHON itself when it is a distro
# python under /usr/bin, e.g. EL8's /usr/bin/python3.9), which must be PYTHON's minor version:
# build on a builder of the target release (EL9 -> 3.9). Prints the build time and RPM size.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RELEASE=${RPM_RELEASE:-1}
PYTHON=${PYTHON:-/usr/bin/python3}
TARGET_PYTHON=${TARGET_PYTHON:-}
DIST_DIR=${DIST_DIR:-$REPO/dist}

die() { echo "build-rpm: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --release) RELEASE=${2:?}; shift 2 ;;
    --python) PYTHON=${2:?}; shift 2 ;;
    --target-python) TARGET_PYTHON=${2:?}; shift 2 ;;
    --dist) DIST_DIR=${2:?}; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
[[ "$RELEASE" =~ ^[0-9][0-9A-Za-z._]*$ ]] || die "bad release: $RELEASE"

start=$(date +%s.%N)
command -v rpmbuild >/dev/null || die "rpmbuild not found (EL: dnf install rpm-build; Debian: apt-get install rpm)"
[ -x "$PYTHON" ] || PYTHON=$(command -v "$PYTHON" || true)
[ -n "$PYTHON" ] && [ -x "$PYTHON" ] || die "no python interpreter: set PYTHON"
PYVER=$("$PYTHON" -c 'import sys; print(*sys.version_info[:2], sep=".")')
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 9))' || die "$PYTHON is $PYVER; etcd-agent needs >= 3.9"
if [ -z "$TARGET_PYTHON" ]; then
  case "$PYTHON" in /usr/bin/*) TARGET_PYTHON=$PYTHON ;; *) TARGET_PYTHON=/usr/bin/python3 ;; esac
fi
VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$REPO/etcd_agent/__init__.py")
[ -n "$VERSION" ] || die "no __version__ in etcd_agent/__init__.py"
ARCH=$(uname -m)
LOCK="$REPO/packaging/requirements.lock"
# a lock with per-version pins but none for this version would leave those packages unpinned
if grep -q 'python_version' "$LOCK" && ! grep -q "python_version == \"$PYVER\"" "$LOCK"; then
  die "packaging/requirements.lock has no pins for Python $PYVER: run packaging/lock-deps.py $PYTHON"
fi

BUILD="$REPO/build"
mkdir -p "$BUILD" "$DIST_DIR"
# one build at a time per checkout (make rpm and the test suite share build/)
exec 9>"$BUILD/.rpm-build.lock"
flock 9

TOOLS="$BUILD/venv-py$PYVER"          # pip + setuptools of PYTHON's version, for this script only
CACHE="$BUILD/wheels/cp${PYVER/./}-$ARCH"   # every wheel ever downloaded for this target
TOP="$BUILD/rpm"
STAGE="$TOP/stage"
rm -rf "$TOP"
mkdir -p "$CACHE" "$TOP/SOURCES" "$STAGE/wheels"

if [ ! -x "$TOOLS/bin/python" ]; then
  "$PYTHON" -m venv "$TOOLS"
fi
PIP=("$TOOLS/bin/python" -m pip --disable-pip-version-check)
# setuptools < 70.1 builds wheels only with the `wheel` package
if ! "$TOOLS/bin/python" -c 'import setuptools, wheel, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 61)' 2>/dev/null; then
  "${PIP[@]}" install -q "setuptools>=61" wheel
fi

# Wheels for glibc <= 2.28 (EL8 and later); pip widens only manylinux2014 by itself.
PLATFORMS=()
for m in $(seq 28 -1 17); do PLATFORMS+=(--platform "manylinux_2_${m}_${ARCH}"); done
PLATFORMS+=(--platform "manylinux2014_${ARCH}")
TARGET_ARGS=(--only-binary=:all: --no-deps --implementation cp --python-version "$PYVER"
             --abi "cp${PYVER/./}" "${PLATFORMS[@]}")
# Fill the staging dir from the cache alone; download into the cache only when that fails.
if ! "${PIP[@]}" download -q --no-index --find-links "$CACHE" -d "$STAGE/wheels" \
      "${TARGET_ARGS[@]}" -r "$LOCK" 2>/dev/null; then
  echo "build-rpm: downloading the locked wheels for Python $PYVER/$ARCH into ${CACHE#$REPO/}" >&2
  "${PIP[@]}" download -q -d "$CACHE" "${TARGET_ARGS[@]}" -r "$LOCK"
  "${PIP[@]}" download -q --no-index --find-links "$CACHE" -d "$STAGE/wheels" \
    "${TARGET_ARGS[@]}" -r "$LOCK"
fi

# Source0: the checkout's files (tracked and new, never ignored ones such as build/ or .venv/).
SRCNAME="etcd-agent-$VERSION"
SRC="$STAGE/$SRCNAME"
mkdir -p "$SRC"
if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
     | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
     | tar --null -T - -cf -) | tar -xf - -C "$SRC"
else
  tar -C "$REPO" --exclude=./build --exclude=./dist --exclude=./.venv --exclude=./.venv39 \
      --exclude=__pycache__ --exclude='*.egg-info' -cf - . | tar -xf - -C "$SRC"
fi
# the project's own wheel, built offline from the clean copy (not the working tree)
"${PIP[@]}" wheel -q --no-deps --no-build-isolation --no-index -w "$STAGE/wheels" "$SRC" >/dev/null
rm -rf "$SRC/build" "$SRC"/*.egg-info
tar -C "$STAGE" --owner=0 --group=0 -czf "$TOP/SOURCES/$SRCNAME.tar.gz" "$SRCNAME"
tar -C "$STAGE" --owner=0 --group=0 -cf "$TOP/SOURCES/etcd-agent-wheels-$VERSION-py$PYVER.tar" wheels

# Debian's rpm has no systemd macros: load the test bed's shim, or our own equivalent.
LOAD=()
if [ -z "$(rpm --eval '%{?_unitdir}')" ]; then
  shim="$REPO/../shared/testbed/macros.debian-host"
  [ -r "$shim" ] || shim="$REPO/packaging/macros.systemd-fallback"
  LOAD=(--load "$shim")
  echo "build-rpm: no systemd-rpm-macros here; loading ${shim#$REPO/}" >&2
fi
# BuildRequires are checked against the rpm database: a dpkg host has none
NODEPS=()
rpm -q --whatprovides /bin/sh >/dev/null 2>&1 || NODEPS=(--nodeps)

rpmbuild -bb --quiet "${LOAD[@]}" "${NODEPS[@]}" \
  --define "_topdir $TOP" \
  --define "_sourcedir $TOP/SOURCES" \
  --define "_rpmdir $DIST_DIR" \
  --define "_rpmfilename %%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm" \
  --define "agent_version $VERSION" \
  --define "agent_release $RELEASE" \
  --define "python_build $PYTHON" \
  --define "python_target $TARGET_PYTHON" \
  --define "python_abi $PYVER" \
  "$REPO/rpm.spec" >"$TOP/rpmbuild.log" 2>&1 || { tail -40 "$TOP/rpmbuild.log" >&2; die "rpmbuild failed (log: build/rpm/rpmbuild.log)"; }

RPM=$(ls -t "$DIST_DIR"/etcd-agent-"$VERSION"-"$RELEASE"*."$ARCH".rpm | head -1)
rm -rf "$STAGE" "$TOP/BUILD" "$TOP/BUILDROOT"
size=$(stat -c %s "$RPM")
awk -v f="$RPM" -v s="$size" -v t0="$start" -v t1="$(date +%s.%N)" -v py="$PYVER" -v tp="$TARGET_PYTHON" \
  'BEGIN { printf "build-rpm: %s (%.1f MB, Python %s -> %s) built in %.1f s\n", f, s / 1e6, py, tp, t1 - t0 }'
