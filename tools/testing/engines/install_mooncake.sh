#!/usr/bin/env bash
# Installs the real Mooncake Transfer Engine (PyPI mooncake-transfer-engine-non-cuda, pinned) into a venv under
# ${WSYNC_CACHE:-/var/cache/wsync}/mooncake-<version>. Used by tests/engines/mooncake_*.py, the peer wsync's
# `mooncake` transport is tested against.
#
# Idempotent: installs once and leaves a stamp keyed by the pinned requirements file; a warm run only checks the
# stamp (seconds). The last line printed is the venv's python.
#
#   tools/testing/engines/install_mooncake.sh
#   WSYNC_CACHE=/somewhere tools/testing/engines/install_mooncake.sh
#   WSYNC_MOONCAKE_REINSTALL=1 tools/testing/engines/install_mooncake.sh   # rebuild the venv from scratch
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

TAG=install_mooncake
STAMP_VALUE="mooncake=${MOONCAKE_VERSION} reqs=$(sha256sum "${REQS}" | cut -d' ' -f1)"
# shellcheck source=tools/testing/engines/venv_lib.sh
. "${HERE}/venv_lib.sh"
[[ "$(uname -m)" == x86_64 ]] || die "the pinned wheel is manylinux x86_64 only (this is $(uname -m))"

if ! venv_open WSYNC_MOONCAKE_REINSTALL; then
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
  venv_done
fi
echo "${VENV}/bin/python"
