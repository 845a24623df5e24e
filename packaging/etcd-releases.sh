#!/usr/bin/env bash
# etcd-releases.sh [--check] [DEST] : lay out the etcd releases listed in packaging/etcd-test-releases under
# DEST (default /opt/etcd) as DEST/<version>/{etcd,etcdctl[,etcdutl]}, the layout the README tells
# operators to use for [etcd] versions_dir.
#
#   system  DEST/<v>/etcd, etcdctl -> /usr/bin/etcd, /usr/bin/etcdctl (which must report <v>)
#   SUITE   etcd-server + etcd-client of that Debian suite, downloaded with apt from the Debian
#           archive this machine's apt already uses (signatures and checksums checked by apt), with
#           a throwaway sources list, lists and cache: nothing is installed with dpkg and the
#           machine's apt state is untouched. The binaries are unpacked with dpkg-deb -x and
#           copied into a temporary dir that is renamed into place only when every binary reports
#           the wanted version.
#
# --check only checks (exit 1 naming the first release that is missing or wrong).
# ETCD_RELEASES_ARCHIVE=URI names another Debian mirror. Idempotent: a release already in place whose binaries report its version is left alone (no
# network). A DEST/<v> that exists but is wrong is reported, never deleted. Exit 1 with the reason
# when the archive is unreachable or a suite no longer carries the listed version.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
CHECK_ONLY=""
if [ "${1:-}" = --check ]; then CHECK_ONLY=1; shift; fi
DEST=${1:-/opt/etcd}
LIST=${ETCD_RELEASES_LIST:-$here/etcd-test-releases}
APT_TIMEOUT=${ETCD_RELEASES_APT_TIMEOUT:-300}   # seconds for one suite's update + download
me=etcd-releases
WORK=$(mktemp -d "${TMPDIR:-/tmp}/etcd-releases.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

die() { echo "$me: $*" >&2; exit 1; }

# "3.5.16" when BINARY (etcd, etcdctl or etcdutl) reports it; empty when it does not run
reported() {
  local bin=$1 out
  case "$(basename "$bin")" in
    etcd) out=$(timeout 30 "$bin" --version 2>/dev/null) || return 0 ;;
    *)    out=$(ETCDCTL_API=3 timeout 30 "$bin" version 2>/dev/null) || return 0 ;;
  esac
  awk -F': *' 'tolower($1) ~ /^(etcd|etcdctl|etcdutl) version$/ {print $2; exit}' <<<"$out"
}

tools_of() {  # the binaries a release must have: etcdutl exists from 3.5 on
  case $1 in 3.[0-4].*) echo "etcd etcdctl" ;; *) echo "etcd etcdctl etcdutl" ;; esac
}

# 0 when DIR holds every tool of VERSION, each reporting VERSION; else prints what is wrong
check_dir() {
  local dir=$1 v=$2 t got bad=""
  for t in $(tools_of "$v"); do
    if [ ! -x "$dir/$t" ]; then bad+=" $t missing;"; continue; fi
    got=$(reported "$dir/$t")
    [ "$got" = "$v" ] || bad+=" $t reports ${got:-nothing};"
  done
  [ -z "$bad" ] && return 0
  echo "${bad# }"
  return 1
}

archive_uri() {
  local uri=${ETCD_RELEASES_ARCHIVE:-}   # a mirror, instead of the one in the apt sources
  [ -n "$uri" ] && { echo "$uri"; return; }
  uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$uri" ] || uri=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$uri" ] || die "no Debian archive in this machine's apt sources (/etc/apt/sources.list*)"
  echo "$uri"
}

link_system() {  # version
  local v=$1 t got
  for t in etcd etcdctl; do
    [ -x "/usr/bin/$t" ] || die "/usr/bin/$t missing: apt-get install etcd-server etcd-client"
    got=$(reported "/usr/bin/$t")
    [ "$got" = "$v" ] || die "/usr/bin/$t reports ${got:-nothing}, $LIST lists $v for 'system'"
  done
  mkdir -p "$DEST/$v"
  for t in etcd etcdctl; do
    if [ -L "$DEST/$v/$t" ] && [ "$(readlink "$DEST/$v/$t")" = "/usr/bin/$t" ]; then continue; fi
    [ -e "$DEST/$v/$t" ] || [ -L "$DEST/$v/$t" ] && die "$DEST/$v/$t exists and is not a link to /usr/bin/$t; remove it"
    ln -s "/usr/bin/$t" "$DEST/$v/$t"
  done
}

