#!/usr/bin/env python3
"""A real etcd (Debian's etcd-server) on 127.0.0.1 in a temporary directory, for the tests labelled `etcd`.

As a module: `with Etcd() as e:` starts one (installing etcd-server with apt-get when it is missing) and gives
`e.endpoint` ("127.0.0.1:PORT"). As a program: `etcd_harness.py CMD ARGS...` runs CMD with WSYNC_ETCD_ENDPOINT set
to a fresh etcd and returns CMD's exit status; `etcd_harness.py --members 3 CMD ...` starts a 3-member cluster
instead (WSYNC_ETCD_ENDPOINT lists every member, WSYNC_ETCD_PIDS their process ids). A missing etcd that cannot be installed is a failure, not a skip.
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


class EtcdCluster:
    """`members` etcd processes forming one cluster on 127.0.0.1: `endpoints` (client host:port) and `pids`, in
    member order."""

    def __init__(self, members: int):
        self.members = members
        self.dir = None
        self.procs = []
        self.endpoints = []

    def __enter__(self):
        binary = ensure_etcd()
        self.dir = tempfile.mkdtemp(prefix="wsync-etcd-cluster-")
        ports = [(free_port(), free_port()) for _ in range(self.members)]
        names = [f"m{i}" for i in range(self.members)]
        initial = ",".join(f"{n}=http://127.0.0.1:{peer}" for n, (_, peer) in zip(names, ports))
        self.endpoints = [f"127.0.0.1:{client}" for client, _ in ports]
        for n, (client, peer) in zip(names, ports):
            log = open(os.path.join(self.dir, f"{n}.log"), "wb")
            self.procs.append(subprocess.Popen(
                [binary, "--name", n, "--data-dir", os.path.join(self.dir, n),
                 "--listen-client-urls", f"http://127.0.0.1:{client}",
                 "--advertise-client-urls", f"http://127.0.0.1:{client}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", initial, "--initial-cluster-state", "new", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        # Ready when every member answers a status with a leader elected.
        deadline = time.time() + 60
        pending = set(self.endpoints)
        while pending and time.time() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"an etcd member exited ({p.returncode})")
            for ep in list(pending):
                try:
                    req = urllib.request.Request(f"http://{ep}/v3/maintenance/status", data=b"{}", method="POST")
                    with urllib.request.urlopen(req, timeout=1) as r:
                        if r.status == 200 and b'"leader"' in r.read():
                            pending.discard(ep)
                except OSError:
                    pass
            time.sleep(0.1)
        if pending:
            self.__exit__(None, None, None)
            raise RuntimeError(f"etcd members {sorted(pending)} did not answer with a leader within 60 s")
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGCONT)  # a member a test stopped must see the SIGTERM
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        return False


def main() -> int:
    args = sys.argv[1:]
    members = 1
    if len(args) >= 2 and args[0] == "--members":
        members = int(args[1])
        args = args[2:]
    if not args:
        print("usage: etcd_harness.py [--members N] CMD [ARGS...]", file=sys.stderr)
        return 2
    if members == 1:
        with Etcd() as e:
            print(f"etcd_harness: etcd {e.endpoint}", flush=True)
            return subprocess.run(args, env=dict(os.environ, WSYNC_ETCD_ENDPOINT=e.endpoint)).returncode
    # A cluster: WSYNC_ETCD_ENDPOINT lists every member's client address, WSYNC_ETCD_PIDS their processes (same order).
    with EtcdCluster(members) as c:
        print(f"etcd_harness: etcd cluster {','.join(c.endpoints)}", flush=True)
        env = dict(os.environ, WSYNC_ETCD_ENDPOINT=",".join(c.endpoints),
                   WSYNC_ETCD_PIDS=",".join(str(p.pid) for p in c.procs))
        return subprocess.run(args, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
