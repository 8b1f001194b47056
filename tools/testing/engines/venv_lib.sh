# Shared by the tools/testing/engines installers (sourced, not run): a pinned venv in the cache directory, built once and
# kept by a stamp, one installer at a time per venv (flock). The caller sets TAG (log prefix), HOST_PY, CACHE,
# VENV, REQS and STAMP_VALUE, then calls `venv_open REINSTALL_VAR` and, if it returns 1, builds the venv and calls
# `venv_done`.

log() { echo "[${TAG}] $*" >&2; }
die() { echo "[${TAG}] error: $*" >&2; exit 1; }

# Returns 0 when the venv is current, 1 when the caller must (re)build it (the old one is already removed).
venv_open() {
  local reinstall_var=$1
  [[ -x "${HOST_PY}" ]] || die "${HOST_PY} not found (Debian package: python3)"
  [[ -f "${REQS}" ]] || die "missing ${REQS}"
  # venv needs ensurepip, which Debian ships separately.
  if ! "${HOST_PY}" -c 'import ensurepip, venv' 2>/dev/null; then
    local pyver
    pyver="$("${HOST_PY}" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    die "python venv support is missing: install the Debian package python3-venv (python${pyver}-venv)"
  fi
  if [[ "${!reinstall_var:-0}" == 1 ]]; then
    log "${reinstall_var}=1: removing ${VENV}"
    rm -rf "${VENV}"
  fi
  mkdir -p "${CACHE}"
  exec 9>"${VENV}.lock"
  flock 9
  if [[ -f "${VENV}/.wsync-install-stamp" && "$(cat "${VENV}/.wsync-install-stamp")" == "${STAMP_VALUE}" &&
        -x "${VENV}/bin/python" ]]; then
    log "venv ${VENV} is up to date"
    return 0
  fi
  VENV_T0=$(date +%s)
  rm -rf "${VENV}"
  log "creating venv ${VENV}"
  "${HOST_PY}" -m venv "${VENV}"
  return 1
}

venv_done() {
  echo "${STAMP_VALUE}" > "${VENV}/.wsync-install-stamp"
  log "venv ready in $(( $(date +%s) - VENV_T0 )) s"
}