fetch_suite() {  # version suite
  local v=$1 suite=$2 uri w=$WORK s got t bad
  uri=$(archive_uri)
  s=$w/$suite
  mkdir -p "$s/lists/partial" "$s/cache/archives/partial" "$s/x"
  echo "deb $uri $suite main" >"$s/sources.list"
  local apt=(apt-get -q -o "Dir::Etc::sourcelist=$s/sources.list" -o Dir::Etc::sourceparts=/dev/null
             -o "Dir::State::Lists=$s/lists" -o "Dir::Cache=$s/cache" -o APT::Sandbox::User=root
             -o Acquire::Retries=2 -o Acquire::http::Timeout=30 -o Acquire::https::Timeout=30)
  if ! timeout "$APT_TIMEOUT" "${apt[@]}" --error-on=any update >"$w/update.log" 2>&1; then
    die "cannot reach the Debian archive $uri for suite $suite (apt-get update failed or timed out after ${APT_TIMEOUT}s):
$(tail -n 5 "$w/update.log")"
  fi
  if ! (cd "$s" && timeout "$APT_TIMEOUT" "${apt[@]}" download etcd-server etcd-client) >"$w/download.log" 2>&1; then
    die "downloading etcd-server/etcd-client of $suite from $uri failed:
$(tail -n 5 "$w/download.log")"
  fi
  for deb in "$s"/etcd-server_*.deb "$s"/etcd-client_*.deb; do
    [ -f "$deb" ] || die "apt-get download of $suite left no $(basename "$deb")"
    dpkg-deb -x "$deb" "$s/x"
  done
  got=$(reported "$s/x/usr/bin/etcd")
  [ "$got" = "$v" ] || die "Debian $suite now carries etcd ${got:-(unreadable)}, not $v: update $LIST (and the tests that name $v)"
  mkdir -p "$DEST"
  local tmp
  tmp=$(mktemp -d "$DEST/.$v.tmp-XXXXXX")
  for t in $(tools_of "$v"); do
    [ -x "$s/x/usr/bin/$t" ] || { rm -rf "$tmp"; die "Debian $suite's etcd $v packages have no /usr/bin/$t"; }
    install -m 0755 "$s/x/usr/bin/$t" "$tmp/$t"
  done
  if ! bad=$(check_dir "$tmp" "$v"); then rm -rf "$tmp"; die "etcd $v from $suite does not run here: $bad"; fi
  chmod 0755 "$tmp"
  mv -T "$tmp" "$DEST/$v"
}

[ -r "$LIST" ] || die "no release list $LIST"
t0=$(date +%s)
while read -r v src _rest; do
  case $v in ''|'#'*) continue ;; esac
  [[ $v =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "$LIST: bad version '$v'"
  [[ $src =~ ^[a-z][a-z0-9-]*$ ]] || die "$LIST: bad source '$src' for $v"
  if [ -e "$DEST/$v" ] || [ -L "$DEST/$v" ]; then
    if bad=$(check_dir "$DEST/$v" "$v"); then
      echo "$me: etcd $v in $DEST/$v: present ($(tools_of "$v" | tr ' ' ','))"
      continue
    fi
    # a link dir of the system release may be completed; anything else is someone's: say so
    [ -z "$CHECK_ONLY" ] || die "$DEST/$v is not etcd $v: $bad"
    [ "$src" = system ] || die "$DEST/$v exists but is not etcd $v ($bad): move it away and re-run"
  fi
  [ -z "$CHECK_ONLY" ] || die "etcd $v missing in $DEST/$v (packaging/install-deps.sh test installs it)"
  if [ "$src" = system ]; then
    link_system "$v"
  else
    fetch_suite "$v" "$src"
  fi
  bad=$(check_dir "$DEST/$v" "$v") || die "etcd $v in $DEST/$v after install: $bad"
  echo "$me: etcd $v in $DEST/$v: installed from $src ($(tools_of "$v" | tr ' ' ','))"
done <"$LIST"
echo "$me: releases ready in $DEST ($(( $(date +%s) - t0 )) s)"
