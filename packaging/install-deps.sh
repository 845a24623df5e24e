#!/usr/bin/env bash
# install-deps.sh demo|test : install the Debian packages the demo or the test suite needs, only
# those missing. Root (or sudo) is needed to install; nothing is installed that is already there.
set -euo pipefail
what=${1:-test}
pkgs=(etcd-server etcd-client)
if [ "$what" = test ]; then
  # sshd in network namespaces, systemd in nspawn containers, the RPM tools, throwaway TLS certs,
  # the age CLI (encrypted backups must stay decryptable by hand: the interop tests use it)
  pkgs+=(openssh-server systemd-container debootstrap rpm iproute2 openssl procps cron age)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
  echo "install-deps: missing ${missing[*]} and no apt-get here; install them by hand" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root to install ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
echo "install-deps: installing ${missing[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Debian starts etcd on install on some setups: the demo and the tests need its ports free.
if command -v systemctl >/dev/null && systemctl is-active --quiet etcd 2>/dev/null; then
  $SUDO systemctl disable --now etcd || true
fi
