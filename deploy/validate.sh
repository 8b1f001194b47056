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
# The image's runtime packages must cover every shared library the built binaries link (deploy/docker/Dockerfile).
if [ -x "$bin/wsyncd" ] && command -v dpkg >/dev/null; then
  have=$(sed -n '/# runtime-packages/,/rm -rf/p' "$here/docker/Dockerfile" | tr ' \\' '\n\n' | grep -E '^lib|^zlib|^ibverbs' | sort -u)
  need=$(for b in wsyncd wsync-coordinator wsyncctl wsync-engine-ref wsync-trainer-demo; do ldd "$bin/$b"; done |
         awk '{print $1}' | sort -u | while read -r l; do (dpkg -S "*/$l" 2>/dev/null || true) | head -1 | cut -d: -f1; done |
         grep -vE '^(libc6|libc6-i386|libgcc-s1|libstdc\+\+6)$' | sort -u)
  missing=$(comm -13 <(echo "$have") <(echo "$need"))
  if [ -n "$missing" ]; then
    echo "docker: runtime packages missing from deploy/docker/Dockerfile: $(echo $missing)"; rc=1
  else
    echo "docker ok: the image's runtime packages cover every library the binaries link ($(echo "$need" | wc -l) packages)"
  fi
else
  echo "skip: Dockerfile runtime-package check (no binaries in ${1:-build/bin} or no dpkg)"
fi
exit $rc
