#!/usr/bin/env bash
# scripts/install.sh - make this checkout runnable on Debian 12: apt packages (FUSE, build
# tools, a throw-away Ceph RGW for tests/demo), .venv with tierfs installed editable, /dev/fuse.
# Idempotent and fast (<1 s) when everything is already there. One line per step; the
# output of apt-get/pip goes to a log that is shown only on failure.
# Python packages: the exact versions of constraints.txt (pip -c), so two installs of one
# commit get the same packages; pyproject.toml keeps only floors.
# Env: PYTHON   interpreter for the venv (default: python3 on PATH; must be >= 3.11)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=$ROOT/.venv
STAMP=$VENV/.tierfs-install-stamp
PY=${PYTHON:-python3}
CONSTRAINTS=$ROOT/constraints.txt
[ -f "$CONSTRAINTS" ] || { echo "install: error: $CONSTRAINTS is missing" >&2; exit 1; }

LOG=$(mktemp /tmp/tierfs-install.XXXXXX.log)
trap 'rm -f "$LOG"' EXIT

step() { echo "install: $*"; }
die() {  # message — show the tail of the current step's log (CI has no other way to
         # see it), then one clear error line, exit 1
  if [ -s "$LOG" ]; then
    echo "---- last lines of the log ----" >&2
    tail -n 40 "$LOG" >&2
    echo "-------------------------------" >&2
  fi
  echo "install: error: $*" >&2
  exit 1
}
run_logged() {  # cmd... — output to $LOG, kept only if the command fails
  : > "$LOG"
  "$@" >>"$LOG" 2>&1 || return 1
  : > "$LOG"
}
is_root() { [ "$(id -u)" = 0 ]; }

