#!/usr/bin/env python3
"""A small engine rank holding its parameters in CUDA memory (PyTorch), for tests/cuda/cuda_segment_test.

It speaks the attach protocol (docs/engines.md): two `cuda` segments exported with legacy CUDA IPC handles (the
caching allocator's cudaMalloc blocks, exported through the driver API with the segment's offset inside the
allocation; segment 1 starts 1 MiB into its block), no file descriptors. On every {"type": "commit", "version": V} it checks
the whole of both segments on the GPU against its own expectation for V, computed here with numpy (parameter bytes
from a splitmix64 stream, zeros between parameters), and appends one JSON line to --result.

--handoff FILE: write the attach message to FILE and exit instead (the test then presents the handles of a dead
process). Exit 77 when torch or a CUDA device is missing.
"""

import argparse
import ctypes
import json
import socket
import struct
import sys

try:
    import numpy as np
    import torch
except ImportError as e:
    print("SKIP: %s" % e)
    sys.exit(77)

MIB = 1 << 20
# (name, torch dtype, shape, segment); offsets are assigned below (64-byte aligned, gaps between parameters).
PARAMS = [
    ("embed.weight", torch.bfloat16, (8192, 4100), 0),  # 64 MiB: more than the target's 16 staging chunks
    ("norm.weight", torch.float32, (4097,), 0),
    ("odd.weight", torch.float16, (7, 13), 0),
    ("proj.weight", torch.bfloat16, (1000, 384), 1),
    ("proj.bias", torch.float32, (385,), 1),
    ("tail.weight", torch.uint8, (4 * MIB + 3,), 1),
]
SEG1_SKIP = MIB  # segment 1 starts this far into its allocation
U64 = np.uint64


def splitmix(x):
    with np.errstate(over="ignore"):
        x = x + U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> U64(30))) * U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> U64(27))) * U64(0x94D049BB133111EB)
        return x ^ (x >> U64(31))


def expected_bytes(version, index, nbytes):
    """Bytes of parameter `index` at `version`: word k of the stream is splitmix64(seed + k), little-endian."""
    seed = splitmix(np.array([version * 1000003 + index], dtype=np.uint64))[0]
    words = (nbytes + 7) // 8
    with np.errstate(over="ignore"):
        k = np.arange(words, dtype=np.uint64) + seed
    return splitmix(k).view(np.uint8)[:nbytes]


def layout():
    """(params with segment/offset/bytes, segment sizes)."""
    out, ends = [], {0: 0, 1: 0}
    for name, dt, shape, seg in PARAMS:
        nbytes = int(np.prod(shape)) * torch.tensor([], dtype=dt).element_size()
        off = (ends[seg] + 4096 + 63) // 64 * 64  # a gap before each parameter: it must stay zero
        out.append({"name": name, "dtype": str(dt).replace("torch.", ""), "shape": list(shape), "segment": seg,
                    "offset": off, "bytes": nbytes})
        ends[seg] = off + nbytes
    return out, {s: e + 4096 for s, e in ends.items()}


def send_frame(sock, obj):
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def recv_frame(sock):
    hdr = b""
    while len(hdr) < 4:
        chunk = sock.recv(4 - len(hdr))
        if not chunk:
            return None
        hdr += chunk
    (n,) = struct.unpack("<I", hdr)
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


_cuda = None


def export(t):
    """(IPC handle hex, offset of t's first byte inside the cudaMalloc allocation the handle names), through the
    driver API (torch has made its primary context current): the allocation's range, then its legacy handle."""
    global _cuda
    if _cuda is None:
        _cuda = ctypes.CDLL("libcuda.so.1")
    ptr = t.data_ptr()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise RuntimeError("cuMemGetAddressRange(0x%x) failed: CUresult %d" % (ptr, rc))
    handle = (ctypes.c_char * 64)()
    rc = _cuda.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base.value))
    if rc != 0:
        raise RuntimeError("cuIpcGetMemHandle(0x%x) failed: CUresult %d (a VMM/expandable-segments allocation has "
                           "no legacy IPC handle)" % (base.value, rc))
    return bytes(handle).hex(), ptr - base.value


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--kind", default="fake")
    ap.add_argument("--result", required=True)
    ap.add_argument("--handoff", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 77
    dev = torch.device("cuda", 0)
    params, seg_bytes = layout()
    alloc0 = torch.zeros(seg_bytes[0], dtype=torch.uint8, device=dev)
    alloc1 = torch.zeros(SEG1_SKIP + seg_bytes[1], dtype=torch.uint8, device=dev)
    segs = {0: alloc0, 1: alloc1[SEG1_SKIP:]}
    uuid = str(torch.cuda.get_device_properties(dev).uuid)
    msg_segments = []
    for sid, t in segs.items():
        handle, offset = export(t)
        msg_segments.append({"id": sid, "kind": "cuda", "bytes": int(t.numel()), "handle_type": "cuda_ipc",
                             "ipc_handle": handle, "offset": int(offset), "device_uuid": uuid})
    msg = {"type": "attach", "protocol": 1, "token": args.token, "engine_id": args.engine_id, "kind": args.kind,
           "mode": "direct", "rank": 0, "world_size": 1, "parallelism": {"tp_size": 1, "tp_rank": 0},
           "model_config_json": "{}", "segments": msg_segments, "params": params}
    if args.handoff:
        with open(args.handoff, "w") as f:
            json.dump(msg, f)
        return 0  # the allocations die with this process

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    send_frame(sock, msg)
    reply = recv_frame(sock)
    print("cuda_engine: attach reply %s" % reply, flush=True)
    if not reply or not reply.get("ok"):
        return 1
    while True:
        m = recv_frame(sock)
        if m is None:
            return 0
        if m.get("type") != "commit":
            continue
        version = int(m["version"])
        torch.cuda.synchronize()
        bad = {}
        for sid, t in segs.items():
            want = np.zeros(t.numel(), dtype=np.uint8)
            for i, p in enumerate(params):
                if p["segment"] == sid:
                    want[p["offset"]:p["offset"] + p["bytes"]] = expected_bytes(version, i, p["bytes"])
            got = t.cpu().numpy()
            diff = np.nonzero(got != want)[0]
            if diff.size:
                bad["segment %d" % sid] = {"bytes_differing": int(diff.size), "first": int(diff[0])}
        # The parameters as the engine's own typed tensors must read the same bytes (views of the segments).
        for i, p in enumerate(params):
            dt = getattr(torch, p["dtype"])
            t = segs[p["segment"]][p["offset"]:p["offset"] + p["bytes"]].view(dt).view(p["shape"])
            if not np.array_equal(t.view(torch.uint8).flatten().cpu().numpy(),
                                  expected_bytes(version, i, p["bytes"])):
                bad[p["name"]] = "typed view differs"
        with open(args.result, "a") as f:
            f.write(json.dumps({"version": version, "ok": not bad, "bad": bad,
                                "bytes": sum(p["bytes"] for p in params)}) + "\n")
        print("cuda_engine: version %d %s" % (version, "ok" if not bad else bad), flush=True)


if __name__ == "__main__":
    sys.exit(main())
