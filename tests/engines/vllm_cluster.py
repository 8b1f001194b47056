"""A wsync cluster around real vLLM servers on 127.0.0.1: checkpoints, vLLM launch lines, the wsync daemons, the
trainer push. Shared by tests/engines/vllm_e2e_test.py and bench/engine/vllm_update_bench.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import harness
from harness import http

PROMPTS = [[1, 17, 300, 3242, 99, 512], [7, 7, 7, 1000, 2, 4000, 31], [123, 456, 789]]
MAX_TOKENS = 12


# --- checkpoints ---------------------------------------------------------------------------------------------------

def make_checkpoint(model: str, out: str, seed: int, layers: int = 2) -> dict:
    """A random-weight checkpoint of the tiny test model (tools/testing/engines/make_checkpoint.py; the same model for every
    seed, new values). Returns its tensors {name: torch tensor}, which the trainer pushes."""
    write_checkpoint(model, out, seed, layers)
    return load_checkpoint(out)


def write_checkpoint(model: str, out: str, seed: int, layers: int = 2) -> None:
    script = os.path.join(harness.REPO, "tools", "testing", "engines", "make_checkpoint.py")
    if model == "qwen3":
        argv = ["--config", os.path.join(harness.REPO, "tests/data/models/Qwen__Qwen3-0.6B/config.json"),
                "--layers", str(layers)]
    else:
        argv = ["--config", os.path.join(harness.REPO, "tests/data/models/Qwen__Qwen3-30B-A3B/config.json"),
                "--layers", str(layers), "--experts", "8", "--experts-per-tok", "2", "--hidden", "256",
                "--moe-intermediate", "128", "--intermediate", "512", "--heads", "4", "--kv-heads", "2",
                "--head-dim", "64", "--vocab", "4096"]
    subprocess.run([sys.executable, script, *argv, "--seed", str(seed), "--out", out], check=True)


def load_checkpoint(out: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, f)))
    return tensors


# --- vLLM ------------------------------------------------------------------------------------------------------------

def vllm_argv(python: str, model_dir: str, port: int, backend: bool) -> list[str]:
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
            "--model", model_dir, "--served-model-name", "m", "--dtype", "bfloat16", "--max-model-len", "256",
            "--enforce-eager", "--skip-tokenizer-init", "--max-num-seqs", "8"]
    if backend:
        argv += ["--weight-transfer-config", json.dumps({"backend": "wsync"})]
    return argv


def vllm_env(cpu: str, extra: dict | None = None) -> dict:
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": cpu, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false"}
    env.update(extra or {})
    return env


def generate(base: str, prompts: list[list[int]] | None = None) -> list[list[int]]:
    out = []
    for p in PROMPTS if prompts is None else prompts:
        r = http("POST", f"{base}/v1/completions", {"model": "m", "prompt": p, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0.0, "return_token_ids": True,
                                                     "ignore_eos": True}, timeout=120)
        ch = r["choices"][0]
        ids = ch.get("token_ids")
        if ids is None:
            raise RuntimeError(f"completion without token_ids: {json.dumps(ch)[:500]}")
        out.append(list(ids))
    return out


def checksums(base: str) -> dict:
    r = http("POST", f"{base}/weight_checker", {"action": "checksum"}, timeout=120)
    return r["checksums"]


# --- the test --------------------------------------------------------------------------------------------------------

class Cluster:
    def __init__(self, args, wd: str, procs: harness.Procs):
        self.args, self.wd, self.procs = args, wd, procs
        self.coord_addr = ""
        self.source_addr = ""
        self.a = self.b = ""

    def start_coordinator(self):
        pf = os.path.join(self.wd, "coord.port")
        self.procs.start("coordinator", [os.path.join(self.args.bin, "wsync-coordinator"), "--listen",
                                         "127.0.0.1:0", "--port-file", pf])
        port = harness.wait_for("coordinator", lambda: harness.read_port_file(pf), 30, self.procs, ["coordinator"])
        self.coord_addr = f"127.0.0.1:{port}"

    def start_source(self):
        pf = os.path.join(self.wd, "source.port")
        if os.path.exists(pf):
            os.unlink(pf)
        self.procs.start("source", [os.path.join(self.args.bin, "wsyncd"), "--listen", "127.0.0.1:0", "--role", "source", "--node-id",
                                    "trainer-node-0", "--coordinator", self.coord_addr, "--trainer-ranks", "1",
                                    "--trainer-socket", os.path.join(self.wd, "source.sock"), "--port-file", pf])
        harness.wait_for("source wsyncd", lambda: harness.read_port_file(pf), 60, self.procs, ["source"])
        self.source_addr = os.path.join(self.wd, "source.sock")  # trainer ranks use the daemon's local socket

    def start_target(self, vllm_port: int):
        pf = os.path.join(self.wd, "target.port")
        sock = os.path.join(self.wd, "target.sock")
        self.procs.start("target", [os.path.join(self.args.bin, "wsyncd"), "--listen", "127.0.0.1:0", "--role", "target", "--node-id",
                                    "inference-node-0", "--coordinator", self.coord_addr, "--engine-socket", sock,
                                    "--engine", f"vllm+http://127.0.0.1:{vllm_port}?mode={self.args.mode}&id=vllm-a",
                                    "--port-file", pf])
        harness.wait_for("target wsyncd (vLLM attach)", lambda: harness.read_port_file(pf), 180, self.procs,
                         ["target", "vllm-a"])


def push_update(trainer_cls, source_addr: str, version: int, tensors: dict, stop_after: int | None = None):
    with trainer_cls(source_addr, timeout=120.0) as t:
        names = t.begin_push(version)
        missing = [n for n in names if n not in tensors]
        if missing:
            raise RuntimeError(f"the push filter names tensors the checkpoint lacks: {missing[:5]}")
        for i, n in enumerate(names):
            if stop_after is not None and i == stop_after:
                return len(names)
            t.push(n, tensors[n])
        t.end_push(version)
        return len(names)


