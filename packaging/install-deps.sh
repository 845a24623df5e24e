#!/usr/bin/env bash
# install-deps.sh demo|test : install the Debian packages the demo or the test suite needs, only
# those missing. Root (or sudo) is needed to install; nothing is installed that is already there.
# `test` also lays out the etcd releases the suite runs on under /opt/etcd (etcd-releases.sh:
# Debian's 3.4 linked, 3.5 releases fetched from newer Debian suites; fast when present); `demo`
# lays out only the default one of them, which `make demo` runs.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
what=${1:-test}
pkgs=(etcd-server etcd-client)
if [ "$what" = test ]; then
  # sshd in network namespaces, systemd in nspawn containers, the RPM tools, throwaway TLS certs,
  # the age CLI (encrypted backups must stay decryptable by hand: the interop tests use it), a real
  # S3 server: Ceph's RADOS Gateway on a one-node cluster (tests/harness/rgw.py; no service is set up)
  pkgs+=(openssh-server systemd-container debootstrap rpm iproute2 openssl procps cron age ceph-mon ceph-osd radosgw)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
as_root() {  # run "$@" as root: directly, or through sudo
  if [ "$(id -u)" = 0 ]; then "$@"; return; fi
  command -v sudo >/dev/null || { echo "install-deps: need root (or sudo) for: $*" >&2; exit 1; }
  sudo "$@"
}
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "install-deps: missing ${missing[*]} and no apt-get here; install them by hand" >&2
    exit 1
  fi
  echo "install-deps: installing ${missing[*]}" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian starts etcd on install on some setups: the demo and the tests need its ports free.
  if command -v systemctl >/dev/null && systemctl is-active --quiet etcd 2>/dev/null; then
    as_root systemctl disable --now etcd || true
  fi
fi
if [ "$what" = demo ]; then
  # the demo runs the suite's default release (a 3.5, with etcdutl: the rehearsal's point-in-time
  # restore replays with it; bookworm's 3.4 has none), laid out the same way, and only that one
  list=$(mktemp "${TMPDIR:-/tmp}/etcd-demo-release.XXXXXX")
  trap 'rm -f "$list"' EXIT
  awk '$3 == "default"' "$here/etcd-test-releases" >"$list"
  ETCD_RELEASES_LIST=$list "$here/etcd-releases.sh" --check /opt/etcd >/dev/null 2>&1 ||
    as_root env ETCD_RELEASES_LIST="$list" "$here/etcd-releases.sh" /opt/etcd
fi
if [ "$what" = test ]; then
  # the releases every tier runs on (packaging/etcd-test-releases); a missing one is an install
  # failure here, never a skipped test later. Checking needs no root, installing does.
  "$here/etcd-releases.sh" --check /opt/etcd >/dev/null 2>&1 || as_root "$here/etcd-releases.sh" /opt/etcd
fi
