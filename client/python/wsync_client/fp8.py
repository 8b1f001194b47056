"""FP8 block quantization with torch, on the tensor's own device (a trainer's GPU), byte-identical to wsync's CPU
quantizer (replica/fp8.h) and to its CUDA kernel.

The convention (the one RL trainers use when they hand bf16 weights to SGLang as a DeepSeek-style FP8 checkpoint):
per block of block_n x block_k elements (edge blocks partial)
    amax  = max |x| over the block in float32, NaN elements ignored
    scale = max(amax, 1e-10) / 448            float32 division (UE8M0: rounded up to a power of two, on the bits)
    code  = e4m3fn(clamp(x / scale, ±448))    float32 division, round to nearest even
a NaN element keeps its sign (0x7F / 0xFF); a NaN the division creates (an inf in a block whose amax is inf) is
0xFF, the CPU's default NaN. Each step below is chosen to produce exactly these bits: divisions are tensor by tensor
(torch turns a division by a Python scalar into a multiplication by its reciprocal, which differs in the last bit),
NaNs are fixed up explicitly on the codes' bits.

Trainer(gpu_fp8=True) uses it for the CUDA tensors the daemon offers for pre-quantization (begin_push's FP8 hint).
"""

from typing import Tuple

E4M3_MAX = 448.0
AMAX_EPS = 1e-10


def quantize_fp8_block(x, block_n: int, block_k: int, ue8m0: bool = False) -> Tuple["object", "object"]:
    """(codes, scale_inv) of a 2-D bfloat16/float16/float32 torch tensor: codes torch.float8_e4m3fn of x's shape,
    scale_inv float32 [ceil(rows / block_n), ceil(cols / block_k)], both on x's device."""
    import torch

    if x.dim() != 2:
        raise ValueError("fp8 block quantization needs a 2-D tensor, got shape %s" % (tuple(x.shape),))
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError("fp8 block quantization takes bfloat16, float16 or float32, got %s" % x.dtype)
    if block_n <= 0 or block_k <= 0:
        raise ValueError("fp8 block size must be positive, got %dx%d" % (block_n, block_k))
    rows, cols = x.shape
    nr, nc = -(-rows // block_n), -(-cols // block_k)
    with torch.no_grad():
        xf = x.detach().float()  # exact for bfloat16 and float16
        nan_in = torch.isnan(xf)
        # The tensor padded to whole blocks and viewed as [block row, row, block col, col]: per-block reductions and
        # the division by each block's scale broadcast over it, with no per-element copy of the scales.
        padded = torch.zeros((nr * block_n, nc * block_k), dtype=torch.float32, device=x.device)
        padded[:rows, :cols] = xf
        blocks = padded.view(nr, block_n, nc, block_k)
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        # amax over the elements that exist, NaN ignored (padding zeros cannot raise a maximum of |x| >= 0).
        amax = torch.where(torch.isnan(blocks), zero, blocks.abs()).amax(dim=(1, 3))
        scale = torch.clamp(amax, min=AMAX_EPS) / torch.full_like(amax, E4M3_MAX)
        if ue8m0:
            bits = scale.view(torch.int32)
            exp = bits & 0x7F800000
            scale = torch.where((bits & 0x007FFFFF) == 0, exp, exp + 0x00800000).view(torch.float32)
        y = (blocks / scale[:, None, :, None]).view(nr * block_n, nc * block_k)[:rows, :cols]
        y = torch.clamp(y, -E4M3_MAX, E4M3_MAX)
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
        # The sign of a NaN from the input's own bits: a GPU's half/bfloat16 -> float conversion returns the canonical
        # (positive) NaN, the CPU's keeps the sign.
        negative = (x.detach().view(torch.int16) if x.element_size() == 2 else x.detach().view(torch.int32)) < 0
        nan_code = torch.where(negative, torch.full_like(codes, 0xFF), torch.full_like(codes, 0x7F))
        codes = torch.where(nan_in, nan_code, codes)
        codes = torch.where(torch.isnan(y) & ~nan_in, torch.full_like(codes, 0xFF), codes)
        return codes.view(torch.float8_e4m3fn), scale.contiguous()
