"""numpy model of the trainer demo's deterministic weights (tools/testdata/weight_gen.cc), written again from its rule so the
broadcast baseline's receivers check what they got against an expectation that shares no code with the sender.

Rule: seed = splitmix64(h(name) ^ splitmix64(step)), h an FNV-1a 64 over the UTF-8 name whose offset basis is
1469598103934665603 (the C++ constant: the standard basis with its last digit dropped); for every group of 4 elements starting at index i,
r = splitmix64(seed + i) gives 4 little-endian 16-bit lanes, one per element. A lane l becomes the bf16 pattern
(l & 0x807F) | ((0x77 + ((l >> 7) & 7)) << 7); float32 elements are that bf16 pattern << 16.
"""

import numpy as np

_M64 = (1 << 64) - 1
_U = np.uint64


def _splitmix_int(x):
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _splitmix_np(x):
    with np.errstate(over="ignore"):
        x = x + _U(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U(30))) * _U(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U(27))) * _U(0x94D049BB133111EB)
        return x ^ (x >> _U(31))


def tensor_seed(name, step):
    h = 1469598103934665603
    for b in name.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & _M64
    return _splitmix_int(h ^ _splitmix_int(step & _M64))


def bf16_bits(name, step, n):
    """The n bf16 bit patterns (uint16) of tensor `name` at `step`."""
    groups = (n + 3) // 4
    with np.errstate(over="ignore"):
        r = _splitmix_np(_U(tensor_seed(name, step)) + np.arange(groups, dtype=_U) * _U(4))
    lanes = r.astype("<u8").view("<u2")[:n]
    return (lanes & np.uint16(0x807F)) | ((np.uint16(0x77) + ((lanes >> np.uint16(7)) & np.uint16(7))) << np.uint16(7))


def generate(name, step, dtype, shape):
    """numpy array of the tensor (bf16 as uint16 bit patterns, float32 as uint32 bit patterns)."""
    n = 1
    for d in shape:
        n *= int(d)
    bits = bf16_bits(name, step, n)
    if dtype == "bfloat16":
        return bits.reshape(shape)
    if dtype == "float32":
        return (bits.astype(np.uint32) << np.uint32(16)).reshape(shape)
    raise ValueError(f"no generation rule for dtype {dtype} ({name})")
