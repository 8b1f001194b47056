"""Process and HTTP helpers shared by the real-engine tests and benches (tests/engines, bench/engine).

Everything here talks to 127.0.0.1 only and cleans up what it started: process groups are killed on exit, and
vLLM's own leftovers in /tmp and /dev/shm (it does not remove them) are removed for the processes we started.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpError(RuntimeError):
    def __init__(self, status: int, body: str, what: str):
        super().__init__(f"{what}: HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


def http(method: str, url: str, body=None, timeout: float = 60.0):
    """JSON request → decoded JSON (None for an empty body). Raises HttpError on a non-2xx answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
    except urllib.error.HTTPError as e:
        raise HttpError(e.code, e.read().decode(errors="replace"), f"{method} {url}") from None
    return json.loads(raw) if raw.strip() else None


def tie_to_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies, however that one dies (a CTest
    timeout's SIGKILL, a killed .ci/run). It runs in its own session, so nothing else would stop it."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Procs:
    """Started processes (each in its own session, each ended by SIGTERM if the test process dies) and the files to
    remove; `close()` kills and cleans all."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.started = time.time()

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        logf = open(os.path.join(self.workdir, f"{name}.log"), "wb")
        # vLLM leaves rendezvous files in TMPDIR: keep them in the work directory, removed with it.
        full_env = dict(os.environ, TMPDIR=self.workdir)
        if env:
            full_env.update(env)
        p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                             cwd=self.workdir, preexec_fn=tie_to_parent)
        self.procs[name] = p
        return p

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs.pop(name, None)
        if p is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def tail(self, name: str, lines: int = 40) -> str:
        path = os.path.join(self.workdir, f"{name}.log")
        if not os.path.exists(path):
            return ""
        with open(path, "rb") as f:
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        for name in list(self.procs):
            p = self.procs[name]
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 10
        for name in list(self.procs):
            p = self.procs[name]
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.time()))
            self.kill(name)
        # vLLM's CPU build leaves its distributed rendezvous files behind; remove the ones made during this run.
        for pattern in ("/tmp/vllm_dist_*", "/dev/shm/vllm_dist_*"):
            for path in glob.glob(pattern):
                with contextlib.suppress(OSError):
                    if os.stat(path).st_mtime >= self.started - 1:
                        if os.path.isdir(path):
                            shutil.rmtree(path, ignore_errors=True)
                        else:
                            os.unlink(path)
        # A killed engine also leaves the POSIX shared memory of its workers' message queues (Python's
        # multiprocessing: psm_*, sem.mp-*), 160-250 MiB each: remove those made during this run that no live
        # process maps or holds open (an engine of another test running at the same time keeps its own).
        made = [f for f in glob.glob("/dev/shm/psm_*") + glob.glob("/dev/shm/sem.mp-*")
                if _mtime(f) >= self.started - 1]
        if made:
            used = _shm_in_use()
            for path in made:
                if _shm_inode(path) not in used:
                    with contextlib.suppress(OSError):
                        os.unlink(path)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _shm_inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except OSError:
        return -1


def _shm_in_use() -> set[int]:
    """Inodes of files under /dev/shm that some process maps or has open (read from /proc; what cannot be read is
    skipped). By inode, not name: glibc's sem_open maps a temporary file and then links it under the semaphore's
    name, so a live semaphore shows in /proc/PID/maps under the temporary (deleted) name only."""
    used: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        fields = line.split(None, 5)  # address perms offset dev inode path
                        with contextlib.suppress(IndexError, ValueError):
                            used.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                        used.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    return used


def wait_for(what: str, fn, timeout: float, procs: Procs | None = None, watch: list[str] | None = None,
             interval: float = 0.5):
    """Polls fn() until it returns a truthy value; fails early when a watched process died."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        for name in watch or []:
            if procs is not None and not procs.alive(name):
                raise RuntimeError(f"{what}: process {name} exited; its log ends with:\n{procs.tail(name)}")
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - keep polling, report the last error on timeout
            last = e
        time.sleep(interval)
    raise TimeoutError(f"{what}: not ready after {timeout:.0f}s (last error: {last})")


def read_port_file(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def workdir(prefix: str, keep: bool = False):
    d = tempfile.mkdtemp(prefix=prefix)
    try:
        yield d
    finally:
        if keep:
            log(f"kept work directory {d}")
        else:
            shutil.rmtree(d, ignore_errors=True)


def fail(msg: str) -> None:
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


class Checks:
    """Named checks that all run, each printed as it is made; `verdict()` is the exit status (1 if any failed).

        check = Checks()
        check(rc == 0, "the daemon exits 0")
        return check.verdict()
    """

    def __init__(self):
        self.failures: list[str] = []

    def __call__(self, cond, what: str) -> bool:
        print(("ok   " if cond else "FAIL ") + what, flush=True)
        if not cond:
            self.failures.append(what)
        return bool(cond)

    def verdict(self) -> int:
        if self.failures:
            print(f"FAIL: {len(self.failures)} checks failed")
            return 1
        print("PASS")
        return 0


def last_update_record(bin_dir: str, coordinator: str) -> dict:
    """The newest record of `wsyncctl history` ({} when there is none or the call failed)."""
    h = subprocess.run([f"{bin_dir}/wsyncctl", "history", "-w", "json", "--endpoints", coordinator],
                       capture_output=True, text=True, timeout=30)
    recs = json.loads(h.stdout).get("records", []) if h.returncode == 0 and h.stdout.strip() else []
    return recs[-1] if recs else {}
