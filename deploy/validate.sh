#!/usr/bin/env bash
# Checks the deployment files: YAML syntax of deploy/k8s (python3-yaml), the manifests and the image against each
# other (every container command is a program the Dockerfile's image installs, image tags and labels carry the version
# of CMakeLists.txt, the demo's scripts, openssl, HEALTHCHECK, .dockerignore, transports that start without RDMA), the
# image's HEALTHCHECK against a running coordinator's /healthz, and the systemd units (systemd-analyze verify, with
# ExecStart pointed at a build directory's binaries). Each check is skipped when its tool is missing.
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
  "$py" - "$here" <<'PY' || rc=1
import glob, os, re, sys, yaml
here = sys.argv[1]
root = os.path.dirname(here)
bad = []
def fail(msg):
    bad.append(msg)
    print("layout: " + msg)
version = re.search(r"^project\(wsync VERSION (\S+)", open(os.path.join(root, "CMakeLists.txt")).read(), re.M).group(1)
df = open(os.path.join(here, "docker", "Dockerfile")).read()
build_stage, runtime_stage = re.split(r"^FROM ", df, flags=re.M)[1:3]
prefix = re.search(r"cmake --install \S+ --prefix (\S+)", build_stage).group(1)
# What `cmake --install` puts in PREFIX/bin: the install() rules outside tests/ and bench/ (the image builds neither).
progs = set()
for cm in glob.glob(os.path.join(root, "**", "CMakeLists.txt"), recursive=True):
    rel = os.path.relpath(cm, root)
    if rel.startswith(("build", "tests" + os.sep, "bench" + os.sep)):
        continue
    text = open(cm).read()
    for m in re.finditer(r"install\(TARGETS\s+([^)]*?)\s+RUNTIME DESTINATION bin\)", text):
        progs |= set(m.group(1).split())
    for m in re.finditer(r"install\(PROGRAMS\s+([^)]*?)\s+DESTINATION bin\)", text):
        progs |= {os.path.basename(p) for p in m.group(1).split()}
image_paths = {prefix + "/bin/" + p for p in progs}
image_paths |= {m.group(1) for m in re.finditer(r"^COPY (?!--from)\S+ (\S+)", runtime_stage, re.M)}
for f in sorted(glob.glob(os.path.join(here, "k8s", "*.yaml"))):
    for doc in yaml.safe_load_all(open(f)):
        spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            where = "%s container %s" % (os.path.basename(f), c.get("name"))
            cmd = (c.get("command") or [None])[0]
            if cmd is not None and cmd not in image_paths:
                fail("%s runs %s, which the image does not install (it has %s)" % (where, cmd, ", ".join(sorted(image_paths))))
            image = c.get("image", "")
            if image.split("/")[-1].split(":")[0] == "wsync" and not image.endswith(":" + version):
                fail("%s uses image %s, not the version of CMakeLists.txt (%s)" % (where, image, version))
if not re.search(r"^ARG WSYNC_VERSION=%s$" % re.escape(version), runtime_stage, re.M):
    fail("Dockerfile: ARG WSYNC_VERSION is not %s (CMakeLists.txt)" % version)
if "org.opencontainers.image.version=\"${WSYNC_VERSION}\"" not in runtime_stage:
    fail("Dockerfile: no org.opencontainers.image.version label from WSYNC_VERSION")
for m in re.finditer(r"wsync:([0-9][0-9.]*[0-9])", df + open(os.path.join(here, "README.md")).read()):
    if m.group(1) != version:
        fail("image tag wsync:%s in the Dockerfile or deploy/README.md is not %s" % (m.group(1), version))
if not re.search(r"^HEALTHCHECK .*entrypoint\.sh\", \"healthcheck\"", runtime_stage, re.M):
    fail("Dockerfile: no HEALTHCHECK running entrypoint.sh healthcheck")
if not re.search(r"^\s+openssl \\$", runtime_stage, re.M):
    fail("Dockerfile: the runtime stage does not install openssl (the demo's certificates)")
