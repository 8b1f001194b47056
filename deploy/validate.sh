#!/usr/bin/env bash
# Checks the deployment files: YAML syntax of deploy/k8s (python3-yaml) and the systemd units (systemd-analyze
# verify, with ExecStart pointed at a build directory's binaries). Each check is skipped when its tool is missing.
#   deploy/validate.sh [BUILD_BIN_DIR]     (default: build/bin)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(cd "${1:-$here/../build/bin}" 2>/dev/null && pwd || true)
rc=0

py=""
for p in python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null && "$p" -c 'import yaml' 2>/dev/null; then py=$p; break; fi
done
if [ -n "$py" ]; then
  "$py" - "$here"/k8s/*.yaml <<'PY' || rc=1
import sys, yaml
for f in sys.argv[1:]:
    kinds = [d["kind"] for d in yaml.safe_load_all(open(f)) if d]
    print("yaml ok: %s (%s)" % (f.split("/deploy/")[-1], ", ".join(kinds)))
PY
else
  echo "skip: no python3 with yaml (apt-get install python3-yaml)"
fi

if command -v systemd-analyze >/dev/null; then
  if [ -x "$bin/wsyncd" ] && [ -x "$bin/wsync-coordinator" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    for u in "$here"/systemd/*.service; do
      sed "s|/usr/local/bin/|$bin/|" "$u" >"$tmp/$(basename "$u")"
    done
    for u in "$tmp"/*.service; do
      out=$(cd "$tmp" && systemd-analyze verify --man=no "./$(basename "$u")" 2>&1) || true
      if [ -n "$out" ]; then echo "$out"; rc=1; else echo "unit ok: systemd/$(basename "$u")"; fi
    done
  else
    echo "skip: systemd units (no wsyncd/wsync-coordinator in ${1:-build/bin}; pass the bin directory)"
  fi
else
  echo "skip: systemd-analyze not available"
fi
exit $rc
