#!/usr/bin/env bash
# Clang's thread-safety analysis (-Wthread-safety -Werror) of the files whose locks are annotated (ABSL_GUARDED_BY,
# ABSL_EXCLUSIVE_LOCKS_REQUIRED): the coordinator's lock contracts are checked by the compiler, not by comments.
# Syntax only (nothing is built): each file is compiled as the build compiles it (compile_commands.json of BUILD_DIR,
# exported by the project's CMakeLists), with clang++ in place of the build's compiler.
#
#   tools/ci/thread_safety.sh [BUILD_DIR]    # default: build
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
clang=$(command -v clang++ || command -v clang++-14 || true)
if [ -z "$clang" ]; then
  echo "thread_safety: clang++ not found (Debian package clang; tools/cli/quickstart.sh installs it)" >&2
  exit 1
fi
[ -f "$build/compile_commands.json" ] || { echo "thread_safety: $build/compile_commands.json missing: build first" >&2; exit 1; }
# The annotated files (one fact: the list lives here).
files=(
  daemon/coordinator/coordinator.cc
  daemon/coordinator/cluster_model.cc
  daemon/coordinator/coordinator_service.cc
  daemon/coordinator/store_writer.cc
  daemon/coordinator/phase_table.cc
  daemon/node/source_writer.cc
)
exec python3 - "$clang" "$build/compile_commands.json" "${files[@]}" <<'PY'
import json, os, shlex, subprocess, sys
clang, db, files = sys.argv[1], sys.argv[2], sys.argv[3:]
entries = {os.path.realpath(e["file"]): e for e in json.load(open(db))}
failed = 0
for f in files:
    e = entries.get(os.path.realpath(f))
    if e is None:
        print(f"thread_safety: {f} is not in {db}", file=sys.stderr)
        failed += 1
        continue
    args = shlex.split(e["command"]) if "command" in e else list(e["arguments"])
    cmd, skip = [clang], False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD"):
            continue
        cmd.append(a)
    cmd += ["-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety", "-Wno-unknown-warning-option"]
    r = subprocess.run(cmd, cwd=e["directory"], capture_output=True, text=True)
    msgs = [l for l in r.stderr.splitlines() if "thread-safety" in l or "error:" in l]
    if r.returncode != 0 or msgs:
        failed += 1
        print(f"thread_safety: {f}:", file=sys.stderr)
        print("\n".join(msgs or r.stderr.splitlines()[-20:]), file=sys.stderr)
    else:
        print(f"thread_safety: {f}: ok")
sys.exit(1 if failed else 0)
PY
