#!/usr/bin/env python3
"""One rank of the broadcast baseline (the path miles/slime/verl use): the trainer's head rank (rank 0, PP=1 so one
stage) broadcasts every full HF tensor with torch.distributed on the gloo backend to every engine rank; each engine
rank keeps its own tensor-parallel shard (a copy, as an engine's loader does). After the timed part every engine rank
checks every shard it kept bit-exactly against weight_gen.py (numpy, independent of the C++ generator that produced
the head's bytes) sliced by this file's own TP rules.

    bcast_rank.py --rank R --world W --master IP:PORT --manifest FILE.json --raw FILE --tp N --out RESULT.json

Rank 0 is the head; ranks 1.. are engine ranks, engine rank = (rank - 1) % tp. Writes RESULT.json:
{rank, seconds, bytes, tensors, checked, mismatches: [...]}.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import weight_gen  # noqa: E402

TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
NP_BITS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split the output dim (0)
ROW = ("o_proj", "down_proj")  # split the input dim (1)


def shard_slice(name, shape, tp, r, cfg):
    """(dim, start, stop) of engine rank r's part of an HF tensor, or None when the rank keeps it whole
    (Llama/Qwen2/Qwen3 dense tensor parallelism; vocab rows padded to a multiple of 64)."""
    parts = name.split(".")
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        padded = -(-shape[0] // 64) * 64
        per = padded // tp
        return 0, min(r * per, shape[0]), min((r + 1) * per, shape[0])
    mod = parts[-2] if len(parts) >= 2 else ""
    if mod in ("k_proj", "v_proj"):
        kv = cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        if tp > kv:  # heads replicated: rank r holds kv head r * kv // tp
            h = r * kv // tp
            return 0, h * hd, (h + 1) * hd
        per = shape[0] // tp
        return 0, r * per, (r + 1) * per
    if mod in COLUMN:
        per = shape[0] // tp
        return 0, r * per, (r + 1) * per
    if mod in ROW and len(shape) == 2:
        per = shape[1] // tp
        return 1, r * per, (r + 1) * per
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--raw", default="")
    ap.add_argument("--config", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout-s", type=float, default=600)
    a = ap.parse_args()
    with open(a.manifest) as f:
        man = json.load(f)
    with open(a.config) as f:
        cfg = json.load(f)
    step, tensors = man["step"], man["tensors"]
    torch.set_num_threads(1)

    import datetime
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.timeout_s))
    head = a.rank == 0
    er = (a.rank - 1) % a.tp
    if head:  # the trainer's tensors, already in its memory before the update starts
        raw = np.fromfile(a.raw, dtype=np.uint8)
        bufs = [torch.from_numpy(raw[t["offset"]:t["offset"] + t["bytes"]].copy()).view(TORCH_DTYPE[t["dtype"]])
                .reshape(t["shape"]) for t in tensors]
    kept = []
    dist.barrier()
    t0 = time.perf_counter()
    nbytes = 0
    for i, t in enumerate(tensors):
        buf = bufs[i] if head else torch.empty(t["shape"], dtype=TORCH_DTYPE[t["dtype"]])
        dist.broadcast(buf, src=0)
        nbytes += t["bytes"]
        if not head:
            s = shard_slice(t["name"], t["shape"], a.tp, er, cfg)
            kept.append(buf.clone() if s is None else buf.narrow(s[0], s[1], s[2] - s[1]).clone())
    dist.barrier()
    seconds = time.perf_counter() - t0

    mismatches, checked = [], 0
    if not head:
        for t, got in zip(tensors, kept):
            exp = weight_gen.generate(t["name"], step, t["dtype"], t["shape"])
            s = shard_slice(t["name"], t["shape"], a.tp, er, cfg)
            if s is not None:
                exp = np.take(exp, np.arange(s[1], s[2]), axis=s[0])
            got_bits = got.contiguous().view(torch.int16 if got.element_size() == 2 else torch.int32).numpy()
            checked += 1
            if got_bits.shape != exp.shape or not np.array_equal(got_bits.view(NP_BITS[t["dtype"]]), exp):
                diff = -1 if got_bits.shape != exp.shape else int(np.count_nonzero(got_bits.view(exp.dtype) != exp))
                mismatches.append(f"{t['name']} (engine rank {er}): {diff} elements differ")
    dist.destroy_process_group()
    with open(a.out, "w") as f:
        json.dump({"rank": a.rank, "seconds": seconds, "bytes": nbytes, "tensors": len(tensors), "checked": checked,
                   "mismatches": mismatches}, f)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
