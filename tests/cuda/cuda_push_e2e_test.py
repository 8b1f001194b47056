#!/usr/bin/env python3
"""A complete update on one box whose trainer rank pushes torch CUDA tensors (issue 10).

Coordinator, a reference engine at TP 2, a target and a source wsyncd on 127.0.0.1 (the cluster of
tests/client/python_client_test.py, whose helpers this reuses); the trainer generates every tensor with the
independent numpy port of the weight generator, moves it to the GPU and pushes the CUDA tensor (one asynchronous
device-to-host copy into the ring each, page-locked once). After the commit the engine verifies bit-exactly
(wsyncctl verify) with its own loader, and rejects the next step (so the check can fail). Then: bad input (a tensor
on the meta device, a dtype of another element size) is refused naming the tensor, nothing of it pushed; a second
update pushes tensors still being produced on a side stream (their last write queued right before the push), one of
them as a non-contiguous view the client gathers, verified again. Exit 0 pass, 1 fail, 77 no torch / no CUDA device.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client"))
# wsync_client comes installed (its wheel carries the generated gRPC stubs; the source tree has none), never from
# client/python.
# Skip only for what this machine cannot have: a CUDA device. With a GPU, a missing numpy/torch is a failure.
if not os.path.exists("/dev/nvidia0") and not os.path.exists("/dev/nvidiactl"):
    print("SKIP: no CUDA device on this machine (/dev/nvidia0 absent)")
    sys.exit(77)
try:
    import numpy as np
    import torch
except ImportError as e:
    print("FAIL: a CUDA device is present but %s (run with a python that has numpy and torch)" % e)
    sys.exit(1)
import python_client_test as pct  # noqa: E402  (Cluster, generator, checkpoint shapes)
pct.np = np  # the helpers' numpy (that test imports it only in its venv stage)
try:
    import wsync_client  # noqa: F401
except ImportError as e:
    print("FAIL: the wsync_client package is not installed in %s (%s): it is a wheel whose gRPC stubs are generated "
          "at build time; install it (pip install client/python, or the wheel built on the build machine)"
          % (sys.executable, e))
    sys.exit(1)

DEADLINE_S = 90
check = pct.check


def to_cuda(bits):
    """uint16 bf16 bits (numpy) → a torch bfloat16 CUDA tensor holding exactly those bits."""
    return torch.from_numpy(bits.view(np.int16)).cuda().view(torch.bfloat16)


def run(args, cluster, deadline):
    from wsync_client import Coordinator, Trainer, WsyncError
    import json

    work = cluster.work
    with open(args.model) as f:
        specs = pct.qwen3_checkpoint(json.load(f))
    coord_addr, engine_addr, _, source_addr = pct.start_one_box(args, cluster, deadline, args.model, "cudapush",
                                                                ["--ring-mib", "16"])

    def verify(step, want_ok):
        r = subprocess.run([args.wsyncctl, "verify", "--engine", engine_addr, "--step", str(step)],
                           capture_output=True, text=True, timeout=30)
        print(r.stdout.strip())
        check((r.returncode == 0) == want_ok, "engine %s step %d (wsyncctl rc %d %s)"
              % ("verifies" if want_ok else "rejects", step, r.returncode, r.stderr.strip()))

    with Coordinator(coord_addr) as coord, Trainer(source_addr, local_rank=0, global_rank=0) as trainer:
        version = 1
        coord.begin_update(version)
        names = trainer.begin_push(version)
        tensors = {n: to_cuda(pct.generate_bf16(n, version, specs[n])) for n in names}
        torch.cuda.synchronize()
        t0 = time.monotonic()
        for name in names:
            trainer.push(name, tensors[name])
        trainer.end_push(version)
        push_s = time.monotonic() - t0
        stats = trainer.stats()
        check(stats["tensors"] == len(specs), "%d CUDA tensors pushed (%d bytes, %d buckets) in %.3f s"
              % (stats["tensors"], stats["bytes"], stats["buckets"], push_s))
        rec = coord.commit_update(version, timeout=30)
        check(rec.get("success") is True, "update %d committed: %s" % (version, rec.get("error") or "success"))
        verify(version, True)
        verify(version + 1, False)

        # Bad input is refused naming the tensor, before anything of it is written: a tensor on a device the client
        # cannot copy from, and a dtype whose element size is not the tensor's.
        version = 2
        coord.begin_update(version)
        names = trainer.begin_push(version)
        two_d = [n for n in names if len(specs[n]) == 2 and specs[n][0] != specs[n][1]][0]
        before = trainer.stats()["tensors"]
        for bad, dtype, why in ((torch.empty(specs[two_d], dtype=torch.bfloat16, device="meta"), None, "is on the meta device"),
                                (torch.zeros(specs[two_d], dtype=torch.bfloat16, device="cuda"), "float32",
                                 "4-byte elements")):
            try:
                trainer.push(two_d, bad, dtype=dtype)
                check(False, "a tensor %s is refused" % why)
            except WsyncError as e:
                check(e.code == 3 and two_d in e.message and why in e.message, "refused: %s" % e)
        check(trainer.stats()["tensors"] == before, "nothing of a refused tensor was pushed")

        # Tensors still being produced: each one's bytes are written on a side stream right before its push (from a
        # zeroed tensor), so a copy not ordered after the producer's stream would read zeros.
        side = torch.cuda.Stream()
        keep = []
        for name in names:
            src = to_cuda(pct.generate_bf16(name, version, specs[name]))
            dst = torch.zeros_like(src)
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                torch.cuda._sleep(200000)  # ~0.1 ms of GPU time ahead of the write
                dst.copy_(src)
                if name == two_d:
                    # A non-contiguous CUDA tensor (column-major, the same values): the client gathers it into the
                    # ring slot (client/python/README.md); the engine's check below sees the row-major bytes.
                    dst = dst.t().contiguous().t()
                    check(not dst.is_contiguous(), "tensor %s pushed as a non-contiguous view" % name)
                trainer.push(name, dst)  # ordered after `side`, the current stream here
            keep.append((src, dst))
        trainer.end_push(version)
        rec = coord.commit_update(version, timeout=30)
        check(rec.get("success") is True, "update %d (tensors produced on a side stream) committed" % version)
        verify(version, True)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    for a in ("coordinator", "wsyncd", "engine-ref", "wsyncctl", "lib", "model"):
        ap.add_argument("--" + a, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 77
    os.environ["WSYNC_CLIENT_LIB"] = args.lib
    deadline = time.monotonic() + DEADLINE_S
    work = tempfile.mkdtemp(prefix="wsync-cudapush.", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
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