# The demo in the image: entrypoint.sh's demo.sh, its certificate script beside it, and the model it is given.
entry = open(os.path.join(here, "docker", "entrypoint.sh")).read()
demo = re.search(r"exec (\S+/demo\.sh) .*--model (\S+)", entry)
if not demo or demo.group(1) not in image_paths:
    fail("entrypoint.sh runs %s, which the image does not install" % (demo.group(1) if demo else "no demo.sh"))
if "wsync-certs.sh" not in progs or not re.search(r'dirname "\$0"\)" && pwd\)/wsync-certs\.sh', open(os.path.join(root, "tools", "cli", "demo.sh")).read()):
    fail("demo.sh does not find wsync-certs.sh beside itself, or it is not installed to bin")
if demo:
    model_dir = os.path.basename(os.path.dirname(demo.group(2)))
    share = os.path.dirname(os.path.dirname(demo.group(2)))
    if not re.search(r"cp -r tests/data/models/%s %s/" % (re.escape(model_dir), re.escape(share)), build_stage) or \
            not os.path.isfile(os.path.join(root, "tests", "data", "models", model_dir, "config.json")):
        fail("the demo's model %s is not copied into the image" % demo.group(2))
ignore = os.path.join(root, ".dockerignore")
lines = open(ignore).read().split() if os.path.exists(ignore) else []
for need in ("build*/", ".git/"):
    if need not in lines:
        fail(".dockerignore does not exclude %s" % need)
# A host without RDMA must not crash-loop on the defaults: the last transport of every list is tcp.
for f in [os.path.join(here, "k8s", "configmap.yaml")] + glob.glob(os.path.join(here, "systemd", "*")) + \
         glob.glob(os.path.join(here, "systemd", "env", "*")):
    if os.path.isdir(f):
        continue
    for m in re.finditer(r"WSYNC_TRANSPORT[=:] *\"?([a-z,]+)", open(f).read()):
        if m.group(1).split(",")[-1] != "tcp":
            fail("%s: WSYNC_TRANSPORT=%s exits on a host without RDMA (use tcp or verbs,tcp)" % (os.path.relpath(f, here), m.group(1)))
# find_package(wsync X) in the docs: the package config accepts the same major.minor only (SameMinorVersion).
for doc in (os.path.join(root, "README.md"), os.path.join(here, "README.md")):
    for m in re.finditer(r"find_package\(wsync ([0-9.]+)", open(doc).read()):
        if m.group(1).split(".")[:2] != version.split(".")[:2]:
            fail("%s: find_package(wsync %s), which wsync %s refuses (same major.minor only)"
                 % (os.path.relpath(doc, root), m.group(1), version))
# Every pod: each $(VAR) of its containers' args is set (ConfigMap or env), and a non-root container can read the
# Secrets it mounts (root-owned files: world-readable, or group-readable with the pod's fsGroup).
config = {}
for doc in yaml.safe_load_all(open(os.path.join(here, "k8s", "configmap.yaml"))):
    if doc and doc.get("kind") == "ConfigMap":
        config.update(doc.get("data") or {})
for f in sorted(glob.glob(os.path.join(here, "k8s", "*.yaml"))):
    for doc in yaml.safe_load_all(open(f)):
        spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
        pod_sc = spec.get("securityContext") or {}
        secrets = {v["name"]: v["secret"].get("defaultMode", 0o644) for v in spec.get("volumes", []) if "secret" in v}
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            where = "%s container %s" % (os.path.basename(f), c.get("name"))
            env = set(config) if any("configMapRef" in e for e in c.get("envFrom", [])) else set()
            env |= {e["name"] for e in c.get("env", [])}
            for a in (c.get("command") or []) + (c.get("args") or []):
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(a)):
                    if var not in env:
                        fail("%s: %s uses $(%s), which neither its env nor the ConfigMap sets" % (where, a, var))
            uid = (c.get("securityContext") or {}).get("runAsUser", pod_sc.get("runAsUser"))
            for m in c.get("volumeMounts", []):
                mode = secrets.get(m["name"])
                if mode is None or uid in (None, 0):
                    continue
                if not (mode & 0o004 or (pod_sc.get("fsGroup") is not None and mode & 0o040)):
                    fail("%s runs as uid %s but its Secret volume %s (mode %o, root-owned) is not readable to it: "
                         "set the pod's fsGroup and a group-readable defaultMode" % (where, uid, m["name"], mode))