# ---------------------------------------------------------------- apt packages
# fuse3: fusermount3; libfuse3-dev pkg-config gcc (+ Python headers): pyfuse3 is sdist-only
# on PyPI and is compiled at pip install time; ceph-*/radosgw/curl: scripts/ceph-rgw
# (openssl: its RGW_HTTPS=1 certificate, tests/backend/test_https.py);
# slurm*/munge: the single-node Slurm the prolog/epilog tests start; systemd (systemd-analyze),
# systemd-container + debootstrap: unit checks and the real systemd inside systemd-nspawn;
# prometheus: promtool checks the recording and alerting rules (docs/prometheus/);
# chromium: renders `tierfs report --html` headless in its test.
pkg_installed() {
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = installed ]
}
venv_ok() {  # an existing .venv on Python >= 3.11 is kept whatever python3 is on PATH
  [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/pip" ] &&
    "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}
py_ok() { command -v "$PY" >/dev/null 2>&1; }
py_version() { "$1" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'; }
py_new_enough() { "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }
py_has_venv() { "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; }
has_headers() {  # python — Python.h of its (base) installation, to compile pyfuse3
  "$1" -c 'import os, sysconfig, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    >/dev/null 2>&1
}
check_py() {  # fail early on an unusable interpreter, before installing anything for it
  py_new_enough ||
    die "$(command -v "$PY") is Python $(py_version "$PY"); tierfs needs >= 3.11 (put a newer python3 first on PATH or set PYTHON=...)"
}

if venv_ok; then NEW_VENV=0; BASE_PY=$VENV/bin/python; else NEW_VENV=1; BASE_PY=$PY; fi

missing=()
for p in fuse3 libfuse3-dev pkg-config ceph-mon ceph-osd ceph-common radosgw curl openssl \
         slurmctld slurmd slurm-client munge systemd systemd-container debootstrap \
         prometheus chromium; do
  pkg_installed "$p" || missing+=("$p")
done
command -v gcc >/dev/null 2>&1 || pkg_installed gcc || missing+=(gcc)
# Python: Debian's python3 needs python3-venv (ensurepip) and python3-dev (Python.h); a
# pyenv/self-built python3 on PATH normally has both, then nothing is installed for it.
if [ "$NEW_VENV" = 1 ] && ! py_ok; then
  [ -z "${PYTHON:-}" ] || die "PYTHON=$PYTHON: command not found"
  missing+=(python3 python3-venv python3-dev)
else
  if [ "$NEW_VENV" = 1 ]; then
    check_py
    py_has_venv || missing+=(python3-venv)
  fi
  has_headers "$BASE_PY" || missing+=(python3-dev)
fi

if [ "${#missing[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 ||
    die "missing packages (${missing[*]}) and no apt-get: this script supports Debian 12 only"
  is_root || die "missing packages: ${missing[*]} - run as root (in a root shell: bash $0)"
  step "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  run_logged apt-get update || die "apt-get update failed"
  run_logged apt-get install -y --no-install-recommends "${missing[@]}" ||
    die "apt-get install ${missing[*]} failed"
else
  step "apt packages present"
fi

# ---------------------------------------------------------------- .venv (Python >= 3.11)
if [ "$NEW_VENV" = 0 ]; then
  step ".venv present (Python $(py_version "$VENV/bin/python"))"
else
  py_ok || die "no $PY on PATH after installing python3"
  check_py
  py_has_venv ||
    die "$(command -v "$PY") has no venv/ensurepip module (Debian: apt-get install python3-venv)"
  has_headers "$PY" ||
    die "$(command -v "$PY") has no Python.h, needed to build pyfuse3 (Debian: apt-get install python3-dev)"
  if [ -e "$VENV" ]; then
    step ".venv is broken or too old - recreating it with $(command -v "$PY") ($(py_version "$PY"))"
    rm -rf "$VENV"
  else
    step "create .venv with $(command -v "$PY") ($(py_version "$PY"))"
  fi
  run_logged "$PY" -m venv "$VENV" || die "$PY -m venv $VENV failed"
fi

if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$CONSTRAINTS" -nt "$STAMP" ]; then
  step "pip install -e '.[test]' -c constraints.txt (compiles pyfuse3, ~1 min the first time)"
  run_logged "$VENV/bin/pip" install --disable-pip-version-check --no-input \
      -c "$CONSTRAINTS" -e '.[test]' ||
    die "pip install -e '.[test]' -c constraints.txt failed"
  touch "$STAMP"
else
  step "python packages up to date (pyproject.toml, constraints.txt not newer than $(basename "$STAMP"))"
fi

# tierfs-csi (csi/): its own package; building it generates the CSI gRPC stubs from
# csi/tierfs_csi/csi.proto (pinned grpcio-tools, never committed), so rebuild when the
# proto or the packaging changes, or the generated files are missing
CSI_STAMP=$VENV/.tierfs-csi-install-stamp
csi_stale() {
  [ ! -f "$CSI_STAMP" ] || [ ! -f csi/tierfs_csi/csi_pb2.py ] ||
    [ ! -f csi/tierfs_csi/csi_pb2_grpc.py ] ||
    [ -n "$(find csi/pyproject.toml csi/setup.py csi/tierfs_csi/csi.proto constraints.txt \
            -newer "$CSI_STAMP")" ]
}
if csi_stale; then
  step "pip install -e 'csi/[test]' -c constraints.txt (tierfs-csi, generates the CSI gRPC stubs)"
  run_logged "$VENV/bin/pip" install --disable-pip-version-check --no-input \
      -c "$CONSTRAINTS" -e 'csi/[test]' ||
    die "pip install -e 'csi/[test]' -c constraints.txt failed"
  touch "$CSI_STAMP"
else
  step "tierfs-csi and its gRPC stubs up to date"
fi

# ---------------------------------------------------------------- /dev/fuse
if [ ! -d /sys/module/fuse ] && command -v modprobe >/dev/null 2>&1; then
  modprobe fuse >/dev/null 2>&1 || true   # best effort: often built in, or a container
fi
if [ ! -c /dev/fuse ]; then
  is_root || die "/dev/fuse is missing - run as root so it can be created"
  step "create /dev/fuse"
  mknod -m 0666 /dev/fuse c 10 229 2>/dev/null ||
    die "/dev/fuse is missing and cannot be created (container without FUSE? run with --device /dev/fuse --cap-add SYS_ADMIN)"
else
  step "/dev/fuse present"
fi
