#!/usr/bin/env bash
# Installs the real Mooncake Transfer Engine (PyPI mooncake-transfer-engine-non-cuda, pinned) into a venv under
# ${WSYNC_CACHE:-/var/cache/wsync}/mooncake-<version>. Used by tests/engines/mooncake_*.py, the peer wsync's
# `mooncake` transport is tested against.
#
# Idempotent: installs once and leaves a stamp keyed by the pinned requirements file; a warm run only checks the
# stamp (seconds). The last line printed is the venv's python.
#
#   tools/engines/install_mooncake.sh
#   WSYNC_CACHE=/somewhere tools/engines/install_mooncake.sh
#   WSYNC_MOONCAKE_REINSTALL=1 tools/engines/install_mooncake.sh   # rebuild the venv from scratch
#
# Why 0.3.12.post1 and not the newest (0.3.13.post1 installs as well): its source is tagged (v0.3.12.post1), and
# docs/mooncake-protocol.md cites that tag's files and lines. Change the version here, the requirements file name
# and the doc together.
set -euo pipefail

MOONCAKE_VERSION=0.3.12.post1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${WSYNC_CACHE:-/var/cache/wsync}"
VENV="${CACHE}/mooncake-${MOONCAKE_VERSION}"
REQS="${HERE}/mooncake-${MOONCAKE_VERSION}.txt"
HOST_PY=/usr/bin/python3

log() { echo "[install_mooncake] $*" >&2; }
die() { echo "[install_mooncake] error: $*" >&2; exit 1; }

[[ -x "${HOST_PY}" ]] || die "${HOST_PY} not found (Debian package: python3)"
[[ -f "${REQS}" ]] || die "missing ${REQS}"
[[ "$(uname -m)" == x86_64 ]] || die "the pinned wheel is manylinux x86_64 only (this is $(uname -m))"

# venv needs ensurepip, which Debian ships separately.
if ! "${HOST_PY}" -c 'import ensurepip, venv' 2>/dev/null; then
  pyver="$("${HOST_PY}" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  die "python venv support is missing: install the Debian package python3-venv (python${pyver}-venv), e.g. apt-get install -y python3-venv"
fi

STAMP="${VENV}/.wsync-install-stamp"
want_stamp="mooncake=${MOONCAKE_VERSION} reqs=$(sha256sum "${REQS}" | cut -d' ' -f1)"

if [[ "${WSYNC_MOONCAKE_REINSTALL:-0}" == 1 ]]; then
  log "WSYNC_MOONCAKE_REINSTALL=1: removing ${VENV}"
  rm -rf "${VENV}"
fi

mkdir -p "${CACHE}"
# One installer at a time per cache directory.
exec 9>"${CACHE}/.mooncake-${MOONCAKE_VERSION}.lock"
flock 9

if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${want_stamp}" && -x "${VENV}/bin/python" ]]; then
  log "venv ${VENV} is up to date"
else
  t0=$(date +%s)
  rm -rf "${VENV}"
  log "creating venv ${VENV}"
  "${HOST_PY}" -m venv "${VENV}"
  log "installing the pinned set ($(grep -c '==' "${REQS}") pins, ~50 MB)"
  "${VENV}/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "${REQS}"
  # --no-deps above keeps the set exactly the file's; check that it is also complete.
  "${VENV}/bin/python" -m pip check >&2 || die "the pinned set in ${REQS} is incomplete (pip check failed)"
  "${VENV}/bin/python" - <<'PY' >&2
from importlib.metadata import version
from mooncake.engine import TransferEngine
TransferEngine()
print("mooncake-transfer-engine-non-cuda", version("mooncake-transfer-engine-non-cuda"), "imports")
PY
  echo "${want_stamp}" > "${STAMP}"
  log "venv ready in $(( $(date +%s) - t0 )) s"
fi
echo "${VENV}/bin/python"