# Every --engine of the deploy files names its kind (a bare H:P means the reference engine, whatever serves there);
# SGLang's needs the model's config.
for f in glob.glob(os.path.join(here, "systemd", "*")) + glob.glob(os.path.join(here, "systemd", "env", "*")) + \
         glob.glob(os.path.join(here, "k8s", "*.yaml")):
    if os.path.isdir(f):
        continue
    for line in open(f):
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(r"--engine[= ]([^\s\"']+)", line):
            addr = m.group(1)
            kind = re.match(r"(reference\+grpc|vllm\+http|sglang\+http|\$\(WSYNC_ENGINE_SCHEME\))://", addr)
            if not kind:
                fail("%s: --engine %s does not name the engine's kind (reference+grpc://, vllm+http://, sglang+http://)"
                     % (os.path.relpath(f, here), addr))
            elif kind.group(1) == "sglang+http" and "config=" not in addr:
                fail("%s: --engine %s: SGLang needs config=PATH" % (os.path.relpath(f, here), addr))
# systemd: every ${VAR} of a unit's ExecStart has a default in the unit (the env file only overrides).
for f in glob.glob(os.path.join(here, "systemd", "*.service")):
    unit = open(f).read()
    defaults = set(re.findall(r"^Environment=\"?([A-Za-z_][A-Za-z0-9_]*)=", unit, re.M))
    exec_start = re.search(r"^ExecStart=((?:.*\\\n)*.*)$", unit, re.M).group(1)
    for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", exec_start):
        if var not in defaults:
            fail("%s: ExecStart uses %s, which has no Environment= default" % (os.path.basename(f), var))
print("layout %s: manifests, image (%s/bin: %d programs), version %s, demo, HEALTHCHECK, .dockerignore, transports, "
      "$(VAR)s, Secret modes, find_package, engine kinds" % ("FAILED" if bad else "ok", prefix, len(progs), version))
sys.exit(1 if bad else 0)
PY
else
  echo "skip: no python3 with yaml (apt-get install python3-yaml)"
fi

# The image's HEALTHCHECK (entrypoint.sh healthcheck) against a real coordinator's /healthz, and against an address
# nobody serves.
if [ -x "$bin/wsync-coordinator" ] && [ -n "$py" ]; then
  port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  dead=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$bin/wsync-coordinator" --listen 127.0.0.1:0 --metrics-listen "127.0.0.1:$port" >/dev/null 2>&1 &
  cpid=$!
  ok=1
  for _ in $(seq 1 100); do WSYNC_HEALTH_PID=$cpid sh "$here/docker/entrypoint.sh" healthcheck 2>/dev/null && { ok=0; break; }; sleep 0.1; done
  kill $cpid 2>/dev/null; wait $cpid 2>/dev/null || true
  bash -c 'sleep 30; :' --metrics-listen "127.0.0.1:$dead" &  # a command line naming an address nobody serves
  spid=$!
  sleep 0.2
  WSYNC_HEALTH_PID=$spid sh "$here/docker/entrypoint.sh" healthcheck 2>/dev/null && bad_ok=1 || bad_ok=0
  kill $spid 2>/dev/null; wait $spid 2>/dev/null || true
  if [ $ok -eq 0 ] && [ $bad_ok -eq 0 ]; then
    echo "healthcheck ok: healthy on a coordinator's --metrics-listen, unhealthy where nothing serves /healthz"
  else
    echo "healthcheck: entrypoint.sh healthcheck answered $([ $ok -eq 0 ] && echo 'right' || echo 'wrong') for a running coordinator, $([ $bad_ok -eq 0 ] && echo 'right' || echo 'wrong') for a dead address"; rc=1
  fi
else
  echo "skip: HEALTHCHECK check (no wsync-coordinator in ${1:-build/bin})"
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
