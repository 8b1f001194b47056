#!/usr/bin/env python3
"""The Python client's torch FP8 block quantizer (wsync_client.fp8, what Trainer(gpu_fp8=True) runs on a trainer's
GPU) against the independent numpy model of wsync's convention (tests/replica/golden_oracle.py, which
replica_golden_test pins bit for bit to the C++ CPU quantizer): codes and scales must be identical, byte for byte.

Inputs: bfloat16, float16 and float32; 128x128, 64x64 and 32x32 blocks, float32 and UE8M0 scales; shapes with
partial edge blocks; values over many decades, zeros and -0, subnormals, ±inf, NaN of both signs, all-zero blocks.
Runs on the CPU always and on every CUDA device torch sees (the GPU run is the one that matters for gpu_fp8: torch's
CUDA division and float8 conversion must give the CPU's bits).

  PY tests/client/fp8_quantizer_test.py [--device cpu|cuda|all]     (PY: a python with torch and numpy)
Exit 0 pass, 1 fail.
"""
import argparse
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# --device cuda on a machine without a GPU (CI) is a skip, decided before torch/numpy are needed: the Python that
# runs the cuda-labelled tests there has neither.
if "cuda" in sys.argv[1:] and "all" not in sys.argv[1:] and not os.path.exists("/dev/nvidia0") \
        and not os.path.exists("/dev/nvidiactl"):
    print("SKIP: no CUDA device on this machine (/dev/nvidia0 absent)")
    sys.exit(77)
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "replica"))
import golden_oracle as go  # noqa: E402


def load_quantizer():
    """wsync_client.fp8 as installed (the wheel), else the source tree's file (it imports nothing of the package)."""
    try:
        from wsync_client import fp8
        return fp8, "installed package"
    except ImportError:
        path = os.path.join(HERE, "..", "..", "client", "python", "wsync_client", "fp8.py")
        spec = importlib.util.spec_from_file_location("wsync_fp8", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, path


def inputs(rng):
    """(label, float32 numpy array) pairs; each is cast to the tested dtype (exactly representable there)."""
    out = []
    for n, k in ((256, 384), (200, 130), (130, 300), (7, 13), (1, 1)):
        x = (rng.standard_normal((n, k)) * np.exp(rng.uniform(-12, 6, (n, 1)))).astype(np.float32)
        x[rng.random((n, k)) < 0.01] = 0
        x[rng.random((n, k)) < 0.005] = -0.0
        out.append(("random %dx%d" % (n, k), x))
    x = (rng.standard_normal((192, 160)) * 1e-3).astype(np.float32)
    x[:64, :64] = 0  # an all-zero block: scale 1e-10/448, codes 0
    x[64:70, 0:5] = np.float32(2.0 ** -130)  # float32 subnormals (bf16 keeps them; f16 flushes them to 0)
    x[100, 100] = np.inf
    x[101, 3] = -np.inf
    x[120, 150] = np.nan
    x[130, 10] = np.float32(np.nan)
    x[131, 11] = np.float32(np.copysign(np.nan, -1.0))  # a negative NaN (float16/float32 keep its sign)
    x[140, 20] = np.float32(3e4)
    out.append(("specials", x))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="all", choices=("cpu", "cuda", "all"))
    args = ap.parse_args()
    fp8, where = load_quantizer()
    print("quantizer: %s; torch %s" % (where, torch.__version__))
    devices = ["cpu"] if args.device in ("cpu", "all") else []
    if args.device in ("cuda", "all"):
        if torch.cuda.is_available():
            devices += ["cuda:%d" % i for i in range(torch.cuda.device_count())]
        elif args.device == "cuda":
            if not os.path.exists("/dev/nvidia0") and not os.path.exists("/dev/nvidiactl"):
                print("SKIP: no CUDA device on this machine (/dev/nvidia0 absent)")
                return 77
            print("FAIL: --device cuda: a CUDA device is present but torch sees none")
            return 1
        else:
            print("(no CUDA device: CPU only)")
    rng = np.random.default_rng(11)
    cases = inputs(rng)
    bad = checked = 0
    for dev in devices:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for label, x in cases:
                t = torch.from_numpy(x).to(dtype)
                exact = t.float().numpy()  # the values the tensor holds, exactly
                for bn, bk in ((128, 128), (64, 64), (32, 32)):
                    for ue8m0 in (False, True):
                        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                            want_q, want_s = go.quantize_fp8_f32(exact, bn, bk, ue8m0)
                        q, s = fp8.quantize_fp8_block(t.to(dev), bn, bk, ue8m0)
                        q = q.view(torch.uint8).cpu().numpy()
                        s = s.cpu().numpy()
                        checked += 1
                        what = "%s %s %s %dx%d%s" % (dev, str(dtype).replace("torch.", ""), label, bn, bk,
                                                     " ue8m0" if ue8m0 else "")
                        if q.shape != want_q.shape or s.shape != want_s.shape:
                            print("FAIL %s: shapes %s/%s, expected %s/%s" % (what, q.shape, s.shape, want_q.shape,
                                                                              want_s.shape))
                            bad += 1
                            continue
                        dq = int((q != want_q).sum())
                        ds = int((s.view(np.uint32) != want_s.view(np.uint32)).sum())
                        if dq or ds:
                            i = np.argwhere(q != want_q)[:3].tolist()
                            print("FAIL %s: %d codes and %d scales differ (first codes at %s: got %s, want %s)"
                                  % (what, dq, ds, i, [int(q[a, b]) for a, b in i], [int(want_q[a, b]) for a, b in i]))
                            bad += 1
    # Bad input is refused with the reason.
    for bad_t, why in ((torch.zeros(4), "2-D"), (torch.zeros((4, 4), dtype=torch.int32), "bfloat16")):
        try:
            fp8.quantize_fp8_block(bad_t, 128, 128)
            print("FAIL: %s input accepted" % why)
            bad += 1
        except ValueError as e:
            if why not in str(e):
                print("FAIL: refusal of a non-%s input does not say so: %s" % (why, e))
                bad += 1
    print("%d cases on %s, %d differ" % (checked, ", ".join(devices), bad))
    print("FAIL" if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
