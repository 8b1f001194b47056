#!/usr/bin/env python3
"""The version is written once (CMakeLists.txt, `project(wsync VERSION x.y.z)`) and every artifact carries it: each
binary's --version, the C API's wsync_version(), the Python client's wheel, the vLLM plugin's and the framework
adapters' wheels (file name and the package's __version__, built from copies of client/python, client/vllm and
client/integrations the way the tests and installers build them). The container image's labels and tags are checked by deploy/validate.sh."""
import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import pyclient_wheel as pw  # noqa: E402

failures = []


def check(ok, what):
    print(("ok: " if ok else "FAIL: ") + what, flush=True)
    if not ok:
        failures.append(what)


def cmake_version():
    m = re.search(r"^project\(wsync VERSION ([0-9]+\.[0-9]+\.[0-9]+)", open(os.path.join(ROOT, "CMakeLists.txt")).read(),
                  re.M)
    if not m:
        sys.exit("CMakeLists.txt has no project(wsync VERSION x.y.z)")
    return m.group(1)


def wheel_version(wheel, package):
    """(version in the file name, __version__ written into the package)."""
    name_version = os.path.basename(wheel).split("-")[1]
    with zipfile.ZipFile(wheel) as z:
        text = z.read(package + "/_version.py").decode()
    m = re.search(r'__version__ = "([^"]+)"', text)
    return name_version, m.group(1) if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--lib", required=True, help="libwsync_client_c.so")
    ap.add_argument("--cache", default="/var/cache/wsync")
    args = ap.parse_args()
    v = cmake_version()
    print("CMakeLists.txt: wsync %s" % v)
    for prog in ("wsyncctl", "wsyncd", "wsync-coordinator", "wsync-engine-ref", "wsync-trainer-demo"):
        out = subprocess.run([os.path.join(args.bin, prog), "--version"], capture_output=True, text=True).stdout
        check(out.startswith("%s %s " % (prog, v)), "%s --version: %r" % (prog, out.strip()))
    lib = ctypes.CDLL(args.lib)
    lib.wsync_version.restype = ctypes.c_char_p
    check(lib.wsync_version().decode() == v, "C API wsync_version(): %s" % lib.wsync_version().decode())

    with tempfile.TemporaryDirectory() as work:
        wheel = pw.build_wheel(work, cache=args.cache)
        got = wheel_version(wheel, "wsync_client")
        check(got == (v, v), "Python client wheel %s: version %s, wsync_client.__version__ %s" %
              (os.path.basename(wheel), got[0], got[1]))
        # The vLLM plugin and the framework adapters (client/integrations), each built from a copy (as
        # tools/testing/engines/install_vllm_cpu.sh and install_framework.sh do), offline from the same pinned
        # wheelhouse (their builds need setuptools only).
        env = dict(pw.offline_env(pw.wheelhouse(args.cache)), WSYNC_SOURCE_DIR=ROOT)
        for folder, package, what in (("vllm", "wsync_vllm", "vLLM plugin"),
                                      ("integrations", "wsync_integrations", "framework adapters")):
            src = os.path.join(work, folder + "-src")
            shutil.copytree(os.path.join(ROOT, "client", folder), src,
                            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
            dist = os.path.join(work, folder + "-dist")
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src], check=True,
                           timeout=300, env=env)
            wheels = [w for w in os.listdir(dist) if w.endswith(".whl")]
            check(len(wheels) == 1, "one %s wheel built: %s" % (what, wheels))
            if wheels:
                got = wheel_version(os.path.join(dist, wheels[0]), package)
                check(got == (v, v), "%s wheel %s: version %s, %s.__version__ %s" %
                      (what, wheels[0], got[0], package, got[1]))
        src = os.path.join(work, "vllm-src")
        dist = os.path.join(work, "vllm-dist")
        # Without the checkout's CMakeLists.txt the build refuses rather than inventing a version.
        p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist + "2", src],
                           capture_output=True, text=True, timeout=300,
                           env=dict(pw.offline_env(pw.wheelhouse(args.cache))))
        check(p.returncode != 0 and "WSYNC_SOURCE_DIR" in p.stdout + p.stderr,
              "a copy built without WSYNC_SOURCE_DIR fails naming it (rc %d)" % p.returncode)
    if failures:
        print("FAILED: %d checks" % len(failures))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
