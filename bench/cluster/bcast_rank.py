#!/usr/bin/env python3
"""One rank of the broadcast baseline (the path miles/slime/verl use): the trainer's head rank (rank 0, PP=1 so one
stage) broadcasts every full HF tensor with torch.distributed on the gloo backend to every engine rank; each engine
rank hands what it received to its engine, which loads it with its own loader (wsync-engine-ref --load-socket: the
same loader that verifies wsync's updates).

With --trainers R > 1 the trainer ranks hold real shards (Megatron TP=R for the dense tensors, EP=R for the experts,
expert TP 1; Qwen3 / Qwen3-MoE tensor names), and the head first gathers the full tensors: a gloo all-gather among
the trainer ranks per split tensor, as Megatron's weight export does, before the broadcast.

Timed (between two barriers of all ranks): gather, broadcast, the engine's load. After the clock: every engine
checks every rank's parameters bit-exactly (its Verify), and every engine rank checks the full tensors it received
against weight_gen.py (numpy, independent of the C++ generator that produced the head's bytes).

    bcast_rank.py --rank R --world W --master IP:PORT --manifest FILE.json --raw FILE --config CFG --tp N
                  --out RESULT.json [--trainers R] [--load-socket PATH] [--shm-dir /dev/shm]

Ranks 0..R-1 are trainer ranks (0 the head); ranks R.. are engine ranks, engine rank = (rank - R) % tp. Writes
RESULT.json: {rank, seconds, gather_s, bcast_s, load_s, bytes, tensors, checked, engine_verify, mismatches: [...]}.
"""

import argparse
import datetime
import json
import os
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import weight_gen  # noqa: E402

TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
NP_BITS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # Megatron column-parallel: split dim 0
ROW = ("o_proj", "down_proj")  # row-parallel: split dim 1


def trainer_split(name, shape):
    """How a trainer rank holds an HF tensor: ("expert", index), ("tp", dim) or ("whole", None)."""
    parts = name.split(".")
    if ".mlp.experts." in name:
        return "expert", int(parts[parts.index("experts") + 1])
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return "tp", 0
    mod = parts[-2] if len(parts) >= 2 else ""
    if mod in COLUMN:
        return "tp", 0
    if mod in ROW and len(shape) == 2:
        return "tp", 1
    return "whole", None


