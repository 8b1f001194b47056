#!/usr/bin/env python3
"""The reference engine's load entry point (wsync-engine-ref --load-socket), which the broadcast baseline of
bench/cluster loads through: full HF tensors handed over in a file are loaded with the engine's own loader and the
engine's Verify checks them bit-exactly.

For a dense and a MoE model (TP=2, the MoE also EP=2): before any load the check fails; after loading both ranks
from bench_cluster_weights' dump of step 5 it passes for step 5 and fails for step 6; one flipped byte in the file
fails it naming the parameter; a tensor missing from the request, an unknown rank, a tensor outside the file, a
dtype the model does not have and a malformed request are refused naming what is wrong; only the engine's user may use the socket.

    engine_load_test.py --bin BUILD/bin
"""

import argparse
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODELS = [("dense", os.path.join(ROOT, "tests", "data", "tiny", "qwen3-tiny.json"), 1),
          ("moe", os.path.join(ROOT, "tests", "data", "tiny", "qwen3-moe-tiny.json"), 2)]


class Failed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failed(what)
    print(f"ok: {what}", flush=True)


def request(path, req):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(path)
        s.sendall((req if isinstance(req, str) else json.dumps(req)).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise Failed(f"the engine closed the load socket without answering {req}")
            buf += chunk
    return json.loads(buf)


def run_model(a, tmp, label, model, ep):
    dump = os.path.join(tmp, f"{label}.bin")
    subprocess.run([os.path.join(a.bin, "bench_cluster_weights"), "--model", model, "--step", "5", "--out", dump],
                   check=True)
    with open(dump + ".json") as f:
        tensors = json.load(f)["tensors"]
    sock = os.path.join(tmp, f"{label}.sock")
    log = open(os.path.join(tmp, f"{label}-engine.log"), "wb")
    eng = subprocess.Popen([os.path.join(a.bin, "wsync-engine-ref"), "--id", label, "--model", model, "--tp", "2",
                            "--ep", str(ep), "--listen", "127.0.0.1:0", "--insecure", "--load-socket", sock],
                           stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while not os.path.exists(sock):
            if eng.poll() is not None or time.time() > deadline:
                raise Failed(f"{label}: the engine did not open its load socket (exit {eng.poll()})")
            time.sleep(0.05)
        expect(stat.S_IMODE(os.stat(sock).st_mode) & 0o077 == 0,
               f"{label}: only the engine's user may use the load socket (mode {stat.S_IMODE(os.stat(sock).st_mode):o})")
        v = request(sock, {"type": "verify", "step": 5})
        expect(not v["ok"] and v["mismatches"], f"{label}: before any load the engine's check fails")
        for r in range(2):
            rep = request(sock, {"type": "load", "rank": r, "file": dump, "tensors": tensors})
            expect(rep.get("ok") and rep["params"] > 0, f"{label}: rank {r} loaded {rep.get('params')} params "
                   f"({rep.get('error', '')})")
        v = request(sock, {"type": "verify", "step": 5})
        expect(v["ok"] and v["ranks"] == 2 and v["params_checked"] > 0,
               f"{label}: step 5 verifies bit-exactly ({v['params_checked']} params on {v['ranks']} ranks)")
        v = request(sock, {"type": "verify", "step": 6})
        expect(not v["ok"], f"{label}: the same memory does not pass for step 6")

        # One flipped byte in the middle of the last layer's o_proj.
        t = next(x for x in reversed(tensors) if x["name"].endswith("o_proj.weight"))
        bad = os.path.join(tmp, f"{label}-bad.bin")
        with open(dump, "rb") as f:
            data = bytearray(f.read())
        data[t["offset"] + t["bytes"] // 2] ^= 0x40
        with open(bad, "wb") as f:
            f.write(data)
        for r in range(2):
            expect(request(sock, {"type": "load", "rank": r, "file": bad, "tensors": tensors}).get("ok"),
                   f"{label}: rank {r} loads the altered file")
        v = request(sock, {"type": "verify", "step": 5})
        layer = t["name"].split(".self_attn")[0]
        expect(not v["ok"] and any(layer + ".self_attn.o_proj.weight" in m for m in v["mismatches"]),
               f"{label}: one flipped byte fails the check naming {layer}.self_attn.o_proj.weight ({v['mismatches']})")

        missing = [x for x in tensors if not x["name"].endswith("model.norm.weight")]
        rep = request(sock, {"type": "load", "rank": 0, "file": dump, "tensors": missing})
        expect(not rep["ok"] and "model.norm.weight" in rep["error"],
               f"{label}: a missing tensor is refused naming it ({rep.get('error')})")
        rep = request(sock, {"type": "load", "rank": 7, "file": dump, "tensors": tensors})
        expect(not rep["ok"] and "rank 7" in rep["error"], f"{label}: rank 7 is refused ({rep.get('error')})")
        far = [dict(x, offset=x["offset"] + os.path.getsize(dump)) if i == 0 else x for i, x in enumerate(tensors)]
        rep = request(sock, {"type": "load", "rank": 0, "file": dump, "tensors": far})
        expect(not rep["ok"] and tensors[0]["name"] in rep["error"] and "outside" in rep["error"],
               f"{label}: a tensor outside the file is refused naming it ({rep.get('error')})")
        f32 = [dict(x, dtype="float32") if i == 0 else x for i, x in enumerate(tensors)]
        rep = request(sock, {"type": "load", "rank": 0, "file": dump, "tensors": f32})
        expect(not rep["ok"] and "float32" in rep["error"], f"{label}: a dtype the model lacks is refused "
               f"({rep.get('error')})")
        rep = request(sock, "not json")
        expect(not rep["ok"], f"{label}: a malformed request is refused ({rep.get('error')})")
        rep = request(sock, {"type": "load", "rank": 0, "file": os.path.join(tmp, "nope"), "tensors": tensors})
        expect(not rep["ok"] and "nope" in rep["error"], f"{label}: a missing file is refused ({rep.get('error')})")
        # The engine still loads and verifies after all that.
        for r in range(2):
            request(sock, {"type": "load", "rank": r, "file": dump, "tensors": tensors})
        expect(request(sock, {"type": "verify", "step": 5})["ok"], f"{label}: a good load after the refusals verifies")
    finally:
        eng.terminate()
        try:
            eng.wait(10)
        except subprocess.TimeoutExpired:
            eng.kill()
            eng.wait()
        log.close()
    expect(eng.returncode == 0, f"{label}: the engine shut down cleanly (exit {eng.returncode})")
    expect(not os.path.exists(sock), f"{label}: the load socket is removed on shutdown")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="wsync-engine-load-") as tmp:
        try:
            for label, model, ep in MODELS:
                run_model(a, tmp, label, model, ep)
        except (Failed, subprocess.CalledProcessError) as e:
            print(f"FAIL: {e}", flush=True)
            for n in os.listdir(tmp):
                if n.endswith(".log"):
                    with open(os.path.join(tmp, n), errors="replace") as f:
                        print(f"--- {n}\n" + "".join(f.readlines()[-20:]))
            return 1
    print("engine_load_test: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
