#!/usr/bin/env python3
"""A real etcd (Debian's etcd-server) on 127.0.0.1 in a temporary directory, for the tests labelled `etcd`.

As a module: `with Etcd() as e:` starts one (installing etcd-server with apt-get when it is missing) and gives
`e.endpoint` ("127.0.0.1:PORT"). As a program: `etcd_harness.py CMD ARGS...` runs CMD with WSYNC_ETCD_ENDPOINT set
to a fresh etcd and returns CMD's exit status. A missing etcd that cannot be installed is a failure, not a skip.
"""
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_etcd() -> str:
    path = shutil.which("etcd")
    if path:
        return path
    print("etcd_harness: etcd is missing; installing Debian's etcd-server", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    subprocess.run(sudo + ["apt-get", "update", "-qq"], env=env, check=True)
    subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "etcd-server"], env=env,
                   check=True, stdout=subprocess.DEVNULL)
    path = shutil.which("etcd")
    if not path:
        raise RuntimeError("etcd-server was installed but no etcd binary is on PATH")
    return path


class Etcd:
    def __init__(self):
        self.dir = None
        self.proc = None
        self.endpoint = None

    def __enter__(self):
        binary = ensure_etcd()
        self.dir = tempfile.mkdtemp(prefix="wsync-etcd-")
        client, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{client}"
        log = open(os.path.join(self.dir, "etcd.log"), "wb")
        self.proc = subprocess.Popen(
            [binary, "--name", "wsync-test", "--data-dir", os.path.join(self.dir, "data"),
             "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"wsync-test=http://127.0.0.1:{peer}", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                req = urllib.request.Request(f"http://{self.endpoint}/v3/kv/range", data=b'{"key":"AA=="}',
                                             method="POST")
                with urllib.request.urlopen(req, timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError("etcd did not answer within 30 s")

    def log_tail(self) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.dir, "etcd.log"), "rb") as f:
            return f.read().decode(errors="replace")[-2000:]
        return ""

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        return False


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: etcd_harness.py CMD [ARGS...]", file=sys.stderr)
        return 2
    with Etcd() as e:
        print(f"etcd_harness: etcd {e.endpoint}", flush=True)
        return subprocess.run(sys.argv[1:], env=dict(os.environ, WSYNC_ETCD_ENDPOINT=e.endpoint)).returncode


if __name__ == "__main__":
    sys.exit(main())