def engine_request(path, req, timeout):
    """One request on the engine's load socket; returns its JSON reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall((json.dumps(req) + "\n").encode())
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError(f"engine load socket {path} closed without a reply to {req['type']}")
            buf += chunk
    return json.loads(buf)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--raw", default="")
    ap.add_argument("--config", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--load-socket", default="")
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout-s", type=float, default=600)
    a = ap.parse_args()
    with open(a.manifest) as f:
        man = json.load(f)
    with open(a.config) as f:
        cfg = json.load(f)
    step, tensors = man["step"], man["tensors"]
    R = a.trainers
    torch.set_num_threads(1)

    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.timeout_s))
    # Every rank creates every group (torch.distributed's rule); the broadcast's group leaves the other trainer
    # ranks out, so they neither receive nor relay the model.
    trainer_group = dist.new_group(list(range(R))) if R > 1 else None
    bcast_group = dist.new_group([0] + list(range(R, a.world)))
    trainer = a.rank < R
    head = a.rank == 0
    er = (a.rank - R) % a.tp

    held = {}
    if trainer:  # the trainer's tensors (its shards), already in its memory before the update starts
        raw = np.fromfile(a.raw, dtype=np.uint8)
        experts = cfg.get("num_experts", 0)
        per_rank = experts // R if experts else 0
        for t in tensors:
            full = torch.from_numpy(raw[t["offset"]:t["offset"] + t["bytes"]].copy()).view(
                TORCH_DTYPE[t["dtype"]]).reshape(t["shape"])
            kind, arg = trainer_split(t["name"], t["shape"]) if R > 1 else ("whole", None)
            if kind == "tp":
                held[t["name"]] = full.chunk(R, dim=arg)[a.rank].clone()
            elif kind == "expert":
                if arg // per_rank == a.rank:
                    held[t["name"]] = full
            else:
                held[t["name"]] = full
        del raw
    else:
        total = max(t["offset"] + t["bytes"] for t in tensors)
        shm = os.path.join(a.shm_dir, f"wsync-bcast-{os.getpid()}-{a.rank}")
        recv = np.memmap(shm, dtype=np.uint8, mode="w+", shape=(total,))

    dist.barrier()
    t0 = time.perf_counter()
    gathered = {}
    if trainer and R > 1:
        experts = cfg.get("num_experts", 0)
        per_rank = experts // R if experts else 0
        for t in tensors:
            kind, arg = trainer_split(t["name"], t["shape"])
            if kind == "tp":
                parts = [torch.empty_like(held[t["name"]]) for _ in range(R)]
                dist.all_gather(parts, held[t["name"]], group=trainer_group)
                gathered[t["name"]] = torch.cat(parts, dim=arg)
            elif kind == "expert" and arg // per_rank == a.rank:
                # Local expert k of every EP rank: experts k, k + E/R, ... in one all-gather.
                parts = [torch.empty_like(held[t["name"]]) for _ in range(R)]
                dist.all_gather(parts, held[t["name"]], group=trainer_group)
                k = arg - a.rank * per_rank
                for j in range(R):
                    gathered[t["name"].replace(f".experts.{arg}.", f".experts.{j * per_rank + k}.")] = parts[j]
    t_gather = time.perf_counter()
    nbytes = 0
    if head or not trainer:
        for t in tensors:
            if head:
                buf = gathered.get(t["name"], held.get(t["name"]))
            else:
                buf = torch.from_numpy(recv[t["offset"]:t["offset"] + t["bytes"]]).view(
                    TORCH_DTYPE[t["dtype"]]).reshape(t["shape"])
            dist.broadcast(buf, src=0, group=bcast_group)
            nbytes += t["bytes"]
    t_bcast = time.perf_counter()
    load = None
    if not trainer:
        recv.flush()
        load = engine_request(a.load_socket, {"type": "load", "rank": er, "file": shm, "tensors": tensors},
                              a.timeout_s)
    t_load = time.perf_counter()
    dist.barrier()
    seconds = time.perf_counter() - t0

    mismatches, checked, verify = [], 0, None
    if load is not None and not load.get("ok"):
        mismatches.append(f"engine rank {er}: load failed: {load.get('error')}")
    if not trainer:  # the barrier above: every rank of every engine has loaded
        if er == 0 and a.load_socket:
            verify = engine_request(a.load_socket, {"type": "verify", "step": step}, a.timeout_s)
            if not verify.get("ok"):
                mismatches.append(f"engine verify step {step}: {verify.get('error') or verify.get('mismatches')}")
        for t in tensors:
            exp = weight_gen.generate(t["name"], step, t["dtype"], t["shape"])
            got = np.asarray(recv[t["offset"]:t["offset"] + t["bytes"]]).view(NP_BITS[t["dtype"]]).reshape(exp.shape)
            checked += 1
            if not np.array_equal(got, exp):
                mismatches.append(f"{t['name']} (engine rank {er}): {int(np.count_nonzero(got != exp))} elements "
                                  "differ from weight_gen.py")
        del recv
        os.unlink(shm)
    dist.destroy_process_group()
    with open(a.out, "w") as f:
        json.dump({"rank": a.rank, "seconds": seconds, "gather_s": t_gather - t0, "bcast_s": t_bcast - t_gather,
                   "load_s": t_load - t_bcast, "bytes": nbytes, "tensors": len(tensors), "checked": checked,
                   "engine_verify": verify, "mismatches": mismatches}, f)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
