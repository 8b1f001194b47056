#!/usr/bin/env python3
"""FP8 quantization on the trainer's GPU before the device-to-host copy, end to end on one box.

Coordinator, a reference engine at TP 2 whose model is FP8 block-quantized (tests/data/tiny/qwen3-fp8-tiny.json,
32x32 blocks), a target and a source wsyncd on 127.0.0.1 (tests/client/python_client_test.py's cluster). The source's
begin_push offers the linear weights for pre-quantization; then
  update 1: the Python client, Trainer(gpu_fp8=True), pushes torch CUDA bf16 tensors: every offered one is quantized
            on the GPU with torch (wsync_client.fp8) and pushed as codes + `_scale_inv`;
  update 2: the C++ client (wsync-trainer-demo --prequantize gpu: TrainerClient::PushDevice with gpu_fp8, the CUDA
            kernel replica/fp8_cuda.cu) does the same from cudaMalloc'd tensors;
after each commit the engine checks every byte (codes and scales included) against its own naive FP8 encoder
(wsyncctl verify; nothing shared with either quantizer), and rejects the next step, so the check can fail. The
device-to-host bytes of the quantized tensors are compared with their bf16 size.
Exit 0 pass, 1 fail, 77 no CUDA device.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client"))
if not os.path.exists("/dev/nvidia0") and not os.path.exists("/dev/nvidiactl"):
    print("SKIP: no CUDA device on this machine (/dev/nvidia0 absent)")
    sys.exit(77)
try:
    import numpy as np
    import torch
except ImportError as e:
    print("FAIL: a CUDA device is present but %s (run with a python that has numpy and torch)" % e)
    sys.exit(1)
import python_client_test as pct  # noqa: E402
pct.np = np
try:
    import wsync_client  # noqa: F401
except ImportError as e:
    print("FAIL: the wsync_client package is not installed in %s (%s)" % (sys.executable, e))
    sys.exit(1)

DEADLINE_S = 120
check = pct.check


def to_cuda(bits):
    return torch.from_numpy(bits.view(np.int16)).cuda().view(torch.bfloat16)


def run(args, cluster, deadline):
    from wsync_client import Coordinator, Trainer

    work = cluster.work
    with open(args.model) as f:
        specs = pct.qwen3_checkpoint(json.load(f))
    coord_addr, engine_addr, _, sock = pct.start_one_box(args, cluster, deadline, args.model, "cudafp8",
                                                         ["--ring-mib", "16"])

    def verify(step, want_ok):
        r = subprocess.run([args.wsyncctl, "verify", "--engine", engine_addr, "--step", str(step)],
                           capture_output=True, text=True, timeout=30)
        print(r.stdout.strip())
        check((r.returncode == 0) == want_ok, "engine %s step %d (wsyncctl rc %d %s)"
              % ("verifies" if want_ok else "rejects", step, r.returncode, r.stderr.strip()))

    # Update 1: the Python client's torch quantizer on the GPU.
    with Coordinator(coord_addr) as coord, Trainer(sock, local_rank=0, global_rank=0, gpu_fp8=True) as trainer:
        version = 1
        coord.begin_update(version)
        names = trainer.begin_push(version)
        offered = trainer.fp8_tensors()
        check(len(offered) >= 14, "begin_push offers %d of %d tensors for FP8 (2 layers x 7 linear weights)"
              % (len(offered), len(names)))
        check(all(len(specs[n]) == 2 for n in offered), "only 2-D weights are offered")
        tensors = {n: to_cuda(pct.generate_bf16(n, version, specs[n])) for n in names}
        torch.cuda.synchronize()
        t0 = time.monotonic()
        for n in names:
            trainer.push(n, tensors[n])
        trainer.end_push(version)
        st = trainer.stats()
        bf16_bytes = sum(2 * int(np.prod(specs[n])) for n in names)
        check(st["fp8_quantized"] == len(offered) and st["tensors"] == len(names),
              "%d tensors pushed, %d quantized on the GPU, in %.3f s" % (st["tensors"], st["fp8_quantized"],
                                                                      time.monotonic() - t0))
        fp8_bf16 = sum(2 * int(np.prod(specs[n])) for n in offered)
        check(st["bytes"] < bf16_bytes - fp8_bf16 * 0.45,
              "device-to-host bytes %d vs %d as bf16 (the %d quantized tensors' %d bf16 bytes about halved)"
              % (st["bytes"], bf16_bytes, len(offered), fp8_bf16))
        rec = coord.commit_update(version, timeout=30)
        check(rec.get("success") is True, "update %d committed: %s" % (version, rec.get("error") or "success"))
    verify(1, True)
    verify(2, False)

    # Update 2: the C++ client's CUDA kernel (TrainerClient::PushDevice with gpu_fp8), driven by the demo trainer.
    r = subprocess.run([args.trainer_demo, "--daemon", sock, "--model", args.model, "--prequantize", "gpu",
                        "--first-version", "2", "--updates", "1", "--drive", "--coordinator", coord_addr,
                        "--verify-engine", engine_addr], capture_output=True, text=True, timeout=60)
    print(r.stdout.strip())
    m = re.search(r"update 2: (\d+) tensors pushed pre-quantized to FP8 \(gpu; (\d+) offered\)", r.stdout)
    check(r.returncode == 0, "C++ client update 2 (rc %d) %s" % (r.returncode, r.stderr.strip()[-400:]))
    check(m is not None and int(m.group(1)) == int(m.group(2)) >= 14,
          "the C++ client quantized every offered tensor on the GPU (%s)" % (m.group(0) if m else "no report"))
    check("verified bit-exact" in r.stdout, "engine verified update 2")
    verify(2, True)
    verify(3, False)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    for a in ("coordinator", "wsyncd", "engine-ref", "wsyncctl", "trainer-demo", "model"):
        ap.add_argument("--" + a, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 77
    deadline = time.monotonic() + DEADLINE_S
    work = tempfile.mkdtemp(prefix="wsync-cudafp8.", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cluster = pct.Cluster(args, work)
    watchdog = threading.Timer(DEADLINE_S, cluster.stop)
    watchdog.daemon = True
    watchdog.start()
    rc = 0
    try:
        run(args, cluster, deadline)
        print("PASS")
    except Exception:
        traceback.print_exc()
        for name, _ in cluster.procs:
            print("--- %s log (tail)\n%s" % (name, cluster.log(name)))
        print("FAIL")
        rc = 1
    finally:
        watchdog.cancel()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
